"""Name-based choice of a sampler: the one place that maps a name to a sampler class."""

from __future__ import annotations

from typing import Any, Callable

from tadm.sampling.base import Sampler
from tadm.sampling.mdlm import MDLMSampler
from tadm.sampling.remdm import ReMDMSampler

SAMPLERS: dict[str, Callable[..., Sampler]] = {
    "mdlm": MDLMSampler,
    "remdm-cap": lambda mask_id, **kw: ReMDMSampler(mask_id, strategy="cap", **kw),
    "remdm-rescale": lambda mask_id, **kw: ReMDMSampler(mask_id, strategy="rescale", **kw),
    "remdm-conf": lambda mask_id, **kw: ReMDMSampler(mask_id, strategy="conf", **kw),
    "remdm-loop": lambda mask_id, **kw: ReMDMSampler(mask_id, strategy="loop", **{"eta": 0.02, **kw}),
}


def get_sampler(name: str, mask_id: int, **kwargs: Any) -> Sampler:
    """Build the sampler called ``name`` (see ``SAMPLERS``) for a vocabulary whose mask id is ``mask_id``."""
    try:
        factory = SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; valid: {', '.join(sorted(SAMPLERS))}") from None
    return factory(mask_id, **kwargs)
