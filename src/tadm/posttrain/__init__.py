"""TADM:Post-train: turn a frozen pretrained diffusion LM into a time-anchored one by training a fusion.

* :mod:`~tadm.posttrain.backbone` - adapters exposing a layer-stack LM stage by stage
  (``DiffusionGemmaForBlockDiffusion`` from ``transformers``, tadm's MDLM; LLaDA and Dream in
  :mod:`~tadm.posttrain.backbones`);
* :mod:`~tadm.posttrain.model` - :class:`AnchoredBackbone`: shared / anchor / denoiser split plus the
  paired-attention fusion, a :class:`~tadm.protocol.CacheableDenoiser`;
* :mod:`~tadm.posttrain.layer_cache` - Algorithm 1 inside a model's own layer stack (the anchor layers
  run at refresh passes only), whoever drives the model;
* :mod:`~tadm.posttrain.sequence` - generation after a prompt for models whose canvas is the whole
  sequence (LLaDA, Dream), with their own samplers;
* :mod:`~tadm.posttrain.rollout` - the on-policy rollouts of Eq. (anchor-sft-rollout);
* :mod:`~tadm.posttrain.config` - the post-training config schema and its validation;
* :mod:`~tadm.posttrain.trainer` - the cache objective, Eq. (anchor-sft-objective), and the loop;
* :mod:`~tadm.posttrain.data` - chat JSONL -> (context, canvas) pairs;
* :mod:`~tadm.posttrain.adapter_io` - the fusion saved apart from the backbone, with a model card,
  loaded from a directory or a Hub id and pushed to the Hub;
* :mod:`~tadm.posttrain.hf_model` - :class:`TimeAnchoredDiffusionGemma`: a ``transformers``
  ``DiffusionGemmaForBlockDiffusion`` with the anchor cache in its decoder, so its own ``generate``,
  diffusers' pipeline or any loop runs Algorithm 1 (``from_pretrained``, ``save_pretrained``, ``push_to_hub``).

Importing this package does not import ``transformers``; it is loaded when a DiffusionGemma
backbone is built or loaded, or :class:`TimeAnchoredDiffusionGemma` (a ``transformers`` model) is first named.
"""

import importlib
from typing import Any

from tadm.posttrain.adapter_io import (AdapterConfig, attach_adapter, load_adapter_config, load_adapter_state,
                                       push_adapter_to_hub, resolve_adapter, save_adapter, save_adapter_pretrained,
                                       write_model_card)
from tadm.posttrain.backbone import (BACKBONES, DiffusionGemmaBackbone, DreamBackbone, LayerStackBackbone,
                                     LLaDABackbone, MDLMBackbone, PromptCache, StackContext, load_backbone,
                                     wrap_backbone)
from tadm.posttrain.config import PosttrainConfig, PosttrainConfigError, load_posttrain_config
from tadm.posttrain.data import (CanvasBatch, CanvasExample, ChatCanvasDataset, ChatExample, collate_canvases,
                                 encode_chat, read_chat_jsonl, split_into_canvases)
from tadm.posttrain.model import FUSION_MODES, AnchoredBackbone, FusionSpec, SplitSpec
from tadm.posttrain.rollout import (CACHE_AGE_PROBS, CACHE_AGES, ROLLOUT_MODES, RolloutState, draw_rollout,
                                    forward_rollout, on_policy_rollout, rollout_indices, sample_cache_ages)
from tadm.posttrain.sequence import SequenceGenerationOutput, generate_sequence
from tadm.posttrain.trainer import PosttrainLoss, PosttrainTrainer, canvas_batches, posttrain_loss, run_posttrain

__all__ = ["AdapterConfig", "AnchoredBackbone", "BACKBONES", "CACHE_AGES", "CACHE_AGE_PROBS", "CanvasBatch",
           "CanvasExample", "ChatCanvasDataset", "ChatExample", "DiffusionGemmaBackbone", "DreamBackbone",
           "FUSION_MODES", "FusionSpec", "LLaDABackbone", "LayerStackBackbone", "MDLMBackbone", "PosttrainConfig",
           "PosttrainConfigError", "PosttrainLoss", "PosttrainTrainer", "PromptCache", "ROLLOUT_MODES", "RolloutState",
           "SequenceGenerationOutput", "SplitSpec", "StackContext", "TimeAnchoredDiffusionGemma", "attach_adapter",
           "canvas_batches", "collate_canvases", "encode_chat", "generate_sequence", "load_adapter_config",
           "load_adapter_state", "load_backbone", "load_posttrain_config", "load_time_anchored", "draw_rollout",
           "forward_rollout", "on_policy_rollout", "posttrain_loss", "push_adapter_to_hub", "read_chat_jsonl",
           "resolve_adapter", "rollout_indices", "run_posttrain", "sample_cache_ages", "save_adapter",
           "save_adapter_pretrained", "split_into_canvases", "wrap_backbone", "write_model_card"]


_HF_MODEL = ("TimeAnchoredDiffusionGemma", "load_time_anchored")


def __getattr__(name: str) -> Any:
    if name in _HF_MODEL:  # deferred: hf_model subclasses a transformers model (an optional extra)
        return getattr(importlib.import_module("tadm.posttrain.hf_model"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
