"""Validation likelihood: the NELBO perplexity bound of diffusion LMs and the exact perplexity of the AR baseline.

This is the zero-shot table of the paper (Table "zero-shot-ppl"): every model reads the same text,
packed into blocks with the model's own tokenizer (:func:`packed_eval_blocks`), and reports
perplexity = exp(nats per token).

* Diffusion LMs (TADM, MDLM, ADLM): the continuous-time masked NELBO (the T -> infinity limit of
  Eq. (masked-nelbo); for TADM the T-ANELBO of Theorem T-ANELBO with a fresh anchor, t' = t, and
  gamma = 0, which is the same bound) estimated by Monte Carlo over t. For a batch of B blocks and
  ``num_t_samples`` = n draws, n * B times are drawn at once with MDLM's antithetic sampler
  (``sample_t``), so every block sees each of n strata of [eps, 1) once; draw r of block b uses
  time number r * B + b. Each draw masks x with ``mask_corrupt(x, alpha_t)`` and adds
  ``loss_weight(t) * -log x_theta(z_t)[x]`` over masked positions (1/t for the log-linear
  schedule). All L positions of a block count as tokens. Random numbers come from one CPU
  generator seeded with ``seed``, drawn in this order per batch: the n * B times, then one mask
  draw per t-sample; the estimate is therefore a deterministic function of the seed. With
  ``discrete_steps = T`` the discrete-time bound of Eq. (masked-nelbo) is used instead (T network
  calls per batch; ``discrete_masked_nelbo``).
* The AR Transformer: exact next-token NLL of positions 1..L-1 of each block given the prefix.

Stale anchors (what the anchor cache costs in likelihood), for any anchored model (TADM, ADLM,
``tadm.nn.NaiveReuse`` of a TADM):

* :func:`stale_anchor_nelbo`: the continuous-time T-ANELBO (Theorem T-ANELBO, gamma = 0) with the
  anchor at a fixed cache age k on a T-step grid: t' = min(1, t + k / T), z_t' ~ q(z_t' | z_t) by
  Eq. (fwd_t_t'), the denoiser at t on z_t. Every k (and every T) reuses the t draws and z_t of
  the fresh estimate, drawn exactly as :func:`diffusion_nelbo` draws them, and one set of
  further-masking uniforms (nested masks), so k = 0 equals :func:`diffusion_nelbo` to the last digit
  and the increase over k = 0 carries no sampling noise of its own. The further-masking draws come
  from a second generator seeded from ``seed``. Optionally also the bound with an uninformative
  anchor, computed on a fully masked canvas (t' = 1).
* :func:`cached_process_nelbo`: the discrete-time bound of the cached reverse process for a
  refresh interval K under Algorithm 1 (t'(i) = time of the most recent refresh,
  Eq. (joint-inf-post-TADM)); K = 1 equals the discrete bound of :func:`diffusion_nelbo`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, islice
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from tadm.diffusion import (discrete_cached_nelbo, discrete_masked_nelbo, further_mask, get_schedule, mask_corrupt,
                            masked_diffusion_loss, sample_t)
from tadm.records import dataclass_record
from tadm.sampling.base import check_num_steps
from tadm.training.data import build_packed_dataset

__all__ = ["CachedBoundResult", "LikelihoodResult", "StalenessResult", "anchored_log_probs", "ar_perplexity",
           "cached_process_nelbo", "check_anchored", "stale_anchor_nelbo", "diffusion_nelbo", "evaluate_likelihood",
           "is_autoregressive", "packed_eval_blocks"]


@dataclass
class LikelihoodResult:
    """Nats per token and perplexity; ``kind`` is "nelbo" (an upper bound) or "exact" (AR)."""

    kind: str
    nll: float
    num_tokens: int
    num_sequences: int
    num_t_samples: int = 0
    discrete_steps: int | None = None
    seed: int | None = None

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def as_dict(self) -> dict[str, Any]:
        return dataclass_record(self, "ppl")


def packed_eval_blocks(
    source: str | os.PathLike[str],
    tokenizer: Any,
    seq_len: int,
    *,
    cache_dir: str | os.PathLike[str] = ".tadm-cache",
    split: str = "all",
    val_fraction: float = 0.01,
    seed: int = 0,
    progress: bool | None = None,
) -> Any:
    """Blocks of ``seq_len`` tokens of a text source, packed with ``tokenizer`` (MDLM-style wrap packing).

    ``split="all"`` packs every document (a zero-shot corpus); ``split="val"`` returns the held-out
    documents of :func:`~tadm.training.data.build_packed_dataset` with ``val_fraction`` and ``seed``
    (the validation split of a training corpus). Returns a ``PackedTokens``.
    """
    if split not in ("all", "val"):
        raise ValueError(f"split must be 'all' or 'val', got {split!r}")
    if not all(hasattr(tokenizer, name) for name in ("encode", "vocab_size", "eos_id", "fingerprint")):
        raise ValueError(f"tokenizer must be a tadm TextTokenizer (TextTokenizer.load(model_dir)), "
                         f"got {type(tokenizer).__name__}")
    fraction = 0.0 if split == "all" else val_fraction
    splits = build_packed_dataset(source, tokenizer, seq_len, cache_dir, val_fraction=fraction, seed=seed, progress=progress)
    blocks = splits.train if split == "all" else splits.val
    if len(blocks) == 0:
        raise ValueError(f"{source!r} gives no block of {seq_len} tokens in split {split!r}")
    return blocks


_BLOCK_KINDS = "(N, L) token ids, a PackedTokens, or an iterable of (L,) / (B, L) id tensors"


def _check_block_tensor(item: Any) -> Any:
    """``item`` unchanged; a ValueError unless it is a 1-D or 2-D tensor of integer ids (or a PackedTokens)."""
    if not isinstance(item, Tensor) and not hasattr(item, "get_batch"):
        raise ValueError(f"blocks must be {_BLOCK_KINDS}; got an iterable of {type(item).__name__}")
    if isinstance(item, Tensor) and (item.is_floating_point() or item.is_complex() or item.dim() not in (1, 2)):
        raise ValueError(f"blocks must be {_BLOCK_KINDS}; got a {item.dtype} tensor of shape {tuple(item.shape)}")
    return item


def _batches(blocks: Any, batch_size: int, max_blocks: int | None) -> Iterator[Tensor]:
    """(B, L) LongTensors from a (N, L) tensor, a PackedTokens, or an iterable of (L,) / (B, L) tensors."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(blocks, Tensor) and blocks.dim() != 2:
        raise ValueError(f"blocks must have shape (N, L), got {tuple(blocks.shape)}")
    if isinstance(blocks, Tensor) or (hasattr(blocks, "get_batch") and hasattr(blocks, "__len__")):
        _check_block_tensor(blocks)
        n = len(blocks) if max_blocks is None else min(max_blocks, len(blocks))
        for s in range(0, n, batch_size):
            end = min(n, s + batch_size)
            yield blocks[s:end].long() if isinstance(blocks, Tensor) else blocks.get_batch(range(s, end))
        return
    if not isinstance(blocks, Iterable) or isinstance(blocks, (str, bytes)):
        raise ValueError(f"blocks must be {_BLOCK_KINDS}, got {type(blocks).__name__}")
    rows = islice(chain.from_iterable(item.unsqueeze(0) if _check_block_tensor(item).dim() == 1 else item
                                      for item in blocks), max_blocks)
    while pending := list(islice(rows, batch_size)):
        yield torch.stack(pending).long()


def _check_ids(x: Tensor, model: nn.Module, mask_id: int | None) -> None:
    vocab = int(model.vocab_size)
    if int(x.min()) < 0 or int(x.max()) >= vocab:
        raise ValueError(
            f"mismatched tokenizer: the text holds token id {int(x.max())} but the model's vocabulary has "
            f"{vocab} ids; pack the text with the model's own tokenizer"
        )
    if mask_id is not None and bool((x == mask_id).any()):
        raise ValueError(f"the text holds the mask id {mask_id}: it was packed with another tokenizer")


def is_autoregressive(model: nn.Module) -> bool:
    """True for the AR baseline, the one network without a mask token."""
    return model.mask_token_id is None


def _checked_batches(model: nn.Module, blocks: Any, mask_id: int | None, batch_size: int, max_blocks: int | None,
                     device: torch.device | str | None, progress: bool, desc: str) -> Iterator[Tensor]:
    """The (B, L) batches of :func:`_batches`, each checked by :func:`_check_ids` and moved to ``device``.

    ``device`` defaults to the model's; the model is put in eval mode first. A block set that gives no
    batch at all is a ValueError once it is exhausted.
    """
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    model.eval()
    empty = True
    for x in tqdm(_batches(blocks, batch_size, max_blocks), desc=desc, disable=not progress, leave=False):
        _check_ids(x, model, mask_id)
        empty = False
        yield x.to(device)  # (B, L)
    if empty:
        raise ValueError("no text to evaluate: the block set is empty")


def _fresh_anchor_log_probs(model: nn.Module, z_t: Tensor, t: Tensor) -> Tensor:
    """log x_theta(z_t) with the anchor computed from z_t itself (t' = t): (B, L, V)."""
    return anchored_log_probs(model, z_t, t, z_t, t)


@torch.no_grad()
def diffusion_nelbo(
    model: nn.Module,
    blocks: Any,
    *,
    schedule: str = "loglinear",
    num_t_samples: int = 1,
    batch_size: int = 8,
    eps: float = 1e-3,
    antithetic: bool = True,
    seed: int = 0,
    discrete_steps: int | None = None,
    max_blocks: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> LikelihoodResult:
    """Monte-Carlo NELBO (nats per token) of a TADM / MDLM / ADLM on ``blocks`` (see the module docstring).

    Args:
        model: a masked diffusion LM with ``encode`` / ``compute_anchor`` / ``predict``.
        blocks: (N, L) ids, a ``PackedTokens``, or an iterable of (L,) / (B, L) id tensors.
        schedule: noise schedule name the model was trained with.
        num_t_samples: Monte-Carlo draws of t per block (>= 1).
        eps: lower end of t ~ U(eps, 1).
        antithetic: stratify the n * B times of a batch.
        seed: seeds the CPU generator for t and the masks.
        discrete_steps: use the discrete-time bound with this many steps instead.
    """
    mask_id = model.mask_token_id
    if mask_id is None:
        raise ValueError(f"{type(model).__name__} is not a masked diffusion model; use ar_perplexity")
    if num_t_samples < 1:
        raise ValueError(f"num_t_samples must be >= 1, got {num_t_samples}")
    sched = get_schedule(schedule)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    tokens = sequences = 0
    for x in _checked_batches(model, blocks, mask_id, batch_size, max_blocks, device, progress, "NELBO"):
        if discrete_steps is not None:
            per_token = discrete_masked_nelbo(partial(_fresh_anchor_log_probs, model), x, discrete_steps, sched,
                                              mask_id, generator)  # (B, L)
            total += float(per_token.double().sum())
        else:
            times = sample_t(x.shape[0] * num_t_samples, eps=eps, antithetic=antithetic, generator=generator)  # (n B,)
            for t in times.to(x.device).split(x.shape[0]):  # draw r uses times r * B .. r * B + B - 1
                z_t = mask_corrupt(x, sched.alpha(t), mask_id, generator)  # (B, L)
                log_probs = _fresh_anchor_log_probs(model, z_t, t)  # (B, L, V)
                loss = masked_diffusion_loss(log_probs, x, z_t, t, sched, mask_id)  # (B, L)
                total += float(loss.double().sum())
        tokens += x.numel()
        sequences += x.shape[0]
    draws = 1 if discrete_steps is not None else num_t_samples  # loss sums per block token
    return LikelihoodResult(kind="nelbo", nll=total / (tokens * draws), num_tokens=tokens, num_sequences=sequences,
                            num_t_samples=0 if discrete_steps is not None else num_t_samples,
                            discrete_steps=discrete_steps, seed=seed)


@torch.no_grad()
def ar_perplexity(
    model: nn.Module,
    blocks: Any,
    *,
    batch_size: int = 8,
    max_blocks: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> LikelihoodResult:
    """Exact NLL (nats per token) of an AR model: -log p(x_i | x_<i) over positions 1..L-1 of each block."""
    total = 0.0
    tokens = sequences = 0
    for x in _checked_batches(model, blocks, None, batch_size, max_blocks, device, progress, "AR NLL"):
        if x.shape[1] < 2:
            raise ValueError("blocks need at least 2 tokens for a next-token likelihood")
        logits = model(x[:, :-1]).float()  # (B, L - 1, V)
        nll = -torch.log_softmax(logits, dim=-1).gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L - 1)
        total += float(nll.double().sum())
        tokens += nll.numel()
        sequences += x.shape[0]
    return LikelihoodResult(kind="exact", nll=total / tokens, num_tokens=tokens, num_sequences=sequences)


def evaluate_likelihood(model: nn.Module, blocks: Any, **kwargs: Any) -> LikelihoodResult:
    """:func:`ar_perplexity` for the AR baseline, :func:`diffusion_nelbo` otherwise.

    Keyword arguments that only the diffusion bound takes (``num_t_samples``, ``seed``, ...) are
    ignored for the AR model.
    """
    if is_autoregressive(model):
        keep = {k: v for k, v in kwargs.items() if k in ("batch_size", "max_blocks", "device", "progress")}
        return ar_perplexity(model, blocks, **keep)
    return diffusion_nelbo(model, blocks, **kwargs)


# ------------------------------------------------------------------------------------ stale anchors
def _anchor_seed(seed: int) -> int:
    """Seed of the further-masking generator: a fixed function of ``seed``, apart from the main stream."""
    return (int(seed) * 0x9E3779B1 + 0x5EED) % (2**63 - 1)


def _time_arg(model: nn.Module, t: Tensor) -> Tensor | None:
    """t for a time-conditioned network (tadm.protocol), None for one that does not read it."""
    return t if model.time_conditioned else None


def check_anchored(model: nn.Module) -> None:
    """Refuse a model without an anchor network (MDLM, AR): a stale anchor means nothing for it."""
    if model.mask_token_id is None:
        raise ValueError(f"{type(model).__name__} is not a masked diffusion model with an anchor: "
                         "stale-anchor bounds need TADM or ADLM")
    if model.layer_split.anchor == 0:
        raise ValueError(f"{type(model).__name__} has no anchor network (0 anchor layers): "
                         "stale-anchor bounds need TADM or ADLM")


def anchored_log_probs(
    model: nn.Module, z_t: Tensor, t: Tensor, z_anchor: Tensor, t_anchor: Tensor, c_t: Tensor | None = None
) -> Tensor:
    """log x_theta(z_t, z_t') (B, L, V): denoiser at t on z_t, anchor computed from z_anchor at t'.

    This is what Algorithm 1 computes at a step whose cache was filled at the canvas ``z_anchor``:
    with ``z_anchor is z_t`` (cache age 0) it is the log-probabilities of a refresh step. ``c_t``
    may pass a precomputed S(z_t).
    """
    t_arg, ta_arg = _time_arg(model, t), _time_arg(model, t_anchor)
    if c_t is None:
        c_t = model.encode(z_t, t_arg)  # (B, L, D)
    c_a = c_t if z_anchor is z_t else model.encode(z_anchor, ta_arg)  # (B, L, D)
    h = model.compute_anchor(c_a, ta_arg)  # (B, L, D_a)
    return model.predict(z_t, c_t, h, t_arg)  # (B, L, V)


def _check_steps(values: Sequence[int], name: str, minimum: int) -> list[int]:
    """``values`` as a list of distinct integers >= ``minimum`` (a value listed twice would be counted twice)."""
    if not isinstance(values, Iterable) or isinstance(values, str):
        raise ValueError(f"{name} must be a list of integers >= {minimum}, got {values!r}")
    values = list(values)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{name} must be integers >= {minimum}, got {v!r}")
    if not values:
        raise ValueError(f"{name} must not be empty")
    twice = [v for i, v in enumerate(values) if v in values[:i]]
    if twice:
        raise ValueError(f"{name}: {', '.join(map(str, dict.fromkeys(twice)))} is listed twice")
    return values


@dataclass
class StalenessResult:
    """Continuous-time T-ANELBO (nats/token) against the cache age k, per step budget T.

    ``curves[T][k]`` is the bound with the anchor k steps old on a T-step grid; ``curves[T][0]`` is
    the fresh NELBO (equal for every T). ``uninformative`` is the bound with the anchor computed on
    a fully masked canvas (t' = 1), or None if not measured.
    """

    curves: dict[int, list[float]]
    uninformative: float | None
    num_tokens: int
    num_sequences: int
    num_t_samples: int
    seed: int
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of the fresh and of the stale passes

    @property
    def fresh(self) -> float:
        return next(iter(self.curves.values()))[0]

    def as_dict(self) -> dict[str, Any]:
        return {
            "fresh": self.fresh,
            "curves": {str(T): v for T, v in self.curves.items()},
            "increase": {str(T): [x / self.fresh - 1.0 for x in v] for T, v in self.curves.items()},
            "uninformative": self.uninformative,
            "uninformative_increase": None if self.uninformative is None else self.uninformative / self.fresh - 1.0,
            **dataclass_record(self, omit=("curves", "uninformative")),
        }


class _StaleTotals:
    """Summed losses of one staleness evaluation: fresh, per (T, k) stale, and with an uninformative anchor.

    :meth:`add` takes one t draw of one batch, in the order of random numbers that keeps the fresh
    point identical to :func:`diffusion_nelbo`: the masks of ``z_t`` from the evaluation's generator,
    then one uniform tensor from ``anchor_generator`` shared by every (T, k) (nested masks, Eq. 12).
    """

    def __init__(self, model: nn.Module, sched: Any, steps: Sequence[int], max_age: int, uninformative: bool, *,
                 anchor_generator: torch.Generator) -> None:
        self.model, self.sched, self.steps, self.max_age = model, sched, list(steps), max_age
        self.mask_id = int(model.mask_token_id)
        self.uninformative, self.anchor_generator = uninformative, anchor_generator
        self.fresh = self.blank = 0.0
        self.stale = {(T, k): 0.0 for T in self.steps for k in range(1, max_age + 1)}
        self.clock = {"fresh": 0.0, "stale": 0.0, "uninformative": 0.0}
        self._blank_anchor: dict[tuple[int, int], Tensor] = {}

    @contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.clock[part] += time.perf_counter() - start

    def _loss(self, log_probs: Tensor, x: Tensor, z_t: Tensor, t: Tensor) -> float:
        return float(masked_diffusion_loss(log_probs, x, z_t, t, self.sched, self.mask_id).double().sum())

    def add(self, x: Tensor, t: Tensor, generator: torch.Generator) -> None:
        """One t draw ``t`` (B,) of the batch ``x`` (B, L)."""
        model = self.model
        with self._timed("fresh"):
            alpha_t = self.sched.alpha(t)  # (B,)
            z_t = mask_corrupt(x, alpha_t, self.mask_id, generator)  # (B, L)
            c_t = model.encode(z_t, _time_arg(model, t))  # (B, L, D)
            self.fresh += self._loss(anchored_log_probs(model, z_t, t, z_t, t, c_t=c_t), x, z_t, t)
        with self._timed("stale"):
            u = torch.rand(x.shape, generator=self.anchor_generator).to(x.device)  # shared by every (T, k)
            for T in self.steps:
                for k in range(1, self.max_age + 1):
                    t_anchor = torch.clamp(t + k / T, max=1.0)  # (B,)
                    z_anchor = further_mask(z_t, alpha_t, self.sched.alpha(t_anchor), self.mask_id, uniform=u)
                    log_probs = anchored_log_probs(model, z_t, t, z_anchor, t_anchor, c_t=c_t)
                    self.stale[(T, k)] += self._loss(log_probs, x, z_t, t)
        if self.uninformative:
            with self._timed("uninformative"):
                self.blank += self._loss(self._blank_log_probs(z_t, t, c_t), x, z_t, t)

    def _blank_log_probs(self, z_t: Tensor, t: Tensor, c_t: Tensor) -> Tensor:
        """Log-probabilities with the anchor of a fully masked canvas (cached when it has no time input)."""
        model, blank = self.model, torch.full_like(z_t, self.mask_id)  # (B, L)
        if _time_arg(model, t) is not None:
            return anchored_log_probs(model, z_t, t, blank, torch.ones_like(t), c_t=c_t)
        if z_t.shape not in self._blank_anchor:
            self._blank_anchor[z_t.shape] = model.compute_anchor(model.encode(blank))
        return model.predict(z_t, c_t, self._blank_anchor[z_t.shape])


@torch.no_grad()
def stale_anchor_nelbo(
    model: nn.Module,
    blocks: Any,
    *,
    steps: Sequence[int] = (128,),
    max_age: int = 7,
    uninformative: bool = True,
    schedule: str = "loglinear",
    num_t_samples: int = 1,
    batch_size: int = 8,
    eps: float = 1e-3,
    antithetic: bool = True,
    seed: int = 0,
    max_blocks: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> StalenessResult:
    """T-ANELBO per token at cache ages k = 0 .. ``max_age`` for each T in ``steps`` (module docstring).

    The fresh point (k = 0) uses the same random numbers and arithmetic as :func:`diffusion_nelbo`
    with the same ``seed``, ``num_t_samples``, ``batch_size``, ``eps`` and ``antithetic``, so the two
    agree exactly. Each (T, k > 0) costs one anchor and one denoiser pass per t draw, about one
    fresh evaluation; the uninformative anchor (no time conditioning) is computed once per batch shape.

    Args:
        model: TADM, ADLM or ``NaiveReuse(tadm)``.
        blocks: (N, L) ids, a ``PackedTokens``, or an iterable of (L,) / (B, L) id tensors.
        steps: step budgets T (>= 1) that turn a cache age into a time offset k / T.
        max_age: largest cache age k (>= 0).
        uninformative: also bound the model with an anchor from a fully masked canvas.
    """
    check_anchored(model)
    steps = _check_steps(steps, "step budgets T", 1)
    if isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 0:
        raise ValueError(f"cache age k must be an integer >= 0, got {max_age!r}")
    if num_t_samples < 1:
        raise ValueError(f"num_t_samples must be >= 1, got {num_t_samples}")
    generator = torch.Generator().manual_seed(seed)
    totals = _StaleTotals(model, get_schedule(schedule), steps, max_age, uninformative,
                          anchor_generator=torch.Generator().manual_seed(_anchor_seed(seed)))
    tokens = sequences = 0
    for x in _checked_batches(model, blocks, totals.mask_id, batch_size, max_blocks, device, progress, "stale NELBO"):
        times = sample_t(x.shape[0] * num_t_samples, eps=eps, antithetic=antithetic, generator=generator)  # (n B,)
        for t in times.to(x.device).split(x.shape[0]):  # as in diffusion_nelbo
            totals.add(x, t, generator)
        tokens += x.numel()
        sequences += x.shape[0]
    scored = tokens * num_t_samples  # the loss sums count every block token once per t draw
    fresh = totals.fresh / scored
    curves = {T: [fresh] + [totals.stale[(T, k)] / scored for k in range(1, max_age + 1)] for T in steps}
    return StalenessResult(curves=curves, uninformative=totals.blank / scored if uninformative else None,
                           num_tokens=tokens, num_sequences=sequences, num_t_samples=num_t_samples, seed=seed,
                           seconds=totals.clock)


@dataclass
class CachedBoundResult:
    """Discrete-time bound (nats/token) of the cached reverse process per refresh interval K, at T steps.

    ``block_bounds[K]`` holds the bound of each block (nats/token, in order); ``bounds[K]`` is their mean.
    """

    num_steps: int
    bounds: dict[int, float]
    num_tokens: int
    num_sequences: int
    seed: int
    block_bounds: dict[int, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        base = self.bounds.get(1)
        return {**dataclass_record(self, omit=("block_bounds",)), "bounds": {str(K): v for K, v in self.bounds.items()},
                "increase": None if base is None else {str(K): v / base - 1.0 for K, v in self.bounds.items()}}

    def difference(self, K: int, base: int = 1) -> tuple[float, float]:
        """bound(K) - bound(base) in nats/token and its standard error over blocks.

        Every K sees the same draws (common random numbers), so the difference is paired block by block and
        its error is that of the per-block differences, far smaller than the error of either bound.
        """
        diffs = [a - b for a, b in zip(self.block_bounds[K], self.block_bounds[base])]  # (N,)
        n = len(diffs)
        mean = sum(diffs) / n
        spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else float("nan")
        return mean, spread / math.sqrt(n)


@torch.no_grad()
def cached_process_nelbo(
    model: nn.Module,
    blocks: Any,
    *,
    num_steps: int,
    refresh_intervals: Sequence[int] = (1, 2, 4, 8),
    schedule: str = "loglinear",
    batch_size: int = 8,
    seed: int = 0,
    max_blocks: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> CachedBoundResult:
    """Discrete-time bound of the cached reverse process of Algorithm 1 for each K (``discrete_cached_nelbo``).

    With K = 1 and the same ``seed`` and ``batch_size`` it equals ``diffusion_nelbo(..., discrete_steps=T)``.
    Costs up to T network calls per batch and K (fewer when several K share an anchor step).
    """
    check_anchored(model)
    check_num_steps(num_steps)
    intervals = _check_steps(refresh_intervals, "refresh intervals K", 1)
    mask_id = int(model.mask_token_id)
    sched = get_schedule(schedule)
    generator = torch.Generator().manual_seed(seed)
    anchor_generator = torch.Generator().manual_seed(_anchor_seed(seed))
    totals = {K: 0.0 for K in intervals}
    per_block: dict[int, list[float]] = {K: [] for K in intervals}
    tokens = sequences = 0
    for x in _checked_batches(model, blocks, mask_id, batch_size, max_blocks, device, progress, "cached bound"):
        per_token = discrete_cached_nelbo(partial(anchored_log_probs, model), x, num_steps, intervals, sched, mask_id,
                                          generator, anchor_generator)
        for K in intervals:
            totals[K] += float(per_token[K].double().sum())
            per_block[K] += per_token[K].double().mean(dim=-1).tolist()  # (B,)
        tokens += x.numel()
        sequences += x.shape[0]
    return CachedBoundResult(num_steps=num_steps, bounds={K: totals[K] / tokens for K in intervals},
                             num_tokens=tokens, num_sequences=sequences, seed=seed, block_bounds=per_block)
