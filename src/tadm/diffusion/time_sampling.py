"""Training-time sampling of the diffusion time t and the stale anchor time t' (appendix "TADM:Pretrain").

t is continuous, t ~ U(eps, 1), drawn antithetically (stratified) across the batch. The anchor time
is t' = min(1, t + k / T) where the cache age k ~ U{0, ..., K - 1} follows an anchor refresh
interval K and a sampling budget T drawn from the values used at inference, so the offsets t' - t
match the cache ages a sampler with refresh interval K meets on a T-step grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tadm.diffusion.forward import _rand, _randint


def sample_t(
    batch_size: int,
    eps: float = 1e-3,
    antithetic: bool = True,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Diffusion times t ~ U(eps, 1), one per example.

    With ``antithetic`` (MDLM's low-discrepancy sampler) u_b = (u_0 + b / B) mod 1 with one shared
    u_0 ~ U[0, 1), so each interval [k / B, (k + 1) / B) holds exactly one u; then t = eps + (1 - eps) u.

    Args:
        batch_size: B >= 1.
        eps: lower end of the time range, in [0, 1).
        antithetic: stratify across the batch (otherwise i.i.d. draws).
        generator: source of randomness.
        device: where the result lives.

    Returns:
        (B,) float32 times.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    if antithetic:
        u0 = _rand((1,), generator, device)  # (1,)
        offsets = torch.arange(batch_size, dtype=torch.float64, device=u0.device) / batch_size  # (B,)
        u = torch.remainder(u0.double() + offsets, 1.0)  # (B,)
    else:
        u = _rand((batch_size,), generator, device).double()  # (B,)
    return (eps + (1.0 - eps) * u).float()


@dataclass
class StaleAnchorTimes:
    """Per-example times for one T-ANELBO training step; every field is (B,)."""

    t: Tensor  # (B,) current time
    t_anchor: Tensor  # (B,) stale anchor time t' = min(1, t + k / T) >= t
    cache_age: Tensor  # (B,) long, k in {0, ..., K - 1}
    refresh_interval: Tensor  # (B,) long, K
    num_steps: Tensor  # (B,) long, sampling budget T


def _check_positive_ints(values: Sequence[int], name: str) -> None:
    if len(values) == 0:
        raise ValueError(f"{name} must not be empty")
    for v in values:
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must hold integers >= 1, got {v!r} in {tuple(values)}")


def sample_stale_anchor_times(
    t: Tensor,
    refresh_intervals: Sequence[int] = (1, 2, 4, 8),
    step_budgets: Sequence[int] = (128, 256, 512, 1024, 2048, 4096),
    generator: torch.Generator | None = None,
) -> StaleAnchorTimes:
    """Draw an anchor time t' >= t per example (appendix "TADM:Pretrain", training details).

    K ~ U(refresh_intervals), T ~ U(step_budgets), k ~ U{0, ..., K - 1}, all independent per
    example, and t' = min(1, t + k / T). K = 1 always gives a fresh anchor (t' = t).

    Args:
        t: (B,) current times (e.g. from ``sample_t``).
        refresh_intervals: candidate anchor refresh intervals K (integers >= 1).
        step_budgets: candidate sampling budgets T (integers >= 1).
        generator: source of randomness.

    Returns:
        StaleAnchorTimes with (B,) fields on t's device.
    """
    _check_positive_ints(refresh_intervals, "refresh_intervals")
    _check_positive_ints(step_budgets, "step_budgets")
    if t.dim() != 1 or not t.is_floating_point():
        raise ValueError(f"t must be a floating tensor of shape (B,), got {t.dtype} of shape {tuple(t.shape)}")
    B, device = t.shape[0], t.device
    intervals = torch.tensor([int(v) for v in refresh_intervals], dtype=torch.long, device=device)
    budgets = torch.tensor([int(v) for v in step_budgets], dtype=torch.long, device=device)
    K = intervals[_randint(len(intervals), (B,), generator, device)]  # (B,)
    T = budgets[_randint(len(budgets), (B,), generator, device)]  # (B,)
    u = _rand((B,), generator, device).double()  # (B,)
    k = torch.minimum(torch.floor(u * K).long(), K - 1)  # (B,)
    t_anchor = torch.clamp(t + (k.double() / T.double()).to(t.dtype), max=1.0)  # (B,)
    return StaleAnchorTimes(t=t, t_anchor=t_anchor, cache_age=k, refresh_interval=K, num_steps=T)


def last_refresh_step(step_index: int, num_steps: int, refresh_interval: int) -> int:
    """Index j >= i of the most recent anchor refresh seen by reverse step i under Algorithm 1.

    Reverse steps run i = T, ..., 1 and the anchor is recomputed at the steps with
    (T - i) mod K == 0, so step i reuses the anchor of step j = T - K * floor((T - i) / K); its
    time t'(i) = j / T is the anchor time of the cached reverse process, Eq. (joint-inf-post-TADM).
    K = 1 gives j = i (a fresh anchor at every step).
    """
    for name, value in (("num_steps", num_steps), ("refresh_interval", refresh_interval)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not 1 <= step_index <= num_steps:
        raise ValueError(f"step index must be in 1..{num_steps} (reverse steps run T..1), got {step_index}")
    return num_steps - refresh_interval * ((num_steps - step_index) // refresh_interval)
