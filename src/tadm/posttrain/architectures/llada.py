"""LLaDA (``LLaDAModelLM``, GSAI-ML/LLaDA-8B-*): where its parts live, for :func:`tadm.anchorize`.

LLaDA's ``generate`` is a function outside the model that calls ``model(x, attention_mask=...)`` once
per step, so the anchorized model marks one pass per forward call and starts a new canvas when the
canvas is no continuation of the previous pass's (a new prompt or generation), or on
``model.anchor_cache.reset()``.
"""

from tadm.posttrain.architectures.spec import Architecture
from tadm.posttrain.backbones import LLaDABackbone

LLADA = Architecture(
    name="llada",
    class_names=("LLaDAModelLM",),
    model_types=("llada",),
    layers="model.transformer.blocks",
    embedding="model.transformer.wte",
    final_norm="model.transformer.ln_f",
    head="model.transformer.ff_out|model.transformer.wte",  # untied output layer, or the tied embedding
    token_argument="input_ids",
    parameterisation="subs",
    prior="mask",
    backbone=LLaDABackbone,
    description='AutoModel.from_pretrained("GSAI-ML/LLaDA-8B-Instruct", trust_remote_code=True)',
    rollout_sampler="llada",
)
