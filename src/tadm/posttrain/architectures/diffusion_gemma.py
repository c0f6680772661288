"""DiffusionGemma (``DiffusionGemmaForBlockDiffusion`` of ``transformers``): delegated to its own class.

A DiffusionGemma is time-anchorized by :class:`~tadm.posttrain.hf_model.TimeAnchoredDiffusionGemma`
(converted in place): its encoder's forward starts a new canvas and its ``generate`` a new record.
"""

import importlib
from typing import Any

from torch import nn

from tadm.posttrain.architectures.spec import Architecture
from tadm.posttrain.backbone import DiffusionGemmaBackbone


def convert(model: nn.Module, *, split: Any = None, fusion: Any = None, policy: Any = None, naive: bool = False,
            adapter: Any = None) -> nn.Module:
    """``TimeAnchoredDiffusionGemma.from_pretrained(model, ...)``: the loaded model converted in place."""
    # by name: hf_model subclasses a transformers model (an optional extra), loaded when a DiffusionGemma is given
    anchored = importlib.import_module("tadm.posttrain.hf_model").TimeAnchoredDiffusionGemma
    if adapter is not None:
        return anchored.from_pretrained(model, adapter=adapter, refresh_policy=policy, naive=naive)
    return anchored.from_pretrained(model, split=split, fusion=fusion, refresh_policy=policy, naive=naive)


DIFFUSION_GEMMA = Architecture(
    name="diffusion-gemma",
    class_names=("DiffusionGemmaForBlockDiffusion",),
    layers="model.decoder.layers",
    embedding="model.decoder.embed_tokens",
    final_norm="model.decoder.norm",
    head="lm_head",
    token_argument="decoder_input_ids",
    parameterisation="softmax",
    prior="uniform",
    backbone=DiffusionGemmaBackbone,
    description='DiffusionGemmaForBlockDiffusion.from_pretrained("google/diffusiongemma-26B-A4B-it")',
    generation_methods=("generate",),
    reset_module="model.encoder",
    rollout_sampler="entropy-bound",
    convert=convert,
)
