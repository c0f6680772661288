"""The registry of model families :func:`tadm.anchorize` can time-anchorize: one file per family, one line each.

=================== ==================================== ===========================================
name                recognised by                        generation path that runs the cache
=================== ==================================== ===========================================
``diffusion-gemma`` ``DiffusionGemmaForBlockDiffusion``  its ``generate`` (:mod:`~tadm.posttrain.hf_model`)
``llada``           ``LLaDAModelLM`` / ``llada`` config  any loop calling ``model(x)`` (LLaDA's ``generate``)
``dream``           ``DreamModel`` / ``Dream`` config    its ``diffusion_generate``, any loop calling ``model``
``mdlm``            tadm's ``MDLM``                      tadm's samplers on ``model.stage_view()``
=================== ==================================== ===========================================

Another family is one :class:`~tadm.posttrain.architectures.spec.Architecture` (module paths of its layers,
embedding, final norm and head; the forward's token argument; the output parameterisation; where a new
canvas starts; its :class:`~tadm.posttrain.backbone.LayerStackBackbone` adapter) passed to
:func:`register_architecture`.
"""

from __future__ import annotations

from torch import nn

from tadm.posttrain.architectures.diffusion_gemma import DIFFUSION_GEMMA
from tadm.posttrain.architectures.dream import DREAM
from tadm.posttrain.architectures.llada import LLADA
from tadm.posttrain.architectures.mdlm import MDLM
from tadm.posttrain.architectures.spec import PARAMETERISATIONS, Architecture, resolve_path

__all__ = ["ARCHITECTURES", "PARAMETERISATIONS", "Architecture", "find_architecture", "get_architecture",
           "register_architecture", "resolve_path", "rollout_sampler_for", "supported_architectures"]

ARCHITECTURES: dict[str, Architecture] = {
    DIFFUSION_GEMMA.name: DIFFUSION_GEMMA,
    LLADA.name: LLADA,
    DREAM.name: DREAM,
    MDLM.name: MDLM,
}
"""Family name -> entry, in the order models are matched."""


def register_architecture(architecture: Architecture, *, replace: bool = False) -> Architecture:
    """Add a family to :data:`ARCHITECTURES` (``replace=True`` to overwrite one of the same name); returns it."""
    if not isinstance(architecture, Architecture):
        raise TypeError(f"register_architecture takes a tadm.posttrain.architectures.Architecture, got "
                        f"{type(architecture).__name__}")
    if architecture.name in ARCHITECTURES and not replace:
        raise ValueError(f"an architecture named {architecture.name!r} is registered already; pass replace=True to "
                         "overwrite it")
    ARCHITECTURES[architecture.name] = architecture
    return architecture


def supported_architectures() -> str:
    """``name (ClassName), ...`` of the registered families, for messages."""
    return ", ".join(f"{a.name} ({a.class_names[0].rpartition('.')[2]})" for a in ARCHITECTURES.values())


def find_architecture(model: nn.Module) -> Architecture:
    """The registered family of a loaded ``model``; a one-line TypeError naming the supported ones otherwise."""
    for architecture in ARCHITECTURES.values():
        if architecture.matches(model):
            architecture.check_layout(model)
            return architecture
    raise TypeError(f"tadm cannot time-anchorize a {type(model).__name__}: no registered architecture recognises it "
                    f"(supported: {supported_architectures()}); register another with "
                    "tadm.posttrain.architectures.register_architecture(Architecture(...)), one file per family")


def get_architecture(name: str) -> Architecture:
    """The registered family ``name``; a one-line ValueError listing the valid names otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; valid: {', '.join(ARCHITECTURES)}") from None


def rollout_sampler_for(backbone: nn.Module) -> str:
    """The sampler (a registry name) of post-training rollouts for a backbone adapter: its family's own."""
    for architecture in ARCHITECTURES.values():
        if isinstance(architecture.backbone, type) and isinstance(backbone, architecture.backbone):
            return architecture.rollout_sampler
    raise ValueError(f"no registered architecture uses the backbone adapter {type(backbone).__name__}; set "
                     "rollout.masked_sampler to a sampler name")
