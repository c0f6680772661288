"""Samplers (one per file), the anchor cache and the generation loop (paper Algorithm 1)."""

from tadm.sampling.anchor_cache import AnchorCache, LayerCallCounter, check_refresh_interval, is_refresh_step
from tadm.sampling.base import Sampler, SamplerOutput
from tadm.sampling.categorical import nucleus_filter, sample_categorical
from tadm.sampling.generate import GenerationOutput, generate
from tadm.sampling.loop import LoopContext, LoopResult, denoise
from tadm.sampling.dream import DreamSampler, DreamSamplerConfig
from tadm.sampling.entropy_bound import EntropyBoundSampler, EntropyBoundSamplerConfig
from tadm.sampling.llada import LLaDASampler, LLaDASamplerConfig
from tadm.sampling.mdlm import MDLMSampler, MDLMSamplerConfig
from tadm.protocol import CacheableDenoiser, LayerSplit
from tadm.sampling.refresh import (REFRESH_POLICIES, AdaptiveRefresh, FixedRefresh, RefreshPolicy, ScheduleRefresh,
                                   get_refresh_policy, parse_refresh, parse_refresh_list, policy_from_key,
                                   refresh_policy_from_config)
from tadm.sampling.registry import SAMPLERS, build_sampler, get_sampler, sampler_config, sampler_from_config
from tadm.sampling.remdm import REMDM_STRATEGIES, ReMDMSampler, ReMDMSamplerConfig

__all__ = ["REFRESH_POLICIES", "AdaptiveRefresh", "AnchorCache", "CacheableDenoiser", "DreamSampler",
           "DreamSamplerConfig", "EntropyBoundSampler", "EntropyBoundSamplerConfig", "LLaDASampler", "LLaDASamplerConfig", "FixedRefresh", "GenerationOutput", "LayerCallCounter", "LayerSplit",
           "LoopContext", "LoopResult", "MDLMSampler", "MDLMSamplerConfig", "REMDM_STRATEGIES", "ReMDMSampler",
           "ReMDMSamplerConfig", "RefreshPolicy", "SAMPLERS", "Sampler", "SamplerOutput", "ScheduleRefresh",
           "check_refresh_interval", "build_sampler", "sampler_from_config", "denoise", "generate",
           "get_refresh_policy", "get_sampler", "parse_refresh", "parse_refresh_list", "policy_from_key",
           "refresh_policy_from_config", "is_refresh_step", "nucleus_filter", "sample_categorical", "sampler_config"]
