"""Samplers (one per file), the anchor cache and the generation loop (paper Algorithm 1)."""

from tadm.sampling.anchor_cache import AnchorCache, LayerCallCounter, check_refresh_interval, is_refresh_step
from tadm.sampling.base import Sampler, SamplerOutput
from tadm.sampling.categorical import nucleus_filter, sample_categorical
from tadm.sampling.generate import GenerationOutput, generate
from tadm.sampling.mdlm import MDLMSampler
from tadm.sampling.protocol import CacheableDenoiser, LayerSplit
from tadm.sampling.registry import SAMPLERS, get_sampler
from tadm.sampling.remdm import REMDM_STRATEGIES, ReMDMSampler

__all__ = [
    "AnchorCache",
    "CacheableDenoiser",
    "GenerationOutput",
    "LayerCallCounter",
    "LayerSplit",
    "MDLMSampler",
    "REMDM_STRATEGIES",
    "ReMDMSampler",
    "SAMPLERS",
    "Sampler",
    "SamplerOutput",
    "check_refresh_interval",
    "generate",
    "get_sampler",
    "is_refresh_step",
    "nucleus_filter",
    "sample_categorical",
]
