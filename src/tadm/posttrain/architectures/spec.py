"""What tadm needs to know about a family of layer-stack diffusion LMs to time-anchorize a loaded model.

An :class:`Architecture` is a small table entry (PEFT's per-model ``target_modules``, transformers' Auto
classes): how a loaded model of the family is recognised (a class name in its MRO, or its config's
``model_type`` together with its module layout), where its layer stack, token embedding, final norm and
output head live, the name of the forward's token argument, the output parameterisation, where a new
canvas starts (an encoder's forward, the start of a generation method, or a canvas that is no
continuation of the previous pass's) and which :class:`~tadm.posttrain.backbone.LayerStackBackbone`
adapter gives its stage view. :func:`tadm.posttrain.anchorize.anchorize` reads nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["PARAMETERISATIONS", "Architecture", "resolve_path"]

PARAMETERISATIONS = ("subs", "subs-shifted", "softmax")
"""Output parameterisations: SUBS on x0 logits at each position (MDLM, LLaDA); SUBS on logits that predict the
next position and are shifted right by one (Dream); a plain softmax (DiffusionGemma, a uniform-state model)."""


def resolve_path(model: nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` of ``model`` (alternatives separated by ``|``: the first that exists);
    None when none exists."""
    for option in path.split("|"):
        found: Any = model
        for name in option.split("."):
            found = getattr(found, name, None)
            if found is None:
                break
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Architecture:
    """One model family (module docstring).

    Attributes:
        name: the family's name, written as ``backbone`` in the adapters trained for it.
        class_names: class names (plain or module-qualified) whose presence in a model's MRO recognises it.
        model_types: ``config.model_type`` values that recognise a model of another class with this layout.
        layers, embedding, final_norm, head: dotted module paths in the loaded model (``a|b``: the first
            that exists, e.g. an untied head or the tied embedding).
        token_argument: the name of the forward's canvas argument (its first positional argument too).
        parameterisation: one of :data:`PARAMETERISATIONS`.
        prior: the forward process's prior, ``"mask"`` (absorbing) or ``"uniform"``.
        backbone: the stage-view adapter, ``backbone(model) -> LayerStackBackbone``.
        description: how a user loads a model of the family (for messages and the docs).
        generation_methods: the model's own generation methods; each call starts a new generation.
        reset_module: a module whose forward starts a new canvas (DiffusionGemma's encoder), if any.
        rollout_sampler: tadm's sampler (a registry name) for post-training rollouts of this family.
        generation_steps: ``f(model, args, kwargs) -> T or None``, the step count of a generation call.
        convert: for a family with its own time-anchored class (DiffusionGemma), the converter
            ``convert(model, *, split, fusion, policy, naive, adapter) -> model`` used instead of the generic one.
    """

    name: str
    class_names: tuple[str, ...]
    layers: str
    embedding: str
    final_norm: str
    head: str
    token_argument: str
    parameterisation: str
    prior: str
    backbone: Callable[[nn.Module], Any]
    description: str
    model_types: tuple[str, ...] = ()
    generation_methods: tuple[str, ...] = ()
    reset_module: str | None = None
    rollout_sampler: str = ""
    generation_steps: Callable[[nn.Module, tuple, dict], int | None] | None = None
    convert: Callable[..., nn.Module] | None = None

    def __post_init__(self) -> None:
        if self.parameterisation not in PARAMETERISATIONS:
            raise ValueError(f"architecture {self.name!r}: unknown parameterisation {self.parameterisation!r}; "
                             f"valid: {', '.join(PARAMETERISATIONS)}")
        if self.prior not in ("mask", "uniform"):
            raise ValueError(f"architecture {self.name!r}: prior must be 'mask' or 'uniform', got {self.prior!r}")

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` is of this family: a listed class in its MRO, or a listed ``config.model_type``
        with the family's layer stack in place."""
        for cls in type(model).__mro__:
            if cls.__name__ in self.class_names or f"{cls.__module__}.{cls.__qualname__}" in self.class_names:
                return True
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        return model_type in self.model_types and resolve_path(model, self.layers) is not None

    def check_layout(self, model: nn.Module) -> None:
        """Raise a one-line TypeError naming the module paths a recognised ``model`` lacks."""
        missing = [path for path in (self.layers, self.embedding, self.final_norm, self.head)
                   if resolve_path(model, path) is None]
        if missing:
            raise TypeError(f"{type(model).__name__} looks like a {self.name} model but lacks "
                            f"{', '.join(missing)}; a {self.name} model has {self.layers} (layers), {self.embedding} "
                            f"(embedding), {self.final_norm} (final norm) and {self.head} (head)")

    def layer_stack(self, model: nn.Module) -> nn.ModuleList:
        """The model's layer stack (a ``ModuleList``)."""
        layers = resolve_path(model, self.layers)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"{type(model).__name__}.{self.layers} is a {type(layers).__name__}, not the "
                            "ModuleList of layers a time-anchored stack needs")
        return layers
