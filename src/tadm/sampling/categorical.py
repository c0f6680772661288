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


NUCLEUS_RULES = ("released", "standard")


def check_nucleus(top_p: float, rule: str) -> None:
    """Validate a nucleus mass (a finite number in (0, 1]) and rule name."""
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"nucleus top_p must be a number in (0, 1], got {top_p!r}")
    if rule not in NUCLEUS_RULES:
        raise ValueError(f"unknown nucleus rule {rule!r}; valid: {', '.join(NUCLEUS_RULES)}")


def nucleus_filter(probs: Tensor, top_p: float, rule: str = "standard") -> Tensor:
    """Nucleus (top-p) filtering of each row of ``probs`` (..., V), renormalised.

    Ids are sorted by probability (descending) and a prefix is kept:

    * ``"standard"``: the smallest prefix whose mass reaches ``top_p``, i.e. every id whose mass
      strictly before it is < ``top_p`` (the id that crosses ``top_p`` is kept);
    * ``"released"``: the rule of the released ReMDM / MDLM sampling code, every id whose
      cumulative mass including itself is <= ``top_p``, plus the top-1 id (the id that crosses
      ``top_p`` is dropped, so the kept mass is at most ``top_p`` unless the top-1 alone exceeds it).

    ``top_p`` must lie in (0, 1]; ``top_p == 1`` returns ``probs`` unchanged under both rules.
    """
    check_nucleus(top_p, rule)
    if top_p == 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    if rule == "standard":
        # Keep an id if the mass strictly before it is < top_p (so the top id is always kept).
        keep_sorted = (cumulative - sorted_probs) < top_p
    else:
        keep_sorted = cumulative <= top_p
        keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(dim=-1, keepdim=True)
