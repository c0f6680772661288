"""DiffusionGemma with the anchor cache inside its layer stack: a ``transformers`` model that runs Algorithm 1.

:class:`TimeAnchoredDiffusionGemma` *is* a ``DiffusionGemmaForBlockDiffusion`` (a subclass): the
decoder's anchor layers consult a :class:`~tadm.posttrain.layer_cache.LayerStackCache`, so every
loop that drives the model runs the cache: transformers' own ``generate`` (unchanged: its sampler,
stopping rules, streamers, logits processors and stopping criteria), diffusers'
``DiffusionGemmaPipeline``, or a user's loop calling ``forward``. The model keeps its own step count:
it is reset whenever the encoder runs (a new context, i.e. a new canvas) and at the start of
``generate``. A refresh pass runs every layer and caches the anchor; the other passes skip the
anchor layers and fuse the cached anchor with the current shallow state, Eq.
(stale-anchor-fusion-app). At ``K = 1`` every pass refreshes and the model is the base, token for
token::

    model = TimeAnchoredDiffusionGemma.from_pretrained(
        "google/diffusiongemma-26B-A4B-it", adapter="org/tadm-adapter", refresh_interval=2, dtype=torch.bfloat16)
    out = model.generate(**inputs, max_new_tokens=512)       # transformers' generate, with the cache
    model.last_generation.layer_calls                        # Transformer-layer calls actually made
    model.save_pretrained("my-adapter")                      # the adapter only, with a model card

The time-anchor settings (layer split, fusion size, refresh policy) live in ``config.time_anchor``;
a model built from a config (``TimeAnchoredDiffusionGemma(config)``) saves and loads whole like any
``transformers`` model, one loaded from a base checkpoint plus an adapter saves the adapter only
(PEFT's convention). The fusion is kept in float32 whatever the base's dtype.

Not supported (one-line errors): the compiled step (a static cache without ``disable_compile=True``)
at K > 1 and ``skip_unchanged`` refresh policies. Image inputs go to the encoder (the context), so they
work at every K.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from tadm.devices import resolve_dtype
from tadm.hf import NO_CUSTOM_CODE, first_line, hub_reachable, is_repo_id
from tadm.posttrain.adapter_io import (ADAPTER_CONFIG_NAME, AdapterConfig, CardResults, load_adapter_config,
                                       load_fusion_state, push_adapter_to_hub, resolve_adapter,
                                       save_adapter_pretrained)
from tadm.posttrain.backbone import DiffusionGemmaBackbone, check_base
from tadm.posttrain.layer_cache import (CacheRecord, LayerStackCache, check_policy, install_layer_cache,
                                       resolve_refresh)
from tadm.posttrain.model import AnchoredBackbone, FusionSpec, SplitSpec, default_fusion, default_split
from tadm.protocol import LayerSplit
from tadm.sampling.refresh import FixedRefresh, RefreshPolicy, parse_refresh

__all__ = ["TIME_ANCHOR_KEY", "TimeAnchorSettings", "TimeAnchoredDiffusionGemma", "default_fusion", "default_split",
           "load_time_anchored",
           "resolve_refresh"]

TIME_ANCHOR_KEY = "time_anchor"
"""The config attribute holding a time-anchored model's split, fusion size and refresh policy."""
_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder", "force_download", "proxies")


@dataclass(frozen=True)
class TimeAnchorSettings:
    """What ``config.time_anchor`` records: the split, the fusion's size (None: no fusion) and the refresh policy."""

    split: LayerSplit
    fusion: FusionSpec | None
    refresh_policy: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"shared_layers": self.split.shared, "anchor_layers": self.split.anchor,
                "denoiser_layers": self.split.denoiser,
                "fusion": None if self.fusion is None else asdict(self.fusion), "refresh_policy": self.refresh_policy}

    @classmethod
    def from_dict(cls, payload: Any, num_layers: int) -> TimeAnchorSettings:
        """Read ``config.time_anchor``; a malformed value is a one-line ValueError naming the key."""
        if not isinstance(payload, dict):
            raise ValueError(f"config.{TIME_ANCHOR_KEY} must be a mapping, got {payload!r}")
        unknown = sorted(set(payload) - {"shared_layers", "anchor_layers", "denoiser_layers", "fusion",
                                         "refresh_policy"})
        if unknown:
            raise ValueError(f"config.{TIME_ANCHOR_KEY} has unknown keys {unknown}")
        split = SplitSpec(payload.get("shared_layers", 0), payload.get("anchor_layers", 0),
                          payload.get("denoiser_layers")).resolve(num_layers)
        fusion = payload.get("fusion")
        if fusion is not None:
            if not isinstance(fusion, dict) or set(fusion) - {"rank", "num_heads", "eps", "gate_bias"}:
                raise ValueError(f"config.{TIME_ANCHOR_KEY}.fusion must be a mapping of rank, num_heads, eps and "
                                 f"gate_bias, got {fusion!r}")
            fusion = FusionSpec(**fusion)
        policy = check_policy(payload.get("refresh_policy", 1))
        return cls(split, fusion, policy.config())


def _settings(config: Any, split: Any = None, fusion: Any = None, refresh: RefreshPolicy | None = None) -> \
        TimeAnchorSettings:
    """Settings from explicit arguments over ``config.time_anchor`` over the defaults (the paper's split, a
    default fusion, K = 1)."""
    num_layers = int(config.text_config.num_hidden_layers)
    recorded = getattr(config, TIME_ANCHOR_KEY, None)
    base = TimeAnchorSettings.from_dict(recorded, num_layers) if recorded is not None else TimeAnchorSettings(
        default_split(num_layers).resolve(num_layers), default_fusion(int(config.text_config.hidden_size)),
        FixedRefresh(1).config())
    if split is not None:
        spec = split if isinstance(split, SplitSpec) else _split_spec(split)
        base = TimeAnchorSettings(spec.resolve(num_layers), base.fusion, base.refresh_policy)
    if fusion is not None:
        base = TimeAnchorSettings(base.split, None if fusion is False else fusion, base.refresh_policy)
    if refresh is not None:
        base = TimeAnchorSettings(base.split, base.fusion, refresh.config())
    return base


def _split_spec(split: Any) -> SplitSpec:
    if isinstance(split, LayerSplit):
        return SplitSpec(split.shared, split.anchor, split.denoiser)
    if not isinstance(split, (tuple, list)) or len(split) not in (2, 3):
        raise ValueError(f"split must be (shared, anchor) layer counts, e.g. split=(2, 20), or a SplitSpec; "
                         f"got {split!r}")
    return SplitSpec(*split)


class _NewContext:
    """Encoder forward pre-hook: encoding context starts a new canvas (the anchor cache resets) and costs the
    encoder's layers."""

    def __init__(self, cache: LayerStackCache, num_layers: int) -> None:
        self.cache, self.num_layers = cache, num_layers

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.cache.reset()
        self.cache.record.encoder_layer_calls += self.num_layers


@contextlib.contextmanager
def _ignoring_missing(cls: type, patterns: list[str] | None) -> Iterator[None]:
    """``cls._keys_to_ignore_on_load_missing`` set to ``patterns`` for one load (when an adapter brings the fusion)."""
    if patterns is None:
        yield
        return
    before = cls.__dict__.get("_keys_to_ignore_on_load_missing", _UNSET)
    cls._keys_to_ignore_on_load_missing = patterns
    try:
        yield
    finally:
        if before is _UNSET:
            del cls._keys_to_ignore_on_load_missing
        else:
            cls._keys_to_ignore_on_load_missing = before


_UNSET = object()


@contextlib.contextmanager
def _drawing_from(generator: torch.Generator | None) -> Iterator[None]:
    """Let code that draws from torch's global generator draw from ``generator`` instead (and advance it)."""
    if generator is None:
        yield
        return
    device = generator.device
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        if cuda:
            torch.cuda.set_rng_state(generator.get_state(), device)
        else:
            torch.set_rng_state(generator.get_state())
        yield
        generator.set_state(torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state())


class TimeAnchoredDiffusionGemma(DiffusionGemmaForBlockDiffusion):
    """A ``DiffusionGemmaForBlockDiffusion`` whose decoder runs Algorithm 1 (module docstring).

    Args:
        config: a ``DiffusionGemmaConfig``; its ``time_anchor`` entry (if any) gives the split, the fusion
            size and the refresh policy, else the paper's split scaled to the layer count, a default fusion
            (rank 256, 4 heads) and K = 1.
        split: (shared, anchor[, denoiser]) layer counts or a :class:`SplitSpec`, over the config's.
        fusion: a :class:`FusionSpec`, or False for no fusion (naive reuse only), over the config's.
        refresh_interval, refresh_policy: the default refresh policy of every pass (K = 1: the base model).

    Attributes:
        fusion: the paired-attention fusion (trainable; the base is frozen when loaded with an adapter).
        anchor_cache: the :class:`LayerStackCache` (policy, cached anchor, layer-call record).
        last_generation: the :class:`CacheRecord` of the last :meth:`generate` (layer calls, refresh steps).
        adapter_config: the adapter's :class:`AdapterConfig` when one was loaded.
    """

    _keep_in_fp32_modules_strict = ["fusion"]  # float32 whatever dtype the base loads in (fp16 and bf16 alike)

    def __init__(self, config: DiffusionGemmaConfig, *, split: Any = None, fusion: FusionSpec | bool | None = None,
                 refresh_interval: int | None = None, refresh_policy: Any = None) -> None:
        super().__init__(config)
        self._install(_settings(config, split, fusion, resolve_refresh(refresh_interval, refresh_policy)))

    def _install(self, settings: TimeAnchorSettings) -> None:
        """Put the fusion and the anchor cache into this model (also used to convert a loaded base in place)."""
        setattr(self.config, TIME_ANCHOR_KEY, settings.to_dict())
        hidden = int(self.config.text_config.hidden_size)
        self.fusion = None if settings.fusion is None else settings.fusion.build(hidden).to(
            device=self.model.decoder.embed_tokens.weight.device, dtype=torch.float32)
        self.anchor_cache = LayerStackCache(settings.split, self.fusion, settings.refresh_policy,
                                            num_steps=getattr(self.generation_config, "max_denoising_steps", None))
        install_layer_cache(self.model.decoder.layers, self.anchor_cache)
        self.model.encoder.register_forward_pre_hook(_NewContext(self.anchor_cache, settings.split.total))
        self.last_generation: CacheRecord | None = None
        self.adapter_config: AdapterConfig | None = None
        self._adapter_only = False  # save_pretrained writes the adapter only (the base lives elsewhere)
        self._self_conditioning = True

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """As the base: transformers reads the source of a class's module to decide, and this module is tadm's."""
        return DiffusionGemmaForBlockDiffusion._can_set_attn_implementation()

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """As the base (see :meth:`_can_set_attn_implementation`)."""
        return DiffusionGemmaForBlockDiffusion._can_set_experts_implementation()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The fusion initialises itself (zero up-projection, gate bias); the rest as DiffusionGemma does."""
        fusion = self.__dict__.get("_modules", {}).get("fusion")
        if fusion is not None and any(module is m for m in fusion.modules()):
            if module is fusion:
                fusion.reset_parameters()
            return
        super()._init_weights(module)

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str] | nn.Module,
        *model_args: Any,
        adapter: str | os.PathLike[str] | None = None,
        refresh_interval: int | None = None,
        refresh_policy: Any = None,
        split: Any = None,
        fusion: FusionSpec | None = None,
        naive: bool = False,
        adapter_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Load a base (or a whole time-anchored checkpoint) as ``transformers`` does, and attach an adapter.

        Args:
            pretrained_model_name_or_path: a directory or Hub id of a DiffusionGemma checkpoint; a loaded
                ``DiffusionGemmaForBlockDiffusion`` (converted in place, as PEFT's ``get_peft_model`` does);
                or a tadm adapter, whose recorded base is loaded (as PEFT's ``AutoPeftModel``).
            adapter: a directory or Hub id of a tadm fusion adapter.
            refresh_interval, refresh_policy: the default policy (default: the adapter's saved one, else K = 1).
            split: (shared, anchor) layer counts without an adapter: the base split with no fusion (naive reuse).
            fusion: with ``split``, a new fusion of this size (initialised as the identity, e.g. to post-train it).
            naive: read the stale anchor as is (the fusion is bypassed), for comparison.
            adapter_kwargs: ``revision``, ``cache_dir``, ``token``, ``local_files_only`` for a Hub adapter.
            **kwargs: ``transformers``' own ``from_pretrained`` options (``dtype``, ``device_map``,
                ``attn_implementation``, ``output_loading_info``, ``config``, ``revision``, ...).
                ``trust_remote_code=True`` is refused.
        """
        policy = resolve_refresh(refresh_interval, refresh_policy)
        if kwargs.pop("trust_remote_code", False):
            raise ValueError(NO_CUSTOM_CODE)
        if adapter is not None and split is not None:
            raise ValueError("give an adapter or a split, not both: an adapter fixes its own split")
        if fusion is not None and split is None:
            raise ValueError("a new fusion needs split=(shared, anchor) layer counts; an adapter brings its own fusion")
        if isinstance(pretrained_model_name_or_path, nn.Module):
            return cls._from_loaded(pretrained_model_name_or_path, adapter, split, fusion, policy, naive,
                                    adapter_kwargs, kwargs)
        if pretrained_model_name_or_path is None:  # transformers' config= (+ state_dict=) construction
            if kwargs.get("config") is None:
                raise ValueError("from_pretrained(None, ...) needs config= (and state_dict= for the weights)")
            config = copy.deepcopy(kwargs.pop("config"))
            setattr(config, TIME_ANCHOR_KEY, _settings(config, split, fusion, policy).to_dict())
            loaded = super().from_pretrained(None, *model_args, config=config, **kwargs)
            model = loaded[0] if kwargs.get("output_loading_info") else loaded
            if naive:
                model.anchor_cache.set_mode("naive")
            return loaded
        source = os.fspath(pretrained_model_name_or_path)
        recorded_by = None
        if adapter is None and split is None and not _is_checkpoint(source):
            found = _adapter_directory(source, adapter_kwargs or {})
            if found is not None:
                recorded_by, adapter, adapter_kwargs = source, found, None
                source = load_adapter_config(found).base_model
                if not Path(source).expanduser().is_dir() and not hub_reachable():
                    kwargs.setdefault("local_files_only", True)  # a relative path recorded elsewhere: fail at once
        adapter_dir, adapter_config = _read_adapter(adapter, adapter_kwargs)
        try:
            config = kwargs.pop("config", None) or _load_config(source, kwargs)
        except (OSError, ValueError) as err:
            if recorded_by is None:
                raise
            raise (ValueError if isinstance(err, ValueError) else FileNotFoundError)(
                f"adapter {recorded_by!r} records its base model as {source!r}, which cannot be loaded here "
                f"({first_line(err)}); pass the base: TimeAnchoredDiffusionGemma.from_pretrained(BASE_DIR_OR_HUB_ID, "
                f"adapter={recorded_by!r})") from None
        config = copy.deepcopy(config)
        separate = adapter_config is not None or split is not None or getattr(config, TIME_ANCHOR_KEY, None) is None
        if adapter_config is not None:
            _check_fits(adapter_config, config, adapter_dir)
            saved = adapter_config.refresh_policy
            settings = _settings(config, adapter_config.split, adapter_config.fusion,
                                 policy or (parse_refresh(saved) if saved is not None else FixedRefresh(1)))
        elif split is not None:
            settings = _settings(config, split, fusion or False, policy or FixedRefresh(1))
        elif getattr(config, TIME_ANCHOR_KEY, None) is not None:
            settings = _settings(config, refresh=policy)
        else:
            raise ValueError("no adapter given: pass adapter=DIR_OR_HUB_ID, or split=(shared, anchor) layer counts "
                             "to run the base split with naive reuse of the cached anchor (no fusion)")
        setattr(config, TIME_ANCHOR_KEY, settings.to_dict())
        # A base checkpoint holds no fusion: not reported missing when an adapter brings it or a new one was asked
        # for (fusion=); a whole checkpoint that lacks it is reported, as transformers reports any missing weight.
        ignore = [r"^fusion\."] if adapter_dir is not None or fusion is not None else None
        try:
            with _ignoring_missing(cls, ignore):
                loaded = super().from_pretrained(source, *model_args, config=config, **kwargs)
        except OSError as err:
            raise FileNotFoundError(f"could not load base model {source!r}: {first_line(err)}") from None
        model, info = loaded if kwargs.get("output_loading_info") else (loaded, None)
        model._finish_loading(adapter_dir, adapter_config, separate=separate, naive=naive)
        return (model, info) if info is not None else model

    @classmethod
    def _from_loaded(cls, base: nn.Module, adapter: Any, split: Any, fusion: FusionSpec | None,
                     policy: RefreshPolicy | None, naive: bool, adapter_kwargs: dict[str, Any] | None,
                     kwargs: dict[str, Any]) -> TimeAnchoredDiffusionGemma:
        if kwargs:
            raise ValueError(f"loading options {sorted(kwargs)} apply only when the base is a directory or Hub id, "
                             "not an already loaded model")
        if not isinstance(base, DiffusionGemmaForBlockDiffusion):
            raise TypeError(f"expected a DiffusionGemmaForBlockDiffusion, got {type(base).__name__}")
        if isinstance(base, TimeAnchoredDiffusionGemma):
            raise ValueError("this model is time-anchored already; load its base again to attach another adapter")
        adapter_dir, adapter_config = _read_adapter(adapter, adapter_kwargs)
        if adapter_config is not None:
            _check_fits(adapter_config, base.config, adapter_dir)
            saved = adapter_config.refresh_policy
            settings = _settings(base.config, adapter_config.split, adapter_config.fusion,
                                 policy or (parse_refresh(saved) if saved is not None else FixedRefresh(1)))
        elif split is not None:
            settings = _settings(base.config, split, fusion or False, policy or FixedRefresh(1))
        else:
            raise ValueError("no adapter given: pass adapter=DIR_OR_HUB_ID, or split=(shared, anchor) layer counts "
                             "to run the base split with naive reuse of the cached anchor (no fusion)")
        base.__class__ = cls
        base._install(settings)
        base._finish_loading(adapter_dir, adapter_config, separate=True, naive=naive)
        return base

    def _finish_loading(self, adapter_dir: Path | None, adapter_config: AdapterConfig | None, *, separate: bool,
                        naive: bool) -> None:
        if separate and self.fusion is not None:
            # a base checkpoint holds no fusion: draw it as its constructor does (transformers builds the model
            # without initialising it), so that a seeded run gets the same fusion as PairedAttentionFusion(...)
            with torch.no_grad():
                self.fusion.reset_parameters()
        if adapter_dir is not None:
            self.load_adapter(adapter_dir, adapter_config)
        if separate:  # a base with a fusion on top: the base is frozen, only the fusion trains
            self.requires_grad_(False)
            if self.fusion is not None:
                self.fusion.requires_grad_(True)
        self._adapter_only = separate
        if naive:
            self.anchor_cache.set_mode("naive")
        self.eval()

    def load_adapter(self, directory: str | os.PathLike[str], config: AdapterConfig | None = None) -> None:
        """Load a tadm adapter's fusion weights (strict, shape-checked) into :attr:`fusion`."""
        directory = resolve_adapter(directory)
        config = config or load_adapter_config(directory)
        _check_fits(config, self.config, directory)
        if self.fusion is None:
            raise ValueError("this model was built without a fusion; load it with the adapter instead")
        load_fusion_state(self.fusion, directory)
        self.adapter_config = config

    # ---------------------------------------------------------------- the cache
    @property
    def refresh_policy(self) -> RefreshPolicy:
        """The default refresh policy of every pass."""
        return self.anchor_cache.policy

    @refresh_policy.setter
    def refresh_policy(self, spec: Any) -> None:
        self.anchor_cache.policy = check_policy(spec)
        getattr(self.config, TIME_ANCHOR_KEY)["refresh_policy"] = self.anchor_cache.policy.config()

    @property
    def layer_split(self) -> LayerSplit:
        return self.anchor_cache.split

    def reset_anchor_cache(self) -> None:
        """Forget the cached anchor and the step count (the encoder does it whenever it runs)."""
        self.anchor_cache.reset()

    def stage_view(self) -> AnchoredBackbone:
        """This model stage by stage (:class:`AnchoredBackbone`), sharing its layers and :attr:`fusion`: what the
        post-training rollouts and loss run. The base is frozen; the fusion is what trains."""
        if self.fusion is None:
            raise ValueError("this model has no fusion to train (it was split without one)")
        split = self.anchor_cache.split
        view = AnchoredBackbone(DiffusionGemmaBackbone(self), SplitSpec(split.shared, split.anchor, split.denoiser),
                                self.fusion, fusion_mode=self.anchor_cache.mode)
        self.fusion.requires_grad_(True)
        return view

    def forward(self, input_ids: Tensor | None = None, attention_mask: Any = None, past_key_values: Any = None,
                position_ids: Tensor | None = None, decoder_input_ids: Tensor | None = None, *args: Any,
                **kwargs: Any) -> Any:
        """DiffusionGemma's forward, one denoising pass of Algorithm 1 (the anchor layers run at refresh passes
        only). Given ``input_ids``, the context is encoded first and the step count starts anew."""
        if not self._self_conditioning:
            kwargs.pop("self_conditioning_logits", None)
        cache = self.anchor_cache
        if cache.in_pass:  # marked by generate's denoising step
            return super().forward(input_ids, attention_mask, past_key_values, position_ids, decoder_input_ids,
                                   *args, **kwargs)
        if input_ids is not None:
            cache.reset()
        with cache.denoising_pass(decoder_input_ids):
            return super().forward(input_ids, attention_mask, past_key_values, position_ids, decoder_input_ids,
                                   *args, **kwargs)

    # ---------------------------------------------------------------- generation
    def _denoising_step(self, *args: Any, **kwargs: Any) -> Any:
        """The base's denoising step, marked as one pass with its reverse step index i."""
        with self.anchor_cache.denoising_pass(kwargs.get("current_canvas"), kwargs.get("cur_step")):
            return super()._denoising_step(*args, **kwargs)

    def generate(
        self,
        input_ids: Tensor | None = None,
        past_key_values: Any = None,
        streamer: Any = None,
        generation_config: Any = None,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        *,
        refresh_interval: int | None = None,
        refresh_policy: Any = None,
        naive: bool | None = None,
        generator: torch.Generator | None = None,
        canvas_length: int | None = None,
        self_conditioning: bool = True,
        **kwargs: Any,
    ) -> Any:
        """``DiffusionGemmaForBlockDiffusion.generate`` (its arguments, config and return type), run with the cache.

        tadm's own arguments:

        Args:
            refresh_interval: K >= 1 for this call (default: the model's :attr:`refresh_policy`).
            refresh_policy: a refresh policy or spec (``"adaptive:tau=0.3"``) instead of K.
            naive: naive reuse for this call: the fusion is bypassed and the stale anchor read as is.
            generator: draw the sampler's randomness from this generator instead of torch's global one (the
                generator advances as if it had drawn).
            canvas_length: tokens per canvas for this call (default: ``config.canvas_length``, 256 as released).
            self_conditioning: False feeds every pass a zero self-conditioning signal (an ablation; the base's
                generate always self-conditions).

        After the call, :attr:`last_generation` holds the layer calls and the steps that refreshed per canvas.
        """
        if input_ids is not None and (not isinstance(input_ids, Tensor) or input_ids.dim() != 2
                                      or input_ids.is_floating_point() or input_ids.is_complex()
                                      or input_ids.dtype == torch.bool):
            got = (f"shape {tuple(input_ids.shape)}, {input_ids.dtype}" if isinstance(input_ids, Tensor)
                   else type(input_ids).__name__)
            raise ValueError(f"input_ids must be a (B, P) tensor of token ids, got {got}; a single prompt is "
                             "input_ids[None] or tokenizer(text, return_tensors='pt')")
        if input_ids is None:
            raise ValueError("generate needs input_ids (B, P), e.g. **tokenizer(text, return_tensors='pt')")
        if canvas_length is not None and (isinstance(canvas_length, bool) or not isinstance(canvas_length, int)
                                          or canvas_length < 1):
            raise ValueError(f"canvas_length must be an integer >= 1, got {canvas_length!r}")
        cache = self.anchor_cache
        policy = resolve_refresh(refresh_interval, refresh_policy) or cache.policy
        previous = (cache.policy, cache.mode, self.config.canvas_length, self._self_conditioning)
        cache.policy = policy
        if naive is not None:
            cache.set_mode("naive" if naive else "paired")
        self.config.canvas_length = canvas_length or self.config.canvas_length
        self._self_conditioning = bool(self_conditioning)
        try:
            self._check_generate(generation_config, past_key_values, kwargs)
            cache.num_steps = None  # the denoising step gives i
            cache.start_record()
            with _drawing_from(generator):
                out = super().generate(input_ids.long(), past_key_values, streamer, generation_config,
                                       logits_processor, stopping_criteria, **kwargs)
            self.last_generation = cache.finish_record()
        finally:
            cache.policy, cache.mode, self.config.canvas_length, self._self_conditioning = previous
            cache.num_steps = getattr(self.generation_config, "max_denoising_steps", None)
        return out

    def _check_generate(self, generation_config: Any, past_key_values: Any, kwargs: dict[str, Any]) -> None:
        """Refuse, in one line, what the cache cannot run at the call's K (module docstring)."""
        if not self.anchor_cache.caches_anchor:
            return
        config = generation_config or self.generation_config
        implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        disabled = kwargs.get("disable_compile", getattr(config, "disable_compile", None))
        static = implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS or bool(
            getattr(past_key_values, "is_compileable", False))
        if static and not disabled:
            raise ValueError("the compiled denoising step (a static cache) runs only at K = 1 with the anchor cache; "
                             "pass disable_compile=True to use the static cache uncompiled")

    # ---------------------------------------------------------------- saving and sharing
    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        is_main_process: bool = True,
        *args: Any,
        adapter_only: bool | None = None,
        push_to_hub: bool = False,
        card_results: CardResults | None = None,
        license: str | None = None,
        base_model: str | None = None,
        repo_id: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        commit_message: str | None = None,
        commit_description: str | None = None,
        create_pr: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Save the adapter (a model loaded as base + adapter), or the whole model (one built from a config).

        ``adapter_only`` overrides the choice. The adapter is ``adapter_config.json`` (split, fusion size,
        refresh policy, base), ``adapter_model.safetensors`` and a model card ``README.md`` with
        ``card_results`` and ``license``; ``base_model`` overrides the recorded base. As in ``transformers``:
        ``is_main_process`` False writes nothing, and ``push_to_hub=True`` uploads the folder to ``repo_id``
        (default: the folder's name). A whole model is saved by ``transformers``' ``save_pretrained``
        (``kwargs`` go there), its ``config.json`` holding ``time_anchor``.
        """
        only = self._adapter_only if adapter_only is None else bool(adapter_only)
        if only and self.fusion is None:
            raise ValueError("this model has no adapter to save (it was split without a fusion)")
        hub = dict(private=private, token=token, revision=revision, commit_message=commit_message,
                   commit_description=commit_description, create_pr=create_pr)
        if not only:
            hub_kwargs = {k: v for k, v in {**hub, "repo_id": repo_id}.items() if v not in (None, False)}
            return super().save_pretrained(save_directory, is_main_process, *args, push_to_hub=push_to_hub,
                                           **hub_kwargs, **kwargs)
        if args or kwargs:
            raise ValueError(f"saving the adapter takes no transformers options ({sorted(kwargs) or args}); pass "
                             "adapter_only=False to save the whole model")
        directory = Path(save_directory)
        if not is_main_process:
            return directory
        if push_to_hub and repo_id is None:
            repo_id = directory.resolve().name  # transformers' default: the folder's name
        directory = save_adapter_pretrained(directory, self.stage_view(), base_model=base_model or self._base_name(),
                                            extra=dict(self.adapter_config.extra) if self.adapter_config else None,
                                            refresh_policy=self.anchor_cache.policy.config(),
                                            card_results=card_results, license=license, repo_id=repo_id)
        if push_to_hub:
            push_adapter_to_hub(repo_id, directory, **hub)
        return directory

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
                    private: bool | None = None, token: str | bool | None = None, revision: str | None = None,
                    create_pr: bool = False, card_results: CardResults | None = None, license: str | None = None,
                    base_model: str | None = None, adapter_only: bool | None = None, **kwargs: Any) -> Any:
        """Upload the adapter (or, for a whole model, the model) to ``repo_id``; returns the commit info."""
        only = self._adapter_only if adapter_only is None else bool(adapter_only)
        if not only:
            return super().push_to_hub(repo_id, commit_message=commit_message, private=private, token=token,
                                       revision=revision, create_pr=create_pr, **kwargs)
        with tempfile.TemporaryDirectory(prefix="tadm-adapter-") as folder:
            self.save_pretrained(folder, adapter_only=True, card_results=card_results, license=license,
                                 base_model=base_model, repo_id=repo_id)
            return push_adapter_to_hub(repo_id, folder, private=private, token=token, revision=revision,
                                       commit_message=commit_message, commit_description=commit_description,
                                       create_pr=create_pr)

    def _base_name(self) -> str:
        if self.adapter_config is not None:
            return self.adapter_config.base_model
        return str(getattr(self, "name_or_path", "") or getattr(self.config, "_name_or_path", "") or "unknown")


def load_time_anchored(
    base: str | os.PathLike[str] | nn.Module,
    *,
    adapter: str | os.PathLike[str] | None = None,
    split: Any = None,
    fusion: FusionSpec | None = None,
    naive: bool = False,
    refresh: Any = None,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
) -> tuple[TimeAnchoredDiffusionGemma, str | None]:
    """:meth:`TimeAnchoredDiffusionGemma.from_pretrained` on ``device`` with a dtype name (``auto``: bf16 on a GPU,
    fp32 on the CPU), as tadm's commands load a base. Without an adapter or a split the paper's split of 30
    layers (2 / 20) is used with naive reuse. Returns the model and a note when the adapter was trained on a
    base of another name (else None)."""
    device = torch.device(device)
    if adapter is not None and split is not None:
        raise ValueError("give an adapter or a split, not both: an adapter fixes its own split")
    if adapter is None and split is None:
        split = SplitSpec()
    note = None
    if adapter is not None:
        recorded = load_adapter_config(resolve_adapter(adapter)).base_model
        if not isinstance(base, nn.Module) and Path(recorded).name != Path(os.fspath(base)).name:
            note = f"adapter was trained on {recorded!r}, sampling on {os.fspath(base)!r}"
    options: dict[str, Any] = {}
    if not isinstance(base, nn.Module):
        options["dtype"] = resolve_dtype(dtype, device)
        if device.type != "cpu":
            options["device_map"] = str(device)  # load straight onto the GPU
    model = TimeAnchoredDiffusionGemma.from_pretrained(base, adapter=adapter, split=split, fusion=fusion, naive=naive,
                                                       refresh_policy=refresh, **options)
    return model.to(device), note


# The forward takes exactly the base's arguments: transformers (and its tests) read them from the signature, e.g. to
# find out that ``output_attentions`` is accepted.
TimeAnchoredDiffusionGemma.forward.__signature__ = inspect.signature(DiffusionGemmaForBlockDiffusion.forward)


# ------------------------------------------------------------------------------------------ helpers
def _is_checkpoint(source: str) -> bool:
    """A local directory with a model ``config.json`` (a base or a whole time-anchored model)."""
    return (Path(source).expanduser() / "config.json").is_file()


def _adapter_directory(source: str, adapter_kwargs: dict[str, Any]) -> Path | None:
    """The directory of the adapter ``source`` names (a directory or Hub id holding ``adapter_config.json``), else None."""
    local = Path(source).expanduser()
    if not local.is_dir() and not is_repo_id(source):
        return None
    try:
        directory = resolve_adapter(source, **adapter_kwargs)
    except FileNotFoundError:
        return None
    return directory if (directory / ADAPTER_CONFIG_NAME).is_file() else None


def _read_adapter(adapter: Any, adapter_kwargs: dict[str, Any] | None) -> tuple[Path | None, AdapterConfig | None]:
    if adapter is None:
        return None, None
    directory = resolve_adapter(adapter, **(adapter_kwargs or {}))
    config = load_adapter_config(directory)
    if config.backbone != "diffusion-gemma":
        raise ValueError(f"adapter {os.fspath(adapter)!r} was trained on a {config.backbone!r} backbone, "
                         "not 'diffusion-gemma'")
    return directory, config


def _check_fits(adapter: AdapterConfig, config: Any, directory: Any) -> None:
    """One line when the adapter was trained on a base of another shape (layer count, hidden size)."""
    text = config.text_config
    found = (int(text.num_hidden_layers), int(text.hidden_size))
    if found != (adapter.num_layers, adapter.hidden_size):
        raise ValueError(f"adapter {directory} was trained on a {adapter.num_layers}-layer base of hidden size "
                         f"{adapter.hidden_size} ({adapter.base_model}); this base has {found[0]} layers of size "
                         f"{found[1]}")


def _load_config(source: str, kwargs: dict[str, Any]) -> DiffusionGemmaConfig:
    """The checkpoint's ``DiffusionGemmaConfig``, after refusing a directory that needs custom code or is of
    another model type (one line)."""
    check_base(source, model_type="diffusion_gemma")
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    try:
        return DiffusionGemmaConfig.from_pretrained(source, **hub)
    except OSError as err:
        raise FileNotFoundError(f"could not load base model {source!r}: {first_line(err)}") from None

