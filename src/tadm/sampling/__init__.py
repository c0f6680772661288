"""Samplers (one per file), the anchor cache and the generation loop (paper Algorithm 1)."""

from tadm.sampling.anchor_cache import AnchorCache, LayerCallCounter, check_refresh_interval, is_refresh_step
from tadm.sampling.base import Sampler, SamplerOutput
from tadm.sampling.categorical import nucleus_filter, sample_categorical
from tadm.sampling.generate import GenerationOutput, generate
from tadm.sampling.loop import LoopContext, LoopResult, denoise
from tadm.sampling.mdlm import MDLMSampler
from tadm.sampling.protocol import CacheableDenoiser, LayerSplit
from tadm.sampling.refresh import (
    REFRESH_POLICIES,
    AdaptiveRefresh,
    FixedRefresh,
    RefreshPolicy,
    ScheduleRefresh,
    get_refresh_policy,
)
from tadm.sampling.registry import SAMPLERS, get_sampler
from tadm.sampling.remdm import REMDM_STRATEGIES, ReMDMSampler

__all__ = [
    "REFRESH_POLICIES",
    "AdaptiveRefresh",
    "AnchorCache",
    "CacheableDenoiser",
    "FixedRefresh",
    "GenerationOutput",
    "LayerCallCounter",
    "LayerSplit",
    "LoopContext",
    "LoopResult",
    "MDLMSampler",
    "REMDM_STRATEGIES",
    "ReMDMSampler",
    "RefreshPolicy",
    "SAMPLERS",
    "Sampler",
    "SamplerOutput",
    "ScheduleRefresh",
    "check_refresh_interval",
    "denoise",
    "generate",
    "get_refresh_policy",
    "get_sampler",
    "is_refresh_step",
    "nucleus_filter",
    "sample_categorical",
]
