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
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from tadm.diffusion import discrete_masked_nelbo, get_schedule, mask_corrupt, masked_diffusion_loss, sample_t

__all__ = [
    "LikelihoodResult",
    "ar_perplexity",
    "diffusion_nelbo",
    "evaluate_likelihood",
    "is_autoregressive",
    "packed_eval_blocks",
]


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
        return {
            "kind": self.kind,
            "nll": self.nll,
            "ppl": self.ppl,
            "num_tokens": self.num_tokens,
            "num_sequences": self.num_sequences,
            "num_t_samples": self.num_t_samples,
            "discrete_steps": self.discrete_steps,
            "seed": self.seed,
        }


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
    from tadm.training.data import build_packed_dataset

    if split not in ("all", "val"):
        raise ValueError(f"split must be 'all' or 'val', got {split!r}")
    fraction = 0.0 if split == "all" else val_fraction
    splits = build_packed_dataset(source, tokenizer, seq_len, cache_dir, val_fraction=fraction, seed=seed, progress=progress)
    blocks = splits.train if split == "all" else splits.val
    if len(blocks) == 0:
        raise ValueError(f"{source!r} gives no block of {seq_len} tokens in split {split!r}")
    return blocks


def _batches(blocks: Any, batch_size: int, max_blocks: int | None) -> Iterator[Tensor]:
    """(B, L) LongTensors from a (N, L) tensor, a PackedTokens, or an iterable of (L,) / (B, L) tensors."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(blocks, Tensor):
        if blocks.dim() != 2:
            raise ValueError(f"blocks must have shape (N, L), got {tuple(blocks.shape)}")
        n = blocks.shape[0] if max_blocks is None else min(max_blocks, blocks.shape[0])
        for s in range(0, n, batch_size):
            yield blocks[s : min(n, s + batch_size)].long()
        return
    if hasattr(blocks, "get_batch") and hasattr(blocks, "__len__"):
        n = len(blocks) if max_blocks is None else min(max_blocks, len(blocks))
        for s in range(0, n, batch_size):
            yield blocks.get_batch(range(s, min(n, s + batch_size)))
        return
    seen = 0
    pending: list[Tensor] = []
    for item in blocks if isinstance(blocks, Iterable) else []:
        rows = item.unsqueeze(0) if item.dim() == 1 else item
        for row in rows:
            if max_blocks is not None and seen >= max_blocks:
                break
            pending.append(row)
            seen += 1
            if len(pending) == batch_size:
                yield torch.stack(pending).long()
                pending = []
    if pending:
        yield torch.stack(pending).long()


def _check_ids(x: Tensor, model: nn.Module, mask_id: int | None) -> None:
    vocab = int(getattr(model, "vocab_size"))
    if int(x.min()) < 0 or int(x.max()) >= vocab:
        raise ValueError(
            f"mismatched tokenizer: the text holds token id {int(x.max())} but the model's vocabulary has "
            f"{vocab} ids; pack the text with the model's own tokenizer"
        )
    if mask_id is not None and bool((x == mask_id).any()):
        raise ValueError(f"the text holds the mask id {mask_id}: it was packed with another tokenizer")


def is_autoregressive(model: nn.Module) -> bool:
    """True for the AR baseline (no mask token, no ``compute_anchor``)."""
    return getattr(model, "mask_token_id", None) is None and not hasattr(model, "compute_anchor")


def _device_of(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _fresh_anchor_log_probs(model: nn.Module, z_t: Tensor, t: Tensor) -> Tensor:
    """log x_theta(z_t) with the anchor computed from z_t itself (t' = t): (B, L, V)."""
    t_arg = t if bool(getattr(getattr(model, "config", None), "time_conditioning", False)) else None
    c = model.encode(z_t, t_arg)  # (B, L, D)
    h = model.compute_anchor(c, t_arg)  # (B, L, D_a)
    return model.predict(z_t, c, h, t_arg)  # (B, L, V)


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
    mask_id = getattr(model, "mask_token_id", None)
    if mask_id is None or not hasattr(model, "compute_anchor"):
        raise ValueError(f"{type(model).__name__} is not a masked diffusion model; use ar_perplexity")
    if num_t_samples < 1:
        raise ValueError(f"num_t_samples must be >= 1, got {num_t_samples}")
    sched = get_schedule(schedule)
    device = _device_of(model, device)
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    tokens = sequences = 0
    for x in tqdm(_batches(blocks, batch_size, max_blocks), desc="NELBO", disable=not progress, leave=False):
        _check_ids(x, model, mask_id)
        x = x.to(device)  # (B, L)
        B, L = x.shape
        if discrete_steps is not None:
            per_token = discrete_masked_nelbo(
                lambda z, t: _fresh_anchor_log_probs(model, z, t), x, discrete_steps, sched, mask_id, generator
            )  # (B, L)
            total += float(per_token.double().sum())
            tokens += B * L
        else:
            times = sample_t(B * num_t_samples, eps=eps, antithetic=antithetic, generator=generator)  # (n B,)
            for r in range(num_t_samples):
                t = times[r * B : (r + 1) * B].to(device)  # (B,)
                z_t = mask_corrupt(x, sched.alpha(t), mask_id, generator)  # (B, L)
                log_probs = _fresh_anchor_log_probs(model, z_t, t)  # (B, L, V)
                loss = masked_diffusion_loss(log_probs, x, z_t, t, sched, mask_id)  # (B, L)
                total += float(loss.double().sum())
                tokens += B * L
        sequences += B
    if sequences == 0:
        raise ValueError("no text to evaluate: the block set is empty")
    return LikelihoodResult(
        kind="nelbo",
        nll=total / tokens,
        num_tokens=tokens // (1 if discrete_steps is not None else num_t_samples),
        num_sequences=sequences,
        num_t_samples=0 if discrete_steps is not None else num_t_samples,
        discrete_steps=discrete_steps,
        seed=seed,
    )


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
    device = _device_of(model, device)
    model.eval()
    total = 0.0
    tokens = sequences = 0
    for x in tqdm(_batches(blocks, batch_size, max_blocks), desc="AR NLL", disable=not progress, leave=False):
        _check_ids(x, model, None)
        x = x.to(device)  # (B, L)
        if x.shape[1] < 2:
            raise ValueError("blocks need at least 2 tokens for a next-token likelihood")
        logits = model(x[:, :-1]).float()  # (B, L - 1, V)
        nll = -torch.log_softmax(logits, dim=-1).gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L - 1)
        total += float(nll.double().sum())
        tokens += nll.numel()
        sequences += x.shape[0]
    if sequences == 0:
        raise ValueError("no text to evaluate: the block set is empty")
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
