"""What each generation request cost: tokens, wall time, tokens/s and Transformer-layer calls.

The post-training table of the paper (sec. "TADM:Post-train") reports throughput (tokens/s) and
compute beside accuracy. Requests are generated in batches, so time and layer calls belong to a
batch: every request records its batch's wall time and layer calls, and its own token count;
:func:`summarize` adds batches once each.

* ``generated_tokens``: ids the model produced for the request before its first end-of-sequence
  token, at most the request's ``max_gen_toks`` (stop strings cut the returned text, not this count);
* ``tokens_per_second``: a request's ``generated_tokens / seconds`` of its batch; the summary's is
  all generated tokens over the summed batch wall time;
* ``layer_calls``: :class:`~tadm.sampling.anchor_cache.LayerCallCounter` of the batch's denoising
  passes (shared, anchor, denoiser, total, anchor refreshes), and ``encoder_layer_calls`` of the
  prompt encoder (post-training bases only). The summary's ``layer_calls_per_request`` is the mean
  over requests of their batch's total: the layer calls one generation went through (e.g. 6 layers x
  12 steps = 72 for one canvas at K = 1), whatever the batch size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from tadm.sampling.refresh import refresh_policy_from_config

__all__ = ["BatchStats", "RequestStats", "summarize", "summarize_likelihood", "summary_table"]


@dataclass
class BatchStats:
    """One generation call: its size, token budget, wall time and layer calls."""

    index: int
    size: int
    max_new_tokens: int
    seed: int
    seconds: float
    generated_tokens: int
    layer_calls: dict[str, int] = field(default_factory=dict)
    encoder_layer_calls: int = 0


@dataclass
class RequestStats:
    """One ``generate_until`` request: its tokens and the cost of the batch it ran in."""

    task: str | None
    doc_id: int | None
    batch: int  # BatchStats.index
    batch_size: int
    prompt_tokens: int
    generated_tokens: int
    seconds: float  # wall time of the batch
    layer_calls: dict[str, int]  # of the batch
    encoder_layer_calls: int  # of the batch
    decoder_forward_passes: int  # denoising passes this row took part in
    stop: str  # "eos", "until" (a stop string cut the text) or "length"
    prompt_tokens_dropped: int = 0  # cut from the prompt's start to fit the canvas (tadm's own models)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


def summarize(requests: Iterable[RequestStats], batches: Iterable[BatchStats]) -> dict[str, Any]:
    """Totals over ``batches`` (each counted once) and per-request means over ``requests``."""
    requests, batches = list(requests), list(batches)
    seconds = sum(b.seconds for b in batches)
    tokens = sum(r.generated_tokens for r in requests)
    calls: Counter[str] = Counter()
    for b in batches:
        calls.update({key: int(value) for key, value in b.layer_calls.items()})
    n = len(requests)
    stops = {kind: sum(r.stop == kind for r in requests) for kind in ("eos", "until", "length")}
    return {
        "requests": n,
        "batches": len(batches),
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "mean_generated_tokens": tokens / n if n else 0.0,
        "layer_calls": dict(calls),
        "encoder_layer_calls": sum(b.encoder_layer_calls for b in batches),
        "layer_calls_per_request": sum(r.layer_calls.get("total", 0) for r in requests) / n if n else 0.0,
        "stops": stops,
        "prompts_cut": sum(r.prompt_tokens_dropped > 0 for r in requests),
    }


def summarize_likelihood(stats: Iterable[Any]) -> dict[str, Any]:
    """Totals over scored (context, continuation) pairs (:class:`tadm.tasks.likelihood.LikelihoodStats`): scored
    and context tokens, Monte-Carlo draws, wall time, scored tokens per second, network passes and layer calls."""
    stats = list(stats)
    seconds = sum(s.seconds for s in stats)
    scored = sum(s.continuation_tokens for s in stats)
    calls: Counter[str] = Counter()
    for s in stats:
        calls.update({key: int(value) for key, value in s.layer_calls.items()})
    return {
        "requests": len(stats),
        "continuation_tokens": scored,
        "context_tokens": sum(s.context_tokens for s in stats),
        "contexts_cut": sum(s.context_tokens_dropped > 0 for s in stats),
        "samples": sum(s.samples for s in stats),
        "seconds": seconds,
        "tokens_per_second": scored / seconds if seconds > 0 else 0.0,
        "network_passes": sum(s.network_passes for s in stats),
        "layer_calls": dict(calls),
    }


def summary_table(summary: dict[str, Any]) -> str:
    """A Markdown table of what a run's generation cost, from ``TadmLM.summary()`` (:func:`summarize` plus the
    generator's settings): its refresh policy (K), requests, generated tokens, wall time, tokens/s and
    Transformer-layer calls (all, per request, per stage) with the anchor refreshes."""
    calls = summary["layer_calls"]
    label = refresh_policy_from_config(summary["settings"]["refresh_policy"]).label()  # "K=2", "adaptive tau=0.3"
    head = ("refresh", "requests", "generated tokens", "seconds", "tokens/s", "layer calls", "per request",
            "shared / anchor / denoiser", "anchor refreshes")
    row = (label, f"{summary['requests']:,}", f"{summary['generated_tokens']:,}", f"{summary['seconds']:.1f}",
           f"{summary['tokens_per_second']:.1f}", f"{calls.get('total', 0):,}",
           f"{summary['layer_calls_per_request']:,.0f}",
           f"{calls.get('shared', 0):,} / {calls.get('anchor', 0):,} / {calls.get('denoiser', 0):,}",
           f"{calls.get('anchor_refreshes', 0):,}")
    return "\n".join(["|" + "|".join(head) + "|", "|" + "|".join("---:" for _ in head) + "|", "|" + "|".join(row) + "|"])
