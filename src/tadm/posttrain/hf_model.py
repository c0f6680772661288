"""DiffusionGemma with a time-anchored fusion, used like the ``transformers`` model it wraps.

:class:`TimeAnchoredDiffusionGemma` loads a ``DiffusionGemmaForBlockDiffusion`` as that class
loads itself (``dtype``, ``device_map``, ... go to its own ``from_pretrained``), attaches a
TADM:Post-train fusion adapter (a directory or a Hub id) and generates with ``generate`` like
the base: same arguments, same generation config, same return type. Generation is Algorithm 2
(entropy-bound sampling) inside Algorithm 1 (the anchor layers run only at refresh steps,
``(T - i) mod K == 0``; in between the fusion corrects the cached anchor, Eq.
(stale-anchor-fusion-app)), run by :func:`tadm.posttrain.generate_blocks`::

    model = TimeAnchoredDiffusionGemma.from_pretrained(
        "google/diffusiongemma-26B-A4B-it", adapter="org/tadm-adapter", refresh_interval=2, dtype=torch.bfloat16)
    out = model.generate(**inputs, max_new_tokens=512)       # a DiffusionGemmaGenerationOutput
    model.save_pretrained("my-adapter")                      # the adapter only, with a model card
    model.push_to_hub("me/my-adapter")

At ``K = 1`` the anchor is fresh at every step, the fusion is the identity, and ``generate``
returns the base model's own tokens (same seed, same generation config). The base's generation
config is honoured: ``max_new_tokens`` / ``max_length``, ``max_denoising_steps`` (T),
``sampler_config.entropy_bound``, the temperature schedule ``t_min``/``t_max``, adaptive stopping
(``stability_threshold`` / ``confidence_threshold``), ``eos_token_id``/``pad_token_id`` and
``return_dict_in_generate``. What the base accepts but this loop cannot honour is refused with a
ValueError rather than ignored: streamers, ``past_key_values`` (continuing a cached conversation),
custom ``logits_processor`` / ``stopping_criteria``, cache implementations other than the dynamic
one, image inputs and any other model keyword (``decoder_input_ids``, ...).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tadm.hf import NO_CUSTOM_CODE, first_line, hub_reachable, is_repo_id
from tadm.posttrain.adapter_io import (ADAPTER_CONFIG_NAME, AdapterConfig, CardResults, attach_adapter,
                                       load_adapter_config, push_adapter_to_hub, resolve_adapter,
                                       save_adapter_pretrained)
from tadm.posttrain.backbone import DiffusionGemmaBackbone, load_diffusion_gemma
from tadm.posttrain.generate import BlockGenerationOutput, generate_blocks
from tadm.posttrain.model import AnchoredBackbone, SplitSpec
from tadm.sampling.anchor_cache import check_refresh_interval
from tadm.sampling.entropy_bound import EntropyBoundSampler, StableConfidentStopping
from tadm.sampling.refresh import FixedRefresh, RefreshPolicy, parse_refresh

__all__ = ["TimeAnchoredDiffusionGemma", "resolve_refresh"]

_TEXT_ONLY_KEYS = ("token_type_ids", "mm_token_type_ids")  # all zero for text: nothing to honour
_IMAGE_KEYS = ("pixel_values", "image_position_ids")


def resolve_refresh(refresh_interval: Any = None, refresh_policy: Any = None) -> RefreshPolicy | None:
    """The refresh policy of ``refresh_interval`` (K, an integer >= 1) or ``refresh_policy`` (any spec
    :func:`tadm.sampling.refresh.parse_refresh` reads: ``2``, ``"fixed:K=2"``, ``"adaptive:tau=0.3"``, a
    mapping or a policy); None when neither is given. A bad value is a one-line ValueError naming it."""
    if refresh_interval is not None and refresh_policy is not None:
        raise ValueError(f"give refresh_interval or refresh_policy, not both (got {refresh_interval!r} and "
                         f"{refresh_policy!r})")
    if refresh_interval is not None:
        return FixedRefresh(check_refresh_interval(refresh_interval))
    if refresh_policy is not None:
        return parse_refresh(refresh_policy)
    return None


def _adapter_directory(source: Any, adapter_kwargs: dict[str, Any]) -> Path | None:
    """The directory of the adapter ``source`` names (a directory or Hub id holding ``adapter_config.json``), else
    None (a loaded model, a base checkpoint, nothing fetchable)."""
    if isinstance(source, nn.Module):
        return None
    text = os.fspath(source)
    local = Path(text).expanduser()
    if not local.is_dir() and not is_repo_id(text):
        return None
    try:
        directory = resolve_adapter(text, **adapter_kwargs)
    except FileNotFoundError:
        return None
    return directory if (directory / ADAPTER_CONFIG_NAME).is_file() else None


def _load_base(base: Any, base_kwargs: dict[str, Any]) -> nn.Module:
    """A ``DiffusionGemmaForBlockDiffusion``: ``base`` itself, or loaded from a directory or Hub id by its own
    ``from_pretrained(base, **base_kwargs)`` (never running code shipped with the checkpoint)."""
    if isinstance(base, nn.Module):
        if base_kwargs:
            raise ValueError(f"loading options {sorted(base_kwargs)} apply only when base is a directory or Hub id, "
                             "not an already loaded model")
        return base
    if base_kwargs.pop("trust_remote_code", False):
        raise ValueError(NO_CUSTOM_CODE)
    return load_diffusion_gemma(os.fspath(base), **base_kwargs)


class TimeAnchoredDiffusionGemma(nn.Module):
    """A DiffusionGemma whose ``generate`` caches the anchor layers (Algorithm 1) and fuses the stale anchor.

    Build it with :meth:`from_pretrained`. ``config``, ``generation_config``, ``device`` and
    ``dtype`` are the base model's (``generation_config`` is the base's own object, so editing it
    edits the base's defaults). After each ``generate`` call, :attr:`last_generation` holds
    tadm's record of it: Transformer-layer calls per stage (``layer_calls``), encoder calls and
    the steps that refreshed the anchor.

    Args:
        model: the split base with its fusion (:class:`~tadm.posttrain.model.AnchoredBackbone` over a
            :class:`~tadm.posttrain.backbone.DiffusionGemmaBackbone`).
        refresh_policy: the default refresh policy (a spec or a policy; 1 = fresh anchor every step).
        adapter_config: the loaded adapter's config; None for a split base without an adapter, which
            then always runs naive reuse (the cached anchor read as is).
    """

    def __init__(
        self,
        model: AnchoredBackbone,
        *,
        refresh_policy: Any = 1,
        adapter_config: AdapterConfig | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model.backbone, DiffusionGemmaBackbone):
            raise TypeError(f"expected a split DiffusionGemma backbone, got {type(model.backbone).__name__}")
        self.anchored = model.eval()
        self.refresh_policy: RefreshPolicy = parse_refresh(refresh_policy)
        self.adapter_config = adapter_config
        self.fusion_mode = "paired" if adapter_config is not None else "naive"
        self.last_generation: BlockGenerationOutput | None = None

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls,
        base: str | os.PathLike[str] | nn.Module,
        adapter: str | os.PathLike[str] | None = None,
        *,
        refresh_interval: int | None = None,
        refresh_policy: Any = None,
        split: SplitSpec | tuple[int, int] | None = None,
        adapter_kwargs: dict[str, Any] | None = None,
        **base_kwargs: Any,
    ) -> TimeAnchoredDiffusionGemma:
        """Load the base and attach the adapter.

        Args:
            base: a directory or Hub id of a ``DiffusionGemmaForBlockDiffusion`` checkpoint, or a loaded one
                (used as is; it is frozen and put in eval mode).
            adapter: a directory or Hub id of a tadm fusion adapter (resolved through the local Hub cache
                when offline). Without one, ``split`` must be given: the base is split (shared, anchor
                layers) with no fusion, and every K > 1 runs naive reuse. Without either, ``base`` may be
                the adapter itself: the base its ``adapter_config.json`` records is loaded (as PEFT's
                ``AutoPeftModel`` does), and a recorded base that cannot be loaded here is a one-line error
                saying to pass the base; otherwise a ValueError.
            refresh_interval, refresh_policy: the default K (or policy) of :meth:`generate` (default K = 1).
            split: (shared, anchor) layer counts or a :class:`SplitSpec`, only without an adapter.
            adapter_kwargs: ``revision``, ``cache_dir``, ``token``, ``local_files_only`` for a Hub adapter.
            **base_kwargs: passed to ``DiffusionGemmaForBlockDiffusion.from_pretrained`` (``dtype``,
                ``device_map``, ``revision``, ...). The fusion is put on the device of the base's first
                parameter (one device; a base spread over several devices is not supported).
        """
        policy = resolve_refresh(refresh_interval, refresh_policy) or FixedRefresh(1)
        if adapter is not None and split is not None:
            raise ValueError("give an adapter or a split, not both: an adapter fixes its own split")
        recorded_by = None  # the adapter given as ``base``, whose recorded base is loaded
        if adapter is None and split is None:
            found = _adapter_directory(base, adapter_kwargs or {})
            if found is None:
                raise ValueError("no adapter given: pass adapter=DIR_OR_HUB_ID, or split=(shared, anchor) layer "
                                 "counts to run the base split with naive reuse of the cached anchor (no fusion)")
            recorded_by, adapter, adapter_kwargs = os.fspath(base), found, None
            base = load_adapter_config(found).base_model
            if not Path(base).expanduser().is_dir() and not hub_reachable():
                # a relative path recorded elsewhere reads like a Hub id: fail at once, not after the client's retries
                base_kwargs.setdefault("local_files_only", True)
        if split is not None and not isinstance(split, SplitSpec) and (
                not isinstance(split, (tuple, list)) or len(split) not in (2, 3)):
            raise ValueError(f"split must be (shared, anchor) layer counts, e.g. split=(2, 20), or a SplitSpec; "
                             f"got {split!r}")
        try:
            backbone = DiffusionGemmaBackbone(_load_base(base, dict(base_kwargs)))
        except (OSError, ValueError) as err:
            if recorded_by is None:
                raise
            error = ValueError if isinstance(err, ValueError) else FileNotFoundError
            raise error(f"adapter {recorded_by!r} records its base model as {base!r}, which cannot be loaded here "
                        f"({first_line(err)}); pass the base: TimeAnchoredDiffusionGemma.from_pretrained(BASE_DIR_OR_"
                        f"HUB_ID, adapter={recorded_by!r})") from None
        if adapter is not None:
            directory = resolve_adapter(adapter, **(adapter_kwargs or {}))
            config: AdapterConfig | None = load_adapter_config(directory)
            if config.backbone != "diffusion-gemma":
                raise ValueError(f"adapter {os.fspath(adapter)!r} was trained on a {config.backbone!r} backbone, "
                                 "not 'diffusion-gemma'")
            model = attach_adapter(backbone, directory)
        else:
            config = None
            spec = split if isinstance(split, SplitSpec) else SplitSpec(*split)
            model = AnchoredBackbone(backbone, spec, fusion_mode="naive").to(backbone.device)
        return cls(model, refresh_policy=policy, adapter_config=config)

    # ---------------------------------------------------------------- what a transformers model exposes
    @property
    def base_model(self) -> nn.Module:
        """The wrapped ``DiffusionGemmaForBlockDiffusion``."""
        return self.anchored.backbone.model

    @property
    def config(self) -> Any:
        return self.base_model.config

    @property
    def generation_config(self) -> Any:
        return self.base_model.generation_config

    @generation_config.setter
    def generation_config(self, value: Any) -> None:
        self.base_model.generation_config = value

    @property
    def device(self) -> torch.device:
        return self.anchored.backbone.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchored.backbone.dtype

    @property
    def name_or_path(self) -> str:
        return str(getattr(self.base_model, "name_or_path", ""))

    def can_generate(self) -> bool:
        return True

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters of the base and the fusion, as ``PreTrainedModel.num_parameters`` counts them.

        ``only_trainable``: the fusion's only (the base is frozen). ``exclude_embeddings``: without the
        weights of ``nn.Embedding`` modules (a tied output head shares the input embedding's weight).
        """
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding) and exclude_embeddings}
        return sum(p.numel() for p in self.parameters()
                   if (p.requires_grad or not only_trainable) and id(p) not in embeddings)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One denoising pass of the base model: with a fresh anchor the fusion is the identity."""
        return self.base_model(*args, **kwargs)

    # ---------------------------------------------------------------- generation
    def _sampling(self, config: Any) -> tuple[EntropyBoundSampler, StableConfidentStopping | None]:
        """Algorithm 2's sampler and the adaptive stopping that ``config`` asks the base for."""
        temperatures = (config.t_min, config.t_max)
        if None in temperatures:  # the base then scales logits by nothing, i.e. by 1
            temperatures = (1.0, 1.0)
        sampler = EntropyBoundSampler(
            self.anchored.vocab_size, entropy_bound=config.sampler_config.entropy_bound,
            temperature_min=temperatures[0], temperature_max=temperatures[1], num_steps=config.max_denoising_steps,
        )
        stopping = None
        if config.stability_threshold is not None and config.confidence_threshold is not None:
            stopping = StableConfidentStopping(config.stability_threshold, config.confidence_threshold)
        return sampler, stopping

    @staticmethod
    def _prompt_mask(model_kwargs: dict[str, Any]) -> Tensor | None:
        """The prompt's attention mask; every other model keyword is refused by name."""
        mask = model_kwargs.pop("attention_mask", None)
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"attention_mask passed to generate must be 2-D (B, P), got shape {tuple(mask.shape)}")
        images = sorted(k for k in model_kwargs if k in _IMAGE_KEYS)
        if images:
            raise ValueError(f"image inputs ({', '.join(images)}) are not supported by the time-anchored generate; "
                             "pass text only")
        for key in _TEXT_ONLY_KEYS:
            value = model_kwargs.pop(key, None)
            if value is not None and bool(torch.as_tensor(value).ne(0).any()):
                raise ValueError(f"{key} marks non-text tokens; the time-anchored generate takes text only")
        if model_kwargs:
            raise ValueError(f"generate got arguments it cannot honour: {', '.join(sorted(model_kwargs))} "
                             "(neither generation-config fields nor attention_mask)")
        return mask

    @torch.no_grad()
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
        naive: bool = False,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> Any:
        """Generate after ``input_ids`` (B, P) as ``DiffusionGemmaForBlockDiffusion.generate`` does, caching the anchor.

        Arguments and generation-config fields are the base's (module docstring for what is honoured
        and what is refused); ``kwargs`` override fields of ``generation_config``, which overrides the
        model's. tadm's own arguments:

        Args:
            refresh_interval: K >= 1 for this call (default: the model's, set at :meth:`from_pretrained`).
            refresh_policy: a refresh policy or spec (``"adaptive:tau=0.3"``) instead of K.
            naive: naive reuse for comparison: the fusion is bypassed and the stale anchor read as is.
            generator: source of randomness (None: torch's global generator, as the base uses).

        Returns:
            A ``DiffusionGemmaGenerationOutput`` (``sequences`` (B, P + n), ``tokens_per_forward`` (B,);
            ``past_key_values`` is None), or the sequences tensor when ``return_dict_in_generate`` is False.
        """
        # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
            DiffusionGemmaGenerationOutput,
        )

        policy = resolve_refresh(refresh_interval, refresh_policy) or self.refresh_policy
        for name, value, hint in (("streamer", streamer, "decode the returned sequences"),
                                  ("past_key_values", past_key_values, "pass the whole conversation as input_ids")):
            if value is not None:
                raise ValueError(f"{name} is not supported by the time-anchored generate; {hint}")
        for name, value in (("logits_processor", logits_processor), ("stopping_criteria", stopping_criteria)):
            if value:
                raise ValueError(f"a custom {name} is not supported by the time-anchored generate")
        if input_ids is None:
            raise ValueError("generate needs input_ids (B, P), e.g. **tokenizer(text, return_tensors='pt')")
        if (not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point()
                or input_ids.is_complex() or input_ids.dtype == torch.bool):  # any integer dtype, as the base takes
            got = f"shape {tuple(input_ids.shape)}, {input_ids.dtype}" if isinstance(input_ids, Tensor) else (
                type(input_ids).__name__)
            raise ValueError(f"input_ids must be a (B, P) tensor of token ids, got {got}; a single prompt is "
                             "input_ids[None] or tokenizer(text, return_tensors='pt')")
        base = self.base_model
        # The base's own rules merge kwargs > generation_config > the model's config > its defaults, and
        # turn max_length into a token budget, so that K = 1 reproduces its generate.
        config, model_kwargs = base._prepare_generation_config(generation_config, **kwargs)
        mask = self._prompt_mask(model_kwargs)
        if config.cache_implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation {config.cache_implementation!r} is not supported by the "
                             "time-anchored generate; valid: None or 'dynamic'")
        P = input_ids.shape[1]
        max_length, max_new_tokens = base._prepare_generated_length(config, P)
        if max_new_tokens < 1:
            raise ValueError(f"max_length {max_length} leaves no tokens to generate after a prompt of {P} tokens")
        limit = config.max_length

        def reached_max_length(new: Tensor) -> Tensor:  # the base's MaxLengthCriteria when max_new_tokens wins
            return torch.full((new.shape[0],), P + new.shape[1] >= limit, dtype=torch.bool, device=new.device)

        stop = reached_max_length if limit is not None and P + max_new_tokens > limit else None
        sampler, stopping = self._sampling(config)
        previous = self.anchored.fusion_mode
        self.anchored.fusion_mode = "naive" if naive else self.fusion_mode
        try:
            out = generate_blocks(
                self.anchored, input_ids, sampler=sampler, policy=policy, max_new_tokens=max_new_tokens,
                attention_mask=mask, stopping=stopping, eos_token_id=config.eos_token_id,
                pad_token_id=config.pad_token_id, generator=generator, stop=stop,
            )
        finally:
            self.anchored.fusion_mode = previous
        self.last_generation = out
        if not config.return_dict_in_generate:
            return out.sequences
        new = out.new_tokens
        valid = new.shape[1] if config.pad_token_id is None else (new != config.pad_token_id).sum(dim=-1)
        return DiffusionGemmaGenerationOutput(sequences=out.sequences,
                                              tokens_per_forward=valid / out.decoder_forward_passes)

    # ---------------------------------------------------------------- saving and sharing the adapter
    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        is_main_process: bool = True,
        *,
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
    ) -> Path:
        """Save the adapter (not the base): ``adapter_config.json``, ``adapter_model.safetensors``, ``README.md``.

        ``card_results`` (rows such as ``{"K": 2, "accuracy": 0.61, "tokens/s": 63.5}`` or Markdown) go
        into the model card; ``base_model`` overrides the base recorded in the adapter (e.g. the Hub id
        of the base it was trained on from a local copy). As in ``transformers``: ``is_main_process``
        False writes nothing (the other ranks of a distributed run), and ``push_to_hub=True`` then
        uploads the folder to ``repo_id`` (default: the folder's name) with the Hub options
        (``private``, ``token``, ``revision``, ``commit_message``, ``commit_description``, ``create_pr``).
        """
        config = self.adapter_config
        if config is None:
            raise ValueError("this model has no adapter to save (it was built with a split and no fusion)")
        directory = Path(save_directory)
        if not is_main_process:
            return directory
        if push_to_hub and repo_id is None:
            repo_id = directory.resolve().name  # transformers' default: the folder's name
        directory = save_adapter_pretrained(
            directory, self.anchored, base_model=base_model or config.base_model, extra=config.extra,
            card_results=card_results, license=license, repo_id=repo_id,
        )
        if push_to_hub:
            push_adapter_to_hub(repo_id, directory, private=private, token=token, revision=revision,
                                commit_message=commit_message, commit_description=commit_description,
                                create_pr=create_pr)
        return directory

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        card_results: CardResults | None = None,
        license: str | None = None,
        base_model: str | None = None,
    ) -> Any:
        """Upload the adapter (:meth:`save_pretrained`'s three files) to ``repo_id``; returns the commit info.

        The Hub options are ``transformers``' ``push_to_hub``'s (keyword-only, as there); ``card_results``,
        ``license`` and ``base_model`` go to the model card as in :meth:`save_pretrained`.
        """
        with tempfile.TemporaryDirectory(prefix="tadm-adapter-") as folder:
            self.save_pretrained(folder, card_results=card_results, license=license, base_model=base_model,
                                 repo_id=repo_id)
            return push_adapter_to_hub(repo_id, folder, private=private, token=token, revision=revision,
                                       commit_message=commit_message, commit_description=commit_description,
                                       create_pr=create_pr)
