"""Generative perplexity (Gen PPL): the evaluator's perplexity of decoded samples, as the field computes it.

Procedure (MDLM / ReMDM reference code, evaluator GPT-2 Large in the paper):

1. decode each sample's token ids to text with the diffusion model's tokenizer
   (:func:`decode_samples`; special tokens such as ``<|endoftext|>`` are kept as text);
2. re-tokenize every text with the evaluator's tokenizer (no BOS/EOS added), keeping all its tokens
   (the reference truncates; see *Differences from the reference* below);
3. cut each text into consecutive chunks of ``context_size`` tokens (1,024, or the evaluator's
   maximum length if smaller); each chunk is scored on its own, so its first token is context
   only and is never scored;
4. score the chunks in batches (right-padded; causal attention keeps padding from changing the
   real positions, so the result does not depend on the batch size);
5. Gen PPL = exp(sum of NLLs / number of counted positions), token-weighted over the whole sample
   set (a corpus-level perplexity, not a mean of per-sample perplexities).

Which positions count. Target position j >= 1 of a chunk (predicting token j from tokens < j)
counts iff it is a real token (not padding) and either its token is not an end-of-text id, or
it is the FIRST end-of-text token of the chunk, position 0 included. End-of-text ids are the
evaluator's EOS and pad ids and ``<|endoftext|>`` (:attr:`Evaluator.end_ids`). This is the
reference code's mask ``first_eos | (token != eos)`` with ``first_eos = cumsum(token == eos) == 1``.

Differences from the reference (ReMDM's ``compute_generative_perplexity`` / ``eval_retokenize``):

* Length. The reference re-tokenizes with ``truncation=True, max_length=L`` (the model's
  generation length), so it scores at most L evaluator tokens of a sample. tadm scores every
  evaluator token of a decoded sample, the chunks past L included: a tadm model's tokenizer is not
  the evaluator's, and L of its tokens usually re-tokenize into more than L evaluator tokens, so
  cutting at L evaluator tokens would drop the end of the generated text. The numbers therefore
  differ from the reference's whenever a sample re-tokenizes past L; ``gen_ppl(...,
  max_tokens=L)`` gives the reference's truncation (the sweep and study pipeline does not pass it).
* Padding. Padding never counts here. The reference tokenizes the whole sample set in one call
  with ``padding=True``, padding with EOS, so every text shorter than the set's longest (truncated)
  text has its first pad scored as a predicted end of text when its chunk holds no EOS of its own:
  the extra scored position depends on the longest text of the set, not on the batch size. A
  sample that starts with ``<|endoftext|>`` (as a BOS) never has its pad scored there, since its
  first EOS is position 0, which is context only. When every sample re-tokenizes to L tokens or
  more, nothing is padded and the two masks agree. (The reference's number does depend on its batch
  size in another way: it scores only the first ``N // batch_size * batch_size`` samples.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from tadm.eval.evaluator import Evaluator
from tadm.eval.mauve import text_features
from tadm.records import dataclass_record

__all__ = ["GenPPLResult", "counted_positions", "decode_samples", "gen_ppl"]


def decode_samples(tokens: Tensor | Sequence[Sequence[int]], tokenizer: Any, *, drop_mask: bool = True) -> list[str]:
    """Texts of generated samples (N, L) with the model's tokenizer, special tokens kept.

    ``tokenizer`` needs ``vocab_size`` and ``decode(ids)``; a ``mask_id`` attribute, if present,
    lets leftover mask tokens be dropped (``drop_mask``). Ids outside the tokenizer's vocabulary
    mean the samples came from a model with another vocabulary: ValueError.
    """
    rows = tokens.tolist() if isinstance(tokens, Tensor) else [list(r) for r in tokens]
    if len(rows) == 0:
        raise ValueError("the sample set is empty: nothing to decode")
    vocab = int(tokenizer.vocab_size)
    top = max((max(r) for r in rows if len(r)), default=0)
    low = min((min(r) for r in rows if len(r)), default=0)
    if top >= vocab or low < 0:
        bad = top if top >= vocab else low
        raise ValueError(
            f"mismatched tokenizer: the samples hold token id {bad} but the tokenizer has ids 0..{vocab - 1}; "
            "decode with the tokenizer of the model that generated them"
        )
    mask_id = getattr(tokenizer, "mask_id", None)
    if drop_mask and mask_id is not None:
        rows = [[i for i in r if i != mask_id] for r in rows]
    return [tokenizer.decode(r) for r in rows]


def counted_positions(ids: Tensor, valid: Tensor, end_ids: Sequence[int] | frozenset[int]) -> Tensor:
    """Which next-token targets of each chunk count toward Gen PPL (see the module docstring).

    Args:
        ids: (B, n) token ids of chunks.
        valid: (B, n) bool, False at padding.
        end_ids: end-of-text ids.

    Returns:
        (B, n - 1) bool for the targets ids[:, 1:].
    """
    ends = torch.tensor(sorted(end_ids), dtype=ids.dtype, device=ids.device)
    is_end = torch.isin(ids, ends) & valid  # (B, n)
    first_end = is_end & (is_end.long().cumsum(-1) == 1)  # (B, n)
    counted = valid & (~is_end | first_end)  # (B, n)
    return counted[:, 1:]


@dataclass
class GenPPLResult:
    """Corpus-level Gen PPL and its parts."""

    gen_ppl: float
    nll: float  # mean NLL per counted position (nats)
    num_tokens: int  # counted positions
    num_texts: int
    num_chunks: int
    context_size: int
    evaluator: str
    per_text_nll: list[float] = field(default_factory=list)  # summed NLL of each text (nats)
    per_text_tokens: list[int] = field(default_factory=list)  # counted positions of each text
    features: Any = None  # (N, D) float32 MAUVE features when asked for (``gen_ppl(..., features=True)``)

    def as_dict(self) -> dict[str, Any]:
        return dataclass_record(self, omit=("features", "per_text_nll", "per_text_tokens"))


Segment = tuple[int, int, list[int]]  # (text index, chunk start, chunk ids)


def _segments(encoded: Sequence[Sequence[int]], size: int, max_tokens: int | None) -> list[Segment]:
    """Chunks of at most ``size`` ids of every text (after ``max_tokens``), longest first, none of one token
    (it has no scored position); similar lengths then share a batch, with less padding."""
    if max_tokens is not None:
        encoded = [ids[:max_tokens] for ids in encoded]
    segments = [(n, s, list(ids[s : s + size])) for n, ids in enumerate(encoded) for s in range(0, len(ids), size)]
    return sorted((seg for seg in segments if len(seg[2]) >= 2), key=lambda seg: -len(seg[2]))


def _score_chunks(evaluator: Evaluator, group: Sequence[Segment], hidden: bool) -> tuple[Tensor, Tensor, Any]:
    """Per position of a padded batch of chunks: the NLL of the next token (b, n - 1), whether it counts
    (b, n - 1), and the last-layer hidden states (b, n, D) when ``hidden``."""
    ids, valid = evaluator.pad([chunk for _, _, chunk in group])  # (b, n), (b, n)
    output = evaluator.forward(ids, valid.long(), hidden=hidden)
    logits = output.logits[:, :-1].float()  # (b, n - 1, V)
    targets = ids[:, 1:].to(logits.device)  # (b, n - 1)
    # -log softmax(logits)[target] without materialising the (b, n - 1, V) log-probabilities
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (b, n - 1)
    nll = (torch.logsumexp(logits, dim=-1) - picked).double().cpu()  # (b, n - 1)
    counted = counted_positions(ids, valid, evaluator.end_ids)  # (b, n - 1)
    # where(), not a product: a padded position's logits may be non-finite
    return torch.where(counted, nll, torch.zeros((), dtype=nll.dtype)), counted, output.hidden if hidden else None


@torch.no_grad()
def gen_ppl(
    texts: Sequence[str],
    evaluator: Evaluator,
    *,
    batch_size: int = 8,
    context_size: int | None = None,
    max_tokens: int | None = None,
    progress: bool = False,
    features: bool = False,
) -> GenPPLResult:
    """Gen PPL of ``texts`` under ``evaluator`` (steps 2 to 5 of the module docstring).

    With ``features`` the same forward passes also give each text's MAUVE feature (the last-layer
    hidden state at the last token of its first chunk, which is what
    :func:`tadm.eval.mauve.text_features` computes for the evaluator's context), saving the second
    pass over the samples; it is returned in ``result.features``.

    Args:
        texts: decoded samples (see :func:`decode_samples`).
        evaluator: a loaded :class:`~tadm.eval.evaluator.Evaluator`.
        batch_size: chunks per forward pass.
        context_size: chunk length; default and upper bound ``evaluator.context_size``.
        max_tokens: keep only the first ``max_tokens`` evaluator tokens of each text (the reference
            truncates to the generation length); None keeps all.
        progress: show a progress bar over batches.

    Raises:
        ValueError: an empty sample set, or texts too short to have a single scored position.
    """
    if len(texts) == 0:
        raise ValueError("the sample set is empty: Gen PPL needs at least one text")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    size = evaluator.context_size if context_size is None else min(context_size, evaluator.context_size)
    if size < 2:
        raise ValueError(f"context_size must be >= 2 (one context token + one scored token), got {size}")
    segments = _segments(evaluator.encode(texts), size, max_tokens)
    nll_sum = [0.0] * len(texts)
    counts = [0] * len(texts)
    feats: list[Any] = [None] * len(texts)
    batches = range(0, len(segments), batch_size)
    for start in tqdm(batches, desc="Gen PPL", disable=not progress, leave=False):
        group = segments[start : start + batch_size]
        nll, counted, hidden = _score_chunks(evaluator, group, features)
        for row, (n, first, chunk) in enumerate(group):
            nll_sum[n] += float(nll[row].sum())
            counts[n] += int(counted[row].sum())
            if hidden is not None and first == 0:
                feats[n] = hidden[row, len(chunk) - 1].float().cpu().numpy()  # (D,)
    total_tokens = sum(counts)
    if total_tokens == 0:
        raise ValueError(
            f"no position to score in {len(texts)} texts: each needs at least 2 evaluator tokens besides end-of-text"
        )
    mean_nll = math.fsum(nll_sum) / total_tokens
    return GenPPLResult(gen_ppl=math.exp(mean_nll), nll=mean_nll, num_tokens=total_tokens, num_texts=len(texts),
                        num_chunks=len(segments), context_size=size, evaluator=evaluator.name, per_text_nll=nll_sum,
                        per_text_tokens=counts,
                        features=_all_features(feats, texts, evaluator, size) if features else None)


def _all_features(feats: list[Any], texts: Sequence[str], evaluator: Evaluator, size: int) -> np.ndarray:
    """(N, D) float32 MAUVE features: those of the scoring pass, plus a separate pass for texts it gave none."""
    missing = [n for n, f in enumerate(feats) if f is None]  # texts of a single evaluator token
    if missing:
        for n, f in zip(missing, text_features([texts[n] for n in missing], evaluator, max_tokens=size)):
            feats[n] = f
    return np.stack(feats).astype(np.float32)
