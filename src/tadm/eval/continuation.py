"""The log-likelihood of a continuation given its context under a masked diffusion LM: Monte-Carlo bounds.

lm-eval's ``loglikelihood`` requests (multiple-choice and likelihood tasks) ask for log p(y | c) of a
continuation y of n tokens after a context c. A diffusion LM has no exact value; as LLaDA and MDLM do,
tadm answers with an estimate of a lower bound on it (an upper bound on -log p), with the context
clean at every step and only the continuation's positions diffused:

* ``continuation_elbo`` (K = 1, a fresh anchor at every step): the continuous-time NELBO of Eq.
  (masked-nelbo) for alpha_t = 1 - t (the eps -> 0 limit of the log-linear schedule) in the form
  LLaDA's evaluation uses (Nie et al. 2025, Eq. (6); ``eval_llada.py``, ``get_loglikelihood`` and
  ``_forward_process``, github.com/ML-GSAI/LLaDA): integrating the weight 1/t against the binomial
  law of the number of masked tokens gives 1/k for exactly k masked tokens, so

      NELBO(y | c) = sum_{k=1}^{n} (1/k) E_{S : |S| = k} [ sum_{i in S} -log x_theta(z_S)_i ],

  z_S the sequence with the positions S of y masked. Each Monte-Carlo draw picks k and a uniformly
  random S of that size and scores (n / k) sum_{i in S} -log x_theta(z_S)_i; within a batch of b
  draws the k are stratified as LLaDA does (k_j = ((k0 + j n / b - 1) mod n) + 1 with k0 uniform on
  1..n, rounded), which keeps the estimator unbiased. A time-conditioned network is given t = k / n.
* ``continuation_cached_bound`` (K >= 1 on a T-step grid): the discrete-time bound of the cached
  reverse process of Algorithm 1 (Theorem T-ANELBO with sigma = gamma = 0,
  :func:`tadm.diffusion.discrete_cached_nelbo`): at step i the denoiser reads the anchor computed at
  the most recent refresh, t'(i), on a canvas masked further from z_t(i). With K = 1 it is the
  discrete-time NELBO of Eq. (masked-nelbo). Each Monte-Carlo draw is one T-step sweep.

Both report the estimate in nats (summed over the continuation), its standard error over draws, and
what it cost (network passes and Transformer-layer calls: every pass of these bounds computes its
anchor, so each counts all layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tadm.diffusion import discrete_cached_nelbo, get_schedule
from tadm.eval.likelihood import anchored_log_probs
from tadm.sampling.anchor_cache import LayerCallCounter

__all__ = ["ContinuationBound", "continuation_cached_bound", "continuation_elbo", "stratified_mask_counts"]


@dataclass
class ContinuationBound:
    """A Monte-Carlo estimate of -log p(continuation | context) (an upper bound), in nats."""

    nll: float
    stderr: float
    samples: int
    kind: str  # "elbo" (continuous time, K = 1) or "cached" (discrete time, T steps, interval K)
    refresh_interval: int = 1
    num_steps: int | None = None
    layer_calls: LayerCallCounter = field(default_factory=LayerCallCounter)


def stratified_mask_counts(n: int, rows: int, generator: torch.Generator) -> Tensor:
    """LLaDA's stratified numbers of masked tokens for ``rows`` draws: (rows,) ints in 1..n.

    k0 ~ U{1..n}; k_j = round(k0 + j n / rows) wrapped into 1..n, so a batch covers the range evenly
    and each k_j is still uniform on 1..n.
    """
    k0 = int(torch.randint(1, n + 1, (), generator=generator))
    spaced = torch.round(torch.linspace(float(k0), k0 + (rows - 1) * (n / rows), rows, dtype=torch.float64)).long()
    return (spaced - 1) % n + 1  # (rows,)


def _check(model: nn.Module, context: Tensor, continuation: Tensor, num_samples: int, batch_size: int) -> int:
    if model.mask_token_id is None:
        raise ValueError(f"{type(model).__name__} is not a masked diffusion model: it has no mask token")
    if continuation.dim() != 1 or context.dim() != 1 or continuation.numel() == 0:
        raise ValueError(f"context and continuation must be non-empty 1-D id tensors, got {tuple(context.shape)} "
                         f"and {tuple(continuation.shape)}")
    for name, value in (("num_samples", num_samples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    length = context.numel() + continuation.numel()
    if length > int(model.max_seq_len):
        raise ValueError(f"context + continuation ({length} tokens) exceed the model's max_seq_len "
                         f"({model.max_seq_len})")
    return length


def _summary(values: list[float], kind: str, calls: LayerCallCounter, **extra: Any) -> ContinuationBound:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return ContinuationBound(nll=mean, stderr=math.sqrt(var / n), samples=n, kind=kind, layer_calls=calls, **extra)


@torch.no_grad()
def continuation_elbo(
    model: nn.Module,
    context: Tensor,
    continuation: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator,
    batch_size: int = 8,
) -> ContinuationBound:
    """Continuous-time NELBO of ``continuation`` (n,) after ``context`` (P,) at K = 1 (module docstring).

    ``num_samples`` draws in batches of ``batch_size`` rows; all randomness comes from the CPU
    ``generator``: per batch the mask counts, then one uniform per continuation position and row.
    """
    _check(model, context, continuation, num_samples, batch_size)
    model.eval()
    device = next(model.parameters()).device
    mask_id, n, P = int(model.mask_token_id), continuation.numel(), context.numel()
    x = torch.cat([context, continuation]).long()  # (L,)
    target = continuation.long().to(device)
    values: list[float] = []
    calls = LayerCallCounter()
    for start in range(0, num_samples, batch_size):
        rows = min(batch_size, num_samples - start)
        k = stratified_mask_counts(n, rows, generator)  # (b,)
        order = torch.rand(rows, n, generator=generator).argsort(dim=-1).argsort(dim=-1)  # (b, n) random ranks
        masked = order < k[:, None]  # (b, n) a uniform subset of size k per row
        z = x.repeat(rows, 1)  # (b, L)
        z[:, P:] = torch.where(masked, torch.full_like(z[:, P:], mask_id), z[:, P:])
        z, masked = z.to(device), masked.to(device)
        t = (k.double() / n).float().to(device)  # (b,)
        log_probs = anchored_log_probs(model, z, t, z, t)[:, P:]  # (b, n, V)
        calls.add_pass(model.layer_split, refreshed=True)
        nll = -log_probs.gather(-1, target.expand(rows, n).unsqueeze(-1)).squeeze(-1).double()  # (b, n)
        per_draw = torch.where(masked, nll, torch.zeros((), dtype=nll.dtype, device=device)).sum(-1)
        values += (per_draw * n / k.to(device).double()).tolist()
    return _summary(values, "elbo", calls)


@torch.no_grad()
def continuation_cached_bound(
    model: nn.Module,
    context: Tensor,
    continuation: Tensor,
    *,
    num_steps: int,
    refresh_interval: int,
    num_samples: int,
    generator: torch.Generator,
    anchor_generator: torch.Generator,
    batch_size: int = 8,
    schedule: str = "loglinear",
) -> ContinuationBound:
    """Discrete-time bound of the cached reverse process (T = ``num_steps``, K = ``refresh_interval``) of
    ``continuation`` after ``context`` (module docstring); each of ``num_samples`` draws is one T-step sweep,
    ``batch_size`` sweeps run side by side. The z_t draws come from ``generator``, the anchor's further
    masking from ``anchor_generator``."""
    length = _check(model, context, continuation, num_samples, batch_size)
    for name, value in (("num_steps", num_steps), ("refresh_interval", refresh_interval)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    model.eval()
    device = next(model.parameters()).device
    P = context.numel()
    x = torch.cat([context, continuation]).long().to(device)  # (L,)
    maskable = torch.arange(length, device=device) >= P  # (L,)
    calls = LayerCallCounter()

    def log_probs_fn(z_t: Tensor, t: Tensor, z_anchor: Tensor, t_anchor: Tensor) -> Tensor:
        calls.add_pass(model.layer_split, refreshed=True)
        return anchored_log_probs(model, z_t, t, z_anchor, t_anchor)  # (b, L, V)

    values: list[float] = []
    for start in range(0, num_samples, batch_size):
        rows = min(batch_size, num_samples - start)
        per_token = discrete_cached_nelbo(log_probs_fn, x.repeat(rows, 1), num_steps, [refresh_interval],
                                          get_schedule(schedule), int(model.mask_token_id), generator,
                                          anchor_generator, maskable=maskable)[refresh_interval]  # (b, L)
        values += per_token[:, P:].double().sum(-1).tolist()
    return _summary(values, "cached", calls, refresh_interval=refresh_interval, num_steps=num_steps)
