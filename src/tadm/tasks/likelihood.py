"""lm-eval's log-likelihood requests answered by tadm's own masked diffusion LMs, from tadm's likelihood bounds.

:class:`LikelihoodScorer` scores ``loglikelihood`` requests (multiple-choice and likelihood tasks)
and ``loglikelihood_rolling`` ones (perplexity tasks) for a :class:`~tadm.tasks.generation.PrefixGenerator`
(``model=...``: TADM, MDLM, ADLM or a converted released MDLM) with the estimators of
:mod:`tadm.eval.continuation`, following LLaDA's evaluation (``eval_llada.py``):

* tokens: the context is ``[BOS] + tokens(context)``; the continuation is what tokenizing context +
  continuation adds after the context's tokens, with the context's trailing spaces moved to the
  continuation first (LLaDA's ``_encode_pair``). A context too long for the model keeps its last
  tokens; a continuation that cannot fit beside [BOS] is a ValueError;
* K = 1 (``K=1``, the default): the continuous-time NELBO in LLaDA's stratified number-of-masks form,
  ``mc_samples`` draws (LLaDA's ``mc_num``), unless ``likelihood_steps`` asks for the discrete bound;
* a fixed K > 1: the discrete-time bound of the cached reverse process of Algorithm 1 with the anchor
  refreshed every K steps, on T = ``likelihood_steps`` (default: the sampler's ``steps``) steps,
  ``mc_samples`` T-step sweeps; adaptive and scheduled policies are refused (their refresh steps
  depend on the sampled canvas);
* randomness: each request's draws come from generators seeded with a hash of the run's ``seed`` and
  the request's text (:func:`~tadm.tasks.lm_eval_model.batch_seed`), so a result does not depend on
  the order or the other requests;
* ``is_greedy``: with ``greedy_check`` LLaDA's check (``suffix_greedy_prediction``): starting from the
  masked continuation, decode one token per pass, the most confident first; whether that gives the
  continuation. Without it every request reports False (LLaDA's recommended setting), which only
  metrics of greedy agreement such as LAMBADA's ``acc`` read;
* rolling: the text's tokens in lm-eval's disjoint rolling windows of the model's length, each scored
  as a continuation of the window's context; the log-likelihood is their sum.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from tadm.eval.continuation import ContinuationBound, continuation_cached_bound, continuation_elbo
from tadm.eval.likelihood import anchored_log_probs

__all__ = ["LikelihoodScorer", "LikelihoodStats", "request_seed"]


def request_seed(seed: int, *texts: str) -> int:
    """A generator seed from the run's ``seed`` and a request's texts (order-independent results)."""
    digest = hashlib.sha256(f"loglikelihood:{int(seed)}".encode())
    for text in texts:
        digest.update(b"\x00" + text.encode("utf-8"))
    return int(digest.hexdigest()[:15], 16)


@dataclass
class LikelihoodStats:
    """One scored (context, continuation) pair: its tokens, the bound, its cost."""

    task: str | None
    doc_id: int | None
    kind: str  # "elbo" or "cached"
    refresh_interval: int
    num_steps: int | None
    samples: int
    context_tokens: int
    continuation_tokens: int
    context_tokens_dropped: int
    nll: float
    stderr: float
    seconds: float
    network_passes: int
    layer_calls: dict[str, int]


class LikelihoodScorer:
    """Log-likelihoods of continuations under a :class:`~tadm.tasks.generation.PrefixGenerator`'s model.

    Args:
        generator: the model, its tokenizer and its refresh policy (``settings.policy``) and steps.
        mc_samples: Monte-Carlo draws per request (>= 1).
        likelihood_steps: T of the discrete bound (None: the continuous bound at K = 1, the sampler's
            steps at K > 1).
        seed: the run's seed.
        batch_size: draws scored side by side in one network pass.
        greedy_check: compute ``is_greedy`` (one pass per continuation token).
    """

    def __init__(self, generator: Any, *, mc_samples: int, likelihood_steps: int | None, seed: int,
                 batch_size: int, greedy_check: bool = False) -> None:
        interval = generator.settings.policy.fixed_interval
        if interval is None:
            raise ValueError(f"tadm model: loglikelihood requests need a fixed refresh interval K (the cached bound "
                             f"refreshes at fixed steps); got refresh policy {generator.settings.policy.label()}")
        self.generator, self.model, self.tokenizer = generator, generator.model, generator.tokenizer
        self.refresh_interval, self.mc_samples, self.seed = interval, mc_samples, seed
        self.batch_size, self.greedy_check = batch_size, greedy_check
        self.num_steps = likelihood_steps if likelihood_steps is not None else (
            None if interval == 1 else generator.steps)
        self.max_seq_len = int(self.model.max_seq_len)

    @property
    def kind(self) -> str:
        return "elbo" if self.num_steps is None else "cached"

    def describe(self) -> dict[str, Any]:
        """The estimator's settings, as written to results."""
        return {"bound": self.kind, "K": self.refresh_interval, "likelihood_steps": self.num_steps,
                "mc_samples": self.mc_samples}

    # ---------------------------------------------------------------------------------- tokens
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """([BOS] + context tokens, continuation tokens) as LLaDA's ``_encode_pair`` splits them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.generator.encode(context + continuation)
        head = self.generator.encode(context)
        return head, whole[len(head):]

    # --------------------------------------------------------------------------------- scoring
    def _bound(self, context: list[int], continuation: list[int], seed: int) -> ContinuationBound:
        ctx, cont = torch.tensor(context), torch.tensor(continuation)
        generator = torch.Generator().manual_seed(seed)
        if self.num_steps is None:
            return continuation_elbo(self.model, ctx, cont, num_samples=self.mc_samples, generator=generator,
                                     batch_size=self.batch_size)
        return continuation_cached_bound(self.model, ctx, cont, num_steps=self.num_steps,
                                         refresh_interval=self.refresh_interval, num_samples=self.mc_samples,
                                         generator=generator, anchor_generator=torch.Generator().manual_seed(seed + 1),
                                         batch_size=self.batch_size)

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """The context cut to fit beside the continuation (its last tokens kept), and how many were cut."""
        room = self.max_seq_len - len(continuation)
        if not continuation or room < 1:
            raise ValueError(f"tadm model: a continuation of {len(continuation)} tokens does not fit the model's "
                             f"max_seq_len ({self.max_seq_len}) beside at least one context token"
                             if continuation else "tadm model: a loglikelihood request with an empty continuation")
        kept = context[-room:]
        return kept, len(context) - len(kept)

    def score_ids(self, context: list[int], continuation: list[int], seed: int,
                  task: str | None = None, doc_id: int | None = None) -> tuple[float, bool, LikelihoodStats]:
        """(log-likelihood estimate, is_greedy, stats) of token ids ``continuation`` after ``context``."""
        context, dropped = self._fit(context, continuation)
        start = time.perf_counter()
        bound = self._bound(context, continuation, seed)
        greedy = self._greedy(context, continuation) if self.greedy_check else False
        calls = bound.layer_calls.as_dict()
        stats = LikelihoodStats(task=task, doc_id=doc_id, kind=bound.kind, refresh_interval=self.refresh_interval,
                                num_steps=bound.num_steps, samples=bound.samples, context_tokens=len(context),
                                continuation_tokens=len(continuation), context_tokens_dropped=dropped, nll=bound.nll,
                                stderr=bound.stderr, seconds=time.perf_counter() - start,
                                network_passes=calls["denoiser_calls"], layer_calls=calls)
        return -bound.nll, greedy, stats

    def score(self, context: str, continuation: str, task: str | None = None,
              doc_id: int | None = None) -> tuple[float, bool, LikelihoodStats]:
        """(log-likelihood estimate, is_greedy, stats) of the text ``continuation`` after ``context``."""
        head, tail = self.encode_pair(context, continuation)
        return self.score_ids(head, tail, request_seed(self.seed, context, continuation), task, doc_id)

    def score_rolling(self, text: str, task: str | None = None,
                      doc_id: int | None = None) -> tuple[float, list[LikelihoodStats]]:
        """The log-likelihood estimate of ``text`` over disjoint rolling windows (lm-eval's), and per-window stats."""
        # deferred: lm-eval is an optional dependency (the tasks extra)
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        tokens = self.tokenizer.encode(text)
        if not tokens:
            return 0.0, []
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=tokens, prefix_token=self.tokenizer.bos_id, max_seq_len=self.max_seq_len - 1, context_len=1)]
        total, stats = 0.0, []
        for n, (context, continuation) in enumerate(windows):
            ll, _, window_stats = self.score_ids(list(context), list(continuation),
                                                 request_seed(self.seed, text, str(n)), task, doc_id)
            total += ll
            stats.append(window_stats)
        return total, stats

    @torch.no_grad()
    def _greedy(self, context: list[int], continuation: list[int]) -> bool:
        """LLaDA's greedy check: decode the masked continuation one most-confident token per pass (K = 1)."""
        model, mask_id = self.model, int(self.model.mask_token_id)
        device = next(model.parameters()).device
        P, n = len(context), len(continuation)
        z = torch.tensor([context + [mask_id] * n], device=device)  # (1, L)
        for _ in range(n):
            t = (z[:, P:] == mask_id).float().mean(-1)  # (1,) share of the continuation still masked
            probs = anchored_log_probs(model, z, t, z, t)[0, P:].exp()  # (n, V)
            confidence, best = probs.max(-1)  # (n,)
            confidence = torch.where(z[0, P:] == mask_id, confidence, torch.full_like(confidence, -1.0))
            i = int(confidence.argmax())
            z[0, P + i] = best[i]
        return z[0, P:].tolist() == list(continuation)
