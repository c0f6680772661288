"""Networks: blocks and the time-anchored components (Phi, A, D, S) plus baselines."""

from tadm.nn.baselines import (ADLM, MDLM, ADLMConfig, ARConfig, ARTransformer, MDLMConfig, adlm_small, adlm_tiny,
                               ar_small, ar_tiny, mdlm_small, mdlm_tiny)
from tadm.nn.dit import (NEG_INF, DiTBlock, DiTStack, FinalLayer, RotaryEmbedding, TimestepEmbedder, apply_rotary,
                         remove_mask_log_probs, subs_log_probs)
from tadm.nn.fusion import GatedResidualFusion, PairedAttentionFusion
from tadm.nn.hub import MODEL_BUILDERS, MODEL_CLASSES, HubMixin, build_model, load_model
from tadm.nn.base import DiTSizes, MaskedDiffusionNetwork, MaskedDiffusionSizes
from tadm.nn.released_mdlm import LoadedCheckpoint, load_released_mdlm
from tadm.nn.tadm import TADM, NaiveReuse, TADMConfig, TADMOutput, tadm_small, tadm_tiny

__all__ = ["DiTSizes", "MaskedDiffusionNetwork", "MaskedDiffusionSizes", "ADLM", "ADLMConfig", "ARConfig",
           "ARTransformer", "DiTBlock", "DiTStack", "FinalLayer", "GatedResidualFusion", "HubMixin",
           "LoadedCheckpoint", "MDLM", "MDLMConfig", "MODEL_BUILDERS", "MODEL_CLASSES", "NEG_INF", "NaiveReuse",
           "PairedAttentionFusion", "RotaryEmbedding", "TADM", "TADMConfig", "TADMOutput", "TimestepEmbedder",
           "adlm_small", "adlm_tiny", "apply_rotary", "ar_small", "ar_tiny", "build_model", "load_model",
           "load_released_mdlm", "mdlm_small", "mdlm_tiny", "remove_mask_log_probs", "subs_log_probs", "tadm_small",
           "tadm_tiny"]
