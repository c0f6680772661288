"""Algorithm 1 inside a model's own layer stack: the anchor layers run only at refresh steps.

A split model (sec. "Model Decomposition", appendix "TADM:Post-train") is a layer stack cut at
``0 <= s < a <= N``: shared layers ``[0, s)`` give the shallow state C, anchor layers ``[s, a)`` the
anchor H0, denoiser layers ``[a, N)`` and the head the prediction. :func:`install_layer_cache` puts
the anchor cache into such a stack without touching the model's forward or anyone's sampling loop:
the anchor layers' class is swapped for a subclass whose ``forward`` consults a
:class:`LayerStackCache` (parameter names, ``state_dict`` keys and ``isinstance`` checks are
unchanged). The model's own forward then runs Algorithm 1 pass by pass:

* a **refresh** pass runs every layer; the input of layer ``s`` (C0) and the output of layer ``a - 1``
  (H0) are cached with the canvas and step they came from;
* any other pass runs the shared layers, skips the anchor layers (each returns its input), and the
  last anchor layer returns the fused anchor ``H~ = Phi(C, C0, H0)``, Eq. (stale-anchor-fusion-app)
  (naive reuse: ``H0`` itself); the denoiser layers run on it.

Whoever drives the model marks each denoising pass with :meth:`LayerStackCache.denoising_pass`
(the model wrapper does it in ``forward``), which asks the refresh policy (fixed K, schedule or
adaptive; :mod:`tadm.sampling.refresh`) whether to refresh, counts the Transformer-layer calls the pass
makes, and keeps the step count. :meth:`LayerStackCache.reset` starts a new canvas (a new block, a new
generation). Outside a marked pass the layers behave as the original ones, so stage-by-stage callers
(training, rollouts) use the same modules unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tadm.protocol import LayerSplit
from tadm.sampling.anchor_cache import AnchorCache, LayerCallCounter
from tadm.sampling.refresh import RefreshPolicy, parse_refresh

__all__ = ["CacheRecord", "LayerStackCache", "install_layer_cache", "remove_layer_cache"]

FUSION_MODES = ("paired", "naive")
_HIDDEN_NAMES = ("hidden_states", "x", "hidden", "h")  # keyword names of a layer's hidden-state input


@dataclass
class CacheRecord:
    """What the cache did since :meth:`LayerStackCache.start_record`: layer calls and refresh steps per canvas."""

    layer_calls: LayerCallCounter = field(default_factory=LayerCallCounter)
    # per canvas, the reverse steps i that refreshed; the positions n = 0, 1, ... when i is unknown (a loop that gives
    # neither i nor the cache's num_steps T)
    refresh_steps: list[list[int]] = field(default_factory=list)
    encoder_layer_calls: int = 0  # causal-encoder layers run for the context (models that have one)


@dataclass
class _Pass:
    """One denoising pass in flight."""

    refresh: bool
    shallow: Tensor | None = None  # C: the input of the first anchor layer in this pass


def check_policy(policy: Any) -> RefreshPolicy:
    """The refresh policy of a spec (:func:`~tadm.sampling.refresh.parse_refresh`) that a layer stack can run."""
    policy = parse_refresh(policy)
    if policy.skip_unchanged:
        raise ValueError(f"refresh policy {policy.label()!r}: skip_unchanged reuses a whole prediction, which only a "
                         "sampling loop can do; inside the model give the policy without skip_unchanged")
    return policy


class LayerStackCache:
    """The anchor cache of one split layer stack, its refresh policy and its layer-call count.

    Args:
        split: shared / anchor / denoiser layer counts of the stack.
        fusion: the paired-attention fusion Phi(C, C0, H0) (None: only naive reuse is possible).
        policy: the refresh policy (a spec such as ``3``, ``"adaptive:tau=0.3"``, or a policy).
        num_steps: T of the sampler, for policies that read the step index i = T - n (a schedule);
            :meth:`denoising_pass` may give i directly instead.
    """

    def __init__(self, split: LayerSplit, fusion: nn.Module | None, policy: Any = 1,
                 num_steps: int | None = None) -> None:
        self.split = split
        self.fusion = fusion
        self.policy = check_policy(policy)
        self.mode = "paired" if fusion is not None else "naive"
        self.num_steps = num_steps
        self.cache = AnchorCache()
        self.record = CacheRecord()
        self.position = 0  # passes since the last reset
        self._previous_canvas: Tensor | None = None
        self._pass: _Pass | None = None
        self._pending_step = 0  # the step index (or position) and canvas of the pass being planned
        self._pending_canvas: Tensor | None = None
        self._templates: dict[int, Any] = {}  # per anchor layer, its output at the last refresh (return structure)

    # ---------------------------------------------------------------- configuration
    @property
    def shared_end(self) -> int:
        return self.split.shared

    @property
    def anchor_end(self) -> int:
        return self.split.shared + self.split.anchor

    def set_mode(self, mode: str) -> None:
        """``"paired"`` (the fusion corrects the stale anchor) or ``"naive"`` (the stale anchor is read as is)."""
        if mode not in FUSION_MODES:
            raise ValueError(f"unknown fusion mode {mode!r}; valid: {', '.join(FUSION_MODES)}")
        if mode == "paired" and self.fusion is None:
            raise ValueError("this model has no fusion (it was split without an adapter): only naive reuse runs")
        self.mode = mode

    @property
    def caches_anchor(self) -> bool:
        """False when every pass refreshes (fixed K = 1): the stack then runs exactly as the original one."""
        return self.policy.fixed_interval != 1

    # ---------------------------------------------------------------- runs
    def reset(self) -> None:
        """Start a new canvas: forget the cached anchor and the step count (the record goes on)."""
        if self._pass is not None:
            return  # a context encoded inside a pass (a forward given input_ids) starts before the pass does
        if self.cache.history:
            self.record.refresh_steps.append(list(self.cache.history))
        self.cache.reset()
        self.policy.reset()
        self.position = 0
        self._previous_canvas = None
        self._templates.clear()

    def start_record(self) -> CacheRecord:
        """Reset and begin a new :class:`CacheRecord` (e.g. at the start of a generation); returns it."""
        self.reset()
        self.record = CacheRecord()
        return self.record

    def finish_record(self) -> CacheRecord:
        """Close the current canvas in the record and return the record."""
        if self.cache.history:
            self.record.refresh_steps.append(list(self.cache.history))
            self.cache.history.clear()
        return self.record

    @contextlib.contextmanager
    def denoising_pass(self, canvas: Tensor | None = None, step_index: int | None = None) -> Iterator[_Pass]:
        """Mark one denoising pass of the stack on ``canvas`` (B, L) token ids (None when unknown).

        Decides with the policy whether the pass refreshes the anchor (always when nothing is cached
        or the canvas shape changed), counts the layer calls, and advances the step count.
        ``step_index`` is the reverse step i (default ``num_steps - n`` when ``num_steps`` is set).
        """
        refresh = self._plan(canvas, step_index)
        self.record.layer_calls.add_pass(self.split, refreshed=refresh)
        if refresh and not self.caches_anchor:  # nothing is stored, but the refresh is recorded as at any K
            self.cache.history.append(self._pending_step)
        self._pass = _Pass(refresh=refresh)
        try:
            yield self._pass
        finally:
            self._pass = None
            self.position += 1
            self._previous_canvas = canvas

    @property
    def in_pass(self) -> bool:
        return self._pass is not None

    def _step_index(self, step_index: int | None) -> int | None:
        if step_index is not None:
            return int(step_index)
        return None if self.num_steps is None else self.num_steps - self.position

    def _plan(self, canvas: Tensor | None, step_index: int | None) -> bool:
        i = self._step_index(step_index)
        held = self.cache.hidden
        shape_changed = held is not None and canvas is not None and (
            self.cache.canvas is None or self.cache.canvas.shape != canvas.shape)
        if held is None or shape_changed or not self.caches_anchor:
            refresh = True
        elif self.policy.name == "adaptive" and canvas is None:
            refresh = True  # the drift cannot be measured on an unknown canvas
        else:
            if i is None and self.policy.name == "schedule":
                raise ValueError("a refresh schedule needs the reverse step i: set the cache's num_steps (T) or "
                                 "pass step_index")
            probe = canvas if canvas is not None else torch.empty(0, dtype=torch.long)
            refresh = self.policy.plan(self.position, i if i is not None else self.position, probe, self.cache,
                                       self._previous_canvas).refresh
        if refresh:
            self.policy.last_refresh_position = self.position
        self._pending_step = i if i is not None else self.position
        self._pending_canvas = canvas
        return refresh

    # ---------------------------------------------------------------- the anchor layers
    def anchor_layer(self, index: int, run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        """Layer ``index`` in [s, a) during a marked pass: run it (refresh) or skip it (reuse)."""
        step = self._pass
        assert step is not None
        hidden = _hidden_input(args, kwargs)
        first, last = index == self.shared_end, index == self.anchor_end - 1
        if first:
            step.shallow = hidden
        if step.refresh or not self.caches_anchor:
            out = run()
            if self.caches_anchor:
                self._templates[index] = out
                if last:
                    canvas = self._pending_canvas
                    self.cache.store((_hidden_output(out), step.shallow),
                                     canvas.clone() if canvas is not None else None, self._pending_step)
            return out
        template = self._templates.get(index)
        if template is None:  # cached by another process or a changed stack: cannot reuse
            raise RuntimeError(f"anchor layer {index} has no output from a refresh pass to reuse")
        if not last:
            return _with_hidden(template, hidden)
        h0, c0 = self.cache.hidden
        return _with_hidden(template, self.fuse(step.shallow, c0, h0))

    def fuse(self, c: Tensor, c0: Tensor, h0: Tensor) -> Tensor:
        """Phi: the fused anchor (B, L, d) from the current C and the cached C0, H0 (naive mode: H0)."""
        if self.mode == "naive" or self.fusion is None:
            return h0
        if c.shape == c0.shape and torch.equal(c, c0.to(c.dtype)):
            return h0  # a canvas whose shallow state did not change: the fusion is exactly the identity
        return self.fusion(c, c0.to(c.dtype), h0)


def _hidden_input(args: tuple, kwargs: dict) -> Tensor:
    if args:
        return args[0]
    for name in _HIDDEN_NAMES:
        if name in kwargs:
            return kwargs[name]
    raise TypeError(f"cannot find the hidden-state input of an anchor layer (looked at the first positional argument "
                    f"and the keywords {', '.join(_HIDDEN_NAMES)})")


def _hidden_output(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(f"an anchor layer returned {type(out).__name__}; a tensor or a tuple starting with the hidden "
                    "states is expected")


def _with_hidden(template: Any, hidden: Tensor) -> Any:
    """``template`` (a layer's output) with its hidden states replaced by ``hidden``."""
    if isinstance(template, Tensor):
        return hidden
    return type(template)([hidden, *template[1:]]) if isinstance(template, list) else (hidden, *template[1:])


# -------------------------------------------------------------------------------- installing
class AnchorLayerMixin:
    """Mixed into an anchor layer's class: inside a marked pass the :class:`LayerStackCache` decides."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.__dict__.get("_tadm_layer_cache")
        if cache is None or not cache.in_pass:
            return super().forward(*args, **kwargs)
        return cache.anchor_layer(self.__dict__["_tadm_layer_index"], lambda: super(AnchorLayerMixin, self).forward(
            *args, **kwargs), args, kwargs)


_ANCHOR_CLASSES: dict[type, type] = {}


def _anchor_class(cls: type) -> type:
    """``cls`` with :class:`AnchorLayerMixin` in front, made once per class and findable by pickle."""
    if issubclass(cls, AnchorLayerMixin):
        return cls
    if cls not in _ANCHOR_CLASSES:
        name = f"TimeAnchored{cls.__name__}"
        made = type(name, (AnchorLayerMixin, cls), {"__module__": __name__, "__qualname__": name})
        _ANCHOR_CLASSES[cls] = made
        setattr(sys.modules[__name__], name, made)
    return _ANCHOR_CLASSES[cls]


def install_layer_cache(layers: Sequence[nn.Module], cache: LayerStackCache) -> LayerStackCache:
    """Make the anchor layers ``[s, a)`` of ``layers`` consult ``cache`` during marked passes (in place).

    Raises a one-line ValueError when the split does not fit the stack.
    """
    split = cache.split
    if split.total != len(layers):
        raise ValueError(f"split {split.shared} / {split.anchor} / {split.denoiser} covers {split.total} layers, but "
                         f"the stack has {len(layers)}")
    for index in range(cache.shared_end, cache.anchor_end):
        layer = layers[index]
        layer.__class__ = _anchor_class(type(layer))
        layer.__dict__["_tadm_layer_cache"] = cache
        layer.__dict__["_tadm_layer_index"] = index
    return cache


def remove_layer_cache(layers: Sequence[nn.Module]) -> None:
    """Undo :func:`install_layer_cache`: every layer gets its original class back."""
    for layer in layers:
        if isinstance(layer, AnchorLayerMixin):
            layer.__class__ = type(layer).__mro__[2]
            layer.__dict__.pop("_tadm_layer_cache", None)
            layer.__dict__.pop("_tadm_layer_index", None)
