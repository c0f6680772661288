"""Drawing tokens from per-position categorical distributions: Gumbel-max and nucleus filtering."""

from __future__ import annotations

import torch
from torch import Tensor


def sample_categorical(
    probs: Tensor, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64
) -> Tensor:
    """Draw one id per row of ``probs`` (..., V) with the Gumbel-max trick.

    The noise is drawn in ``dtype`` (float64 by default): in float32 the Gumbel tail is truncated so
    rare tokens are under-sampled, which visibly lowers sample entropy over thousands of steps.
    Zero-probability entries are never selected.
    """
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=dtype)
    # -log(U) ~ Exp(1); argmax p / E is an exact categorical draw (exponential race).
    exp_noise = -torch.log(uniform.clamp_min(torch.finfo(dtype).tiny))
    return (probs.to(dtype) / exp_noise).argmax(dim=-1)


def nucleus_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of ids whose mass reaches ``top_p`` and renormalise (per row of (..., V)).

    ``top_p`` must lie in (0, 1]; ``top_p == 1`` returns ``probs`` unchanged.
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"nucleus top_p must be in (0, 1], got {top_p}")
    if top_p == 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    # Keep an id if the mass strictly before it is < top_p (so the top id is always kept).
    keep_sorted = (cumulative - sorted_probs) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(dim=-1, keepdim=True)
