"""Time-anchorize a loaded diffusion LM in place, PEFT-style: the anchor cache inside the model's own layer stack.

::

    model = tadm.anchorize(model, split=(1, 20), fusion=FusionSpec(rank=256), refresh_interval=3)  # to post-train
    model = tadm.AnchoredModel.from_pretrained(model, adapter="org/adapter", refresh_interval=3)   # to use

The model's family is looked up in :mod:`tadm.posttrain.architectures` (DiffusionGemma, LLaDA, Dream, tadm's
MDLM, or one registered by the user). Its anchor layers get the :mod:`~tadm.posttrain.layer_cache`
mechanism and its class is swapped for a small subclass (parameter names, ``state_dict`` keys of the
base and ``isinstance`` checks stay) whose ``forward`` is one denoising pass of Algorithm 1: at a refresh
pass every layer runs and the anchor is cached; at the others the anchor layers are skipped and the
paired-attention fusion combines the cached anchor with the current shallow state, Eq.
(stale-anchor-fusion-app). So the model's own generation runs the cache:

* a generation method of the model (Dream's ``diffusion_generate``) starts a new generation: the cache
  resets, ``model.last_generation`` records its layer calls and refresh steps;
* a loop of the user's that calls ``model(x)`` once per step (LLaDA's ``generate``, a function outside
  the model) runs the cache as it is. A pass whose canvas is no continuation of the previous pass's
  (another shape, or a position decoded there that now holds another token or a mask again) starts a
  new canvas, so consecutive generations never share an anchor; ``model.anchor_cache.reset()`` starts
  one explicitly and ``with model.anchor_cache.generation() as record:`` records one. A sampler that
  remasks decoded tokens (ReMDM) thus refreshes at every remasking step: correct, but no speed-up;
* tadm's own samplers drive a network stage by stage: they run on ``model.stage_view()``, an
  :class:`~tadm.posttrain.model.AnchoredBackbone` sharing the model's layers and fusion, with the
  refresh interval given to the sampler call. That is how tadm's MDLM is sampled (its own stage
  methods are refused on the anchorized model, which would bypass the cache) and what the
  post-training trainer runs.

DiffusionGemma is converted by its own class, :class:`~tadm.posttrain.hf_model.TimeAnchoredDiffusionGemma`.
At ``K = 1`` every pass refreshes and the model is the base, token for token. Bad input (an unknown
architecture, a split that does not fit, an adapter trained for another architecture or size, K < 1)
is a one-line error, raised before the model is changed.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tadm.nn import load_model
from tadm.posttrain.adapter_io import (AdapterConfig, CardResults, load_adapter_config, load_fusion_state,
                                       resolve_adapter, save_adapter_pretrained)
from tadm.posttrain.architectures import Architecture, find_architecture, get_architecture, resolve_path
from tadm.posttrain.layer_cache import LayerStackCache, check_policy, install_layer_cache, resolve_refresh
from tadm.posttrain.model import AnchoredBackbone, FusionSpec, SplitSpec, default_fusion, default_split
from tadm.protocol import LayerSplit
from tadm.sampling.refresh import FixedRefresh, RefreshPolicy, parse_refresh

__all__ = ["AnchoredModel", "AnchoredModelMixin", "anchorize", "is_anchorized"]

_STATE = "_tadm_anchor"  # the instance attribute holding an anchorized model's AnchorState


@dataclass
class AnchorState:
    """What an anchorized model keeps beside its modules: its family, cache, mask id and the last canvas seen."""

    architecture: Architecture
    cache: LayerStackCache
    mask_token_id: int | None
    base_model: str
    adapter_config: AdapterConfig | None = None
    previous: Tensor | None = None  # the canvas of the previous pass (a copy: loops update canvases in place)

    def follow(self, canvas: Tensor | None) -> None:
        """Start a new canvas unless ``canvas`` (B, L) continues the previous pass's (module docstring)."""
        previous, self.previous = self.previous, None if canvas is None else canvas.detach().clone()
        if previous is None or canvas is None:
            return
        if previous.shape != canvas.shape or previous.device != canvas.device:
            self.cache.reset()
            return
        decoded = previous != self.mask_token_id if self.mask_token_id is not None else torch.ones_like(
            previous, dtype=torch.bool)
        if not torch.equal(canvas[decoded], previous[decoded]):
            self.cache.reset()


class AnchoredModelMixin:
    """Mixed in front of an anchorized model's class by :func:`anchorize`: ``forward`` is one denoising pass.

    Attributes (besides the model's own):
        fusion: the paired-attention fusion (None: naive reuse only); the only trainable module.
        anchor_cache: the :class:`~tadm.posttrain.layer_cache.LayerStackCache` (policy, cached anchor, record).
        last_generation: the :class:`~tadm.posttrain.layer_cache.CacheRecord` of the last call of a generation
            method of the model (Dream's ``diffusion_generate``).
    """

    @property
    def anchor_state(self) -> AnchorState:
        return self.__dict__[_STATE]

    @property
    def anchor_cache(self) -> LayerStackCache:
        """The anchor cache: ``reset()``, ``generation()``, ``record``, ``num_steps`` (T, for schedule policies)."""
        return self.anchor_state.cache

    @property
    def architecture(self) -> Architecture:
        return self.anchor_state.architecture

    @property
    def layer_split(self) -> LayerSplit:
        return self.anchor_state.cache.split

    @property
    def refresh_policy(self) -> RefreshPolicy:
        """The refresh policy of every pass; set it with K (``model.refresh_policy = 3``) or any refresh spec."""
        return self.anchor_state.cache.policy

    @refresh_policy.setter
    def refresh_policy(self, spec: Any) -> None:
        self.anchor_state.cache.policy = check_policy(spec)

    def reset_anchor_cache(self) -> None:
        """Start a new canvas: forget the cached anchor and the step count."""
        self.anchor_state.cache.reset()
        self.anchor_state.previous = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward as one denoising pass of Algorithm 1 (the anchor layers run at refresh passes)."""
        state = self.__dict__[_STATE]
        cache = state.cache
        if cache.in_pass:  # a forward that calls itself (a wrapper around the same model)
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        canvas = _canvas(args, kwargs, state.architecture.token_argument)
        state.follow(canvas)
        with cache.denoising_pass(canvas):
            return super().forward(*args, **kwargs)  # type: ignore[misc]

    def stage_view(self) -> AnchoredBackbone:
        """This model stage by stage (an :class:`AnchoredBackbone` over the family's backbone adapter), sharing
        its layers and fusion: what tadm's samplers (``tadm.sampling.generate``, ``generate_sequence``) and the
        post-training trainer run. Without a fusion the view runs naive reuse."""
        state = self.__dict__[_STATE]
        split = state.cache.split
        fusion = self.fusion
        backbone = state.architecture.backbone(self)  # freezes the model (the fusion too), as every backbone does
        if fusion is None:
            view = AnchoredBackbone(backbone, split, default_fusion(backbone.hidden_size), fusion_mode="naive")
            view.fusion.to(_device(self, state.architecture))
            return view
        view = AnchoredBackbone(backbone, split, fusion, fusion_mode=state.cache.mode)  # freezes the backbone
        fusion.requires_grad_(True)
        return view

    def save_pretrained(self, save_directory: str | os.PathLike[str], *, base_model: str | None = None,
                        card_results: CardResults | None = None, license: str | None = None,
                        repo_id: str | None = None) -> Path:
        """Save the adapter (PEFT's convention: the fusion, ``adapter_config.json`` with the architecture, base,
        split and refresh policy, and a model card), not the base; returns the directory."""
        if self.fusion is None:
            raise ValueError("this model has no adapter to save (it was anchorized without a fusion)")
        state = self.__dict__[_STATE]
        extra = dict(state.adapter_config.extra) if state.adapter_config is not None else None
        return save_adapter_pretrained(save_directory, self.stage_view(), base_model=base_model or state.base_model,
                                       extra=extra, refresh_policy=state.cache.policy.config(),
                                       card_results=card_results, license=license, repo_id=repo_id)


def _canvas(args: tuple, kwargs: dict[str, Any], name: str) -> Tensor | None:
    """The forward's token ids (B, L): the ``name`` keyword or the first positional argument; None when absent."""
    canvas = kwargs.get(name, args[0] if args else None)
    if isinstance(canvas, Tensor) and canvas.dim() == 2 and not canvas.is_floating_point():
        return canvas
    return None


def _generation_method(original: Callable[..., Any], architecture: Architecture) -> Callable[..., Any]:
    """``original`` (a generation method of the model) run as one generation: a new canvas and record."""

    @functools.wraps(original)
    def generation(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__[_STATE]
        cache = state.cache
        steps = architecture.generation_steps(self, args, kwargs) if architecture.generation_steps else None
        before = cache.num_steps
        cache.num_steps = steps if steps is not None else before
        state.previous = None
        try:
            with cache.generation() as record:
                out = original(self, *args, **kwargs)
        finally:
            cache.num_steps = before
        self.last_generation = record
        return out

    return generation


def _forward_of(cls: type) -> Callable[..., Any]:
    """:meth:`AnchoredModelMixin.forward` showing ``cls.forward``'s signature and docstring (libraries read
    the accepted arguments from the signature)."""

    @functools.wraps(cls.forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return AnchoredModelMixin.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(cls.forward)  # type: ignore[attr-defined]
    return forward


def _refused(name: str, architecture: Architecture) -> Callable[..., Any]:
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{name} of an anchorized {architecture.name} model would bypass its anchor cache; tadm's "
                        f"samplers and likelihoods drive its stage view: pass model.stage_view() (e.g. "
                        f"tadm.sampling.generate(model.stage_view(), ..., refresh_interval=K))")

    return refused


_REFUSED = {"mdlm": ("compute_anchor",)}
_ASKED_OF_THE_BASE = ("_can_set_attn_implementation", "_can_set_experts_implementation")  # tadm's own stage methods, which tadm's loop calls instead of forward
_CLASSES: dict[tuple[type, str], type] = {}


def _anchored_class(cls: type, architecture: Architecture) -> type:
    """``cls`` with :class:`AnchoredModelMixin` in front and its generation methods wrapped, made once and
    findable by pickle."""
    key = (cls, architecture.name)
    if key not in _CLASSES:
        namespace: dict[str, Any] = {"__module__": __name__, "forward": _forward_of(cls)}
        for method in architecture.generation_methods:
            if callable(getattr(cls, method, None)):
                namespace[method] = _generation_method(getattr(cls, method), architecture)
        for method in _REFUSED.get(architecture.name, ()):
            namespace[method] = _refused(method, architecture)
        for method in _ASKED_OF_THE_BASE:  # transformers reads the source of a class's module to answer these
            if callable(getattr(cls, method, None)):
                namespace[method] = classmethod(lambda _, name=method: getattr(cls, name)())
        name = f"TimeAnchored{cls.__name__}"
        while hasattr(sys.modules[__name__], name):  # another class of the same name was anchorized before
            name += "_"
        namespace["__qualname__"] = name
        made = type(name, (AnchoredModelMixin, cls), namespace)
        _CLASSES[key] = made
        setattr(sys.modules[__name__], name, made)
    return _CLASSES[key]


def is_anchorized(model: Any) -> bool:
    """Whether ``model`` has been time-anchorized (by :func:`anchorize` or as a ``TimeAnchoredDiffusionGemma``)."""
    return isinstance(model, AnchoredModelMixin) or any(
        cls.__name__ == "TimeAnchoredDiffusionGemma" for cls in type(model).__mro__)


# ------------------------------------------------------------------------------------------ converting
def _as_split(split: Any, num_layers: int) -> LayerSplit:
    """(shared, anchor[, denoiser]) counts, a SplitSpec or a LayerSplit (None: the paper's split scaled to the
    stack), checked against ``num_layers`` (one-line ValueError)."""
    if split is None:
        spec = default_split(num_layers)
    elif isinstance(split, SplitSpec):
        spec = split
    elif isinstance(split, LayerSplit):
        spec = SplitSpec(split.shared, split.anchor, split.denoiser)
    elif isinstance(split, (tuple, list)) and len(split) in (2, 3):
        spec = SplitSpec(*split)
    else:
        raise ValueError(f"split must be (shared, anchor) layer counts, e.g. split=(2, 20), or a SplitSpec; got "
                         f"{split!r}")
    return spec.resolve(num_layers)


def _fusion_spec(fusion: Any, hidden_size: int) -> FusionSpec | None:
    if fusion is None:
        return default_fusion(hidden_size)
    if fusion is False:
        return None
    if not isinstance(fusion, FusionSpec):
        raise ValueError(f"fusion must be a FusionSpec (or False for naive reuse without a fusion), got {fusion!r}")
    return fusion


def _device(model: nn.Module, architecture: Architecture) -> torch.device:
    embedding = resolve_path(model, architecture.embedding)
    return embedding.weight.device


def _hidden_size(model: nn.Module, architecture: Architecture) -> int:
    return int(resolve_path(model, architecture.embedding).weight.shape[-1])


def _base_name(model: nn.Module) -> str:
    return str(getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
               or "unknown")


def _check_model(model: Any, what: str) -> Architecture:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} takes a loaded model (a torch.nn.Module), got {type(model).__name__}; load the "
                        "model first (tadm never runs code shipped with a checkpoint)")
    if is_anchorized(model):
        raise ValueError(f"this {type(model).__name__} is time-anchorized already; load its base again to anchorize "
                         "it differently or to attach another adapter")
    return find_architecture(model)


def _install(model: nn.Module, architecture: Architecture, split: LayerSplit, fusion: nn.Module | None,
             policy: RefreshPolicy, naive: bool, base_model: str, adapter_config: AdapterConfig | None) -> nn.Module:
    """Convert ``model`` in place (every check has passed): backbone checks, class swap, fusion, layer cache."""
    if "fusion" in model._modules or "fusion" in model.__dict__ or hasattr(type(model), "fusion"):
        raise ValueError(f"{type(model).__name__} has an attribute 'fusion' already, where the anchorized model "
                         "keeps its fusion")
    layers = architecture.layer_stack(model)
    training = model.training
    grads = [p.requires_grad for p in model.parameters()]
    try:  # the adapter checks the layout and reads the mask id; it freezes the model (restored if it refuses it)
        backbone = architecture.backbone(model)
    except Exception:
        model.train(training)
        for p, flag in zip(model.parameters(), grads):
            p.requires_grad_(flag)
        raise
    cache = LayerStackCache(split, fusion, policy)
    if naive:
        cache.set_mode("naive")
    model.__class__ = _anchored_class(type(model), architecture)
    model.__dict__[_STATE] = AnchorState(architecture, cache, backbone.mask_token_id, base_model, adapter_config)
    model.fusion = fusion  # registered as a submodule (None: no fusion)
    model.last_generation = None
    install_layer_cache(layers, cache)
    model.requires_grad_(False)
    if fusion is not None:
        fusion.requires_grad_(True)
    return model.eval()


def anchorize(
    model: nn.Module,
    split: Any = None,
    fusion: FusionSpec | bool | None = None,
    *,
    refresh_interval: int | None = None,
    refresh_policy: Any = None,
    naive: bool = False,
    base_model: str | None = None,
) -> nn.Module:
    """Time-anchorize a loaded ``model`` in place and return it (module docstring), e.g. to post-train a fusion.

    Args:
        model: a loaded model of a registered architecture (:mod:`tadm.posttrain.architectures`).
        split: (shared, anchor[, denoiser]) layer counts or a :class:`SplitSpec` (default: the paper's
            2 / 20 / 8 of 30 layers scaled to the stack).
        fusion: the fusion's size (default: rank min(256, d / 8), 4 heads, initialised as the identity);
            False for none (naive reuse only).
        refresh_interval, refresh_policy: K >= 1 (default 1: the base model), or any refresh spec.
        naive: read the stale anchor as is (the fusion is bypassed), the paper's baseline.
        base_model: the base's name, recorded in saved adapters (default: the model's ``name_or_path``).
    """
    policy = resolve_refresh(refresh_interval, refresh_policy) or FixedRefresh(1)
    architecture = _check_model(model, "anchorize")
    num_layers = len(architecture.layer_stack(model))
    layer_split = _as_split(split, num_layers)
    hidden = _hidden_size(model, architecture)
    spec = _fusion_spec(fusion, hidden)
    if architecture.convert is not None:
        return architecture.convert(model, split=SplitSpec(layer_split.shared, layer_split.anchor,
                                                           layer_split.denoiser), fusion=spec, policy=policy,
                                    naive=naive)
    module = None if spec is None else spec.build(hidden).to(device=_device(model, architecture), dtype=torch.float32)
    return _install(model, architecture, layer_split, module, policy, naive, base_model or _base_name(model), None)


class AnchoredModel:
    """PEFT's ``PeftModel.from_pretrained`` for time-anchored models: a loaded base plus a tadm adapter.

    ``AnchoredModel.from_pretrained(model, adapter=DIR_OR_HUB_ID, refresh_interval=K)`` converts ``model`` in
    place (as :func:`anchorize`, with the adapter's split and trained fusion) and returns it.
    """

    def __init__(self) -> None:
        raise TypeError("AnchoredModel is not instantiated: use AnchoredModel.from_pretrained(model, adapter=...) or "
                        "tadm.anchorize(model, ...), which convert the model in place")

    @classmethod
    def from_pretrained(
        cls,
        model: nn.Module | str | os.PathLike[str],
        adapter: str | os.PathLike[str],
        *,
        refresh_interval: int | None = None,
        refresh_policy: Any = None,
        naive: bool = False,
        adapter_kwargs: dict[str, Any] | None = None,
    ) -> nn.Module:
        """Attach ``adapter`` (a directory or Hub id) to ``model`` (a loaded model; or a directory / Hub id of a
        DiffusionGemma or tadm MDLM base, which tadm loads itself).

        The refresh policy is ``refresh_interval`` / ``refresh_policy``, else the adapter's saved one, else K = 1.
        An adapter trained for another architecture, layer count or hidden size is a one-line ValueError.
        """
        policy = resolve_refresh(refresh_interval, refresh_policy)
        directory = resolve_adapter(adapter, **(adapter_kwargs or {}))
        config = load_adapter_config(directory)
        if not isinstance(model, nn.Module):
            model = _load_base(model, config)
        architecture = _check_model(model, "AnchoredModel.from_pretrained")
        if config.backbone != architecture.name:
            raise ValueError(f"adapter {os.fspath(adapter)!r} was trained for a {config.backbone!r} model; this "
                             f"{type(model).__name__} is a {architecture.name!r} model")
        layers, hidden = len(architecture.layer_stack(model)), _hidden_size(model, architecture)
        if (layers, hidden) != (config.num_layers, config.hidden_size):
            raise ValueError(f"adapter {os.fspath(adapter)!r} was trained on a {config.num_layers}-layer "
                             f"{config.backbone} of hidden size {config.hidden_size} ({config.base_model}); this model "
                             f"has {layers} layers of size {hidden}")
        if policy is None:
            policy = parse_refresh(config.refresh_policy) if config.refresh_policy is not None else FixedRefresh(1)
        if architecture.convert is not None:
            return architecture.convert(model, adapter=directory, policy=policy, naive=naive)
        split = config.split.resolve(layers)
        fusion = config.fusion.build(hidden).to(device=_device(model, architecture), dtype=torch.float32)
        load_fusion_state(fusion, directory)  # before the model changes: a bad adapter leaves it as it was
        return _install(model, architecture, split, fusion, policy, naive, config.base_model, config)


def _load_base(source: str | os.PathLike[str], config: AdapterConfig) -> nn.Module:
    """A base given by name: tadm loads MDLM checkpoints itself and a DiffusionGemma through transformers."""
    architecture = get_architecture(config.backbone)
    if architecture.name == "mdlm":
        return load_model(source)
    if architecture.name == "diffusion-gemma":  # transformers' own class, never code shipped with the checkpoint
        return architecture.backbone.from_pretrained(os.fspath(source)).model
    raise ValueError(f"tadm does not run code shipped with a checkpoint: load the {architecture.name} model "
                     f"{os.fspath(source)!r} yourself, e.g. {architecture.description}, and pass the loaded model")
