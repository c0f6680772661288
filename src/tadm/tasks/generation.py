"""Prompted generation for task evaluation: one interface over the two ways tadm generates after a prompt.

* :class:`BlockGenerator` - a post-training base (a DiffusionGemma-class backbone) with or without a
  fusion adapter (sec. "TADM:Post-train"). Canvas after canvas is generated with the entropy-bound
  sampler (Algorithm 2 inside Algorithm 1; the paper's settings: canvas L = 256, T = 48 steps) by the
  base's own ``generate`` on :class:`tadm.posttrain.TimeAnchoredDiffusionGemma` (the cache inside the model).
* :class:`PrefixGenerator` - tadm's own masked diffusion models (a checkpoint directory, a Hub id or
  a builder name, see :func:`tadm.specs.resolve_model`). They have no prompt encoder, so the prompt
  is written at the start of the canvas and kept fixed at every reverse step (prefix infilling);
  the positions after it are denoised by :func:`tadm.sampling.generate` with it as ``prefix``.

Both turn text into token ids (``encode``), generate a batch of continuations (``generate``) and
return a :class:`BatchOutput`: per row the ids before the first end-of-sequence token, and what the
batch cost (Transformer-layer calls, wall time). Refresh policy (K) and sampler settings are fixed
when a generator is built (:class:`GenerationSettings`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tadm.devices import synchronize
from tadm.hf import load_hf_tokenizer
from tadm import posttrain
from tadm.posttrain.data import left_pad
from tadm.posttrain.model import SplitSpec
from tadm.sampling.entropy_bound import EntropyBoundSamplerConfig
from tadm.sampling.generate import generate as generate_canvas
from tadm.sampling.refresh import FixedRefresh, RefreshPolicy
from tadm.sampling.registry import build_sampler
from tadm.specs import find_tokenizer, resolve_model

__all__ = ["BASE_STEPS", "OWN_MODEL_STEPS", "TOKENIZER_HINT", "BatchOutput", "BlockGenerator", "GenerationSettings",
           "PrefixGenerator", "cut_at_eos"]

BASE_STEPS = 48  # T of the post-training experiments (paper appendix "TADM:Post-train")
OWN_MODEL_STEPS = 128  # `tadm sample`'s default T for tadm's own models
TOKENIZER_HINT = "give its tokenizer directory in the model arguments (tokenizer=DIR)"


@dataclass(frozen=True)
class GenerationSettings:
    """How a generator samples: the refresh policy (K) and the sampler's settings.

    steps: T per canvas; None is :data:`BASE_STEPS` for a base, :data:`OWN_MODEL_STEPS` otherwise.
    canvas_length: L of a base (None: the model's; 256 for DiffusionGemma, the paper's value).
    sampler: registry name (None: ``entropy-bound`` for a base, ``mdlm`` for tadm's own models).
    sampler_options: options of that sampler (``entropy_bound``, ``temperature_max``, ``top_p``, ...).
    self_conditioning, adaptive_stopping: of block generation (paper: on, off).
    """

    policy: RefreshPolicy = field(default_factory=FixedRefresh)
    steps: int | None = None
    canvas_length: int | None = None
    sampler: str | None = None
    sampler_options: dict[str, Any] = field(default_factory=dict)
    self_conditioning: bool = True
    adaptive_stopping: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "canvas_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None for the default), got {value!r}")


StopCheck = Callable[[int, list[int]], bool]  # (row, generated ids before EOS) -> the row is done


@dataclass
class BatchOutput:
    """Generated ids per row (before the first EOS, at most the budget) and the batch's cost."""

    tokens: list[list[int]]
    ended: list[bool]  # the row emitted an end-of-sequence token
    layer_calls: dict[str, int]  # denoising passes of the whole batch (LayerCallCounter.as_dict())
    encoder_layer_calls: int  # prompt encoder layer calls of the batch (0 for tadm's own models)
    decoder_forward_passes: list[int]  # per row, denoising passes it took part in
    seconds: float  # wall time of the batch, device synchronised
    prompt_tokens_dropped: list[int] = field(default_factory=list)  # per row, prompt tokens cut to fit (empty: none)


def cut_at_eos(row: Sequence[int], eos_ids: Sequence[int], budget: int) -> tuple[list[int], bool]:
    """``row`` up to (not including) its first id in ``eos_ids``, at most ``budget`` ids; and whether EOS was met."""
    eos = {int(i) for i in eos_ids}
    ids = [int(token) for token in row[:budget]]
    end = next((n for n, token in enumerate(ids) if token in eos), None)
    return (ids, False) if end is None else (ids[:end], True)


def _timed(device: torch.device, run: Any) -> tuple[Any, float]:
    synchronize(device)
    start = time.perf_counter()
    result = run()
    synchronize(device)
    return result, time.perf_counter() - start


def _split(split: Any) -> list[int]:
    return [split.shared, split.anchor, split.denoiser]


def _eos_ids(*candidates: Any) -> list[int]:
    """The end-of-sequence ids of the first candidate that names any (an int or a list of ints)."""
    for value in candidates:
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else [int(v) for v in value]
        if ids:
            return ids
    return []


# ------------------------------------------------------------------------------------- base models
class _RowStop:
    """A ``transformers`` stopping criterion from a :data:`StopCheck`: asked after each canvas with the ids so far."""

    def __init__(self, stop: StopCheck, eos_ids: Sequence[int], prompt_length: int, budget: int) -> None:
        self.stop, self.eos_ids, self.prompt_length, self.budget = stop, eos_ids, prompt_length, budget

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        rows = [cut_at_eos(row, self.eos_ids, self.budget)[0] for row in input_ids[:, self.prompt_length:].tolist()]
        return torch.tensor([self.stop(n, row) for n, row in enumerate(rows)], dtype=torch.bool,
                            device=input_ids.device)


class _StepProgress:
    """A streamer for the base's ``generate`` that only advances a progress bar at every denoising step."""

    def __init__(self, total: int) -> None:
        self.bar = tqdm(total=total, desc="denoising", unit="step", leave=False)

    def put(self, value: Tensor) -> None:
        """The prompt and every finished canvas: nothing to show."""

    def put_draft(self, value: Tensor | None = None, logits: Tensor | None = None) -> None:
        self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


class BlockGenerator:
    """A post-training base (plus an optional fusion adapter) generating canvases after a prompt.

    Generation is the base model's own ``generate`` on a :class:`~tadm.posttrain.TimeAnchoredDiffusionGemma`
    (the anchor cache inside the model): its entropy-bound sampler, temperature schedule and stopping.

    Args:
        model: a :class:`~tadm.posttrain.TimeAnchoredDiffusionGemma`.
        tokenizer: the base's ``transformers`` tokenizer (its chat template is used by callers).
        settings: refresh policy and entropy-bound sampler settings (``entropy_bound``, ``temperature_max``,
            ``temperature_min``).
    """

    kind = "base"

    def __init__(self, model: Any, tokenizer: Any, settings: GenerationSettings, *, name: str = "") -> None:
        if not hasattr(model, "anchor_cache") or not callable(getattr(model, "generate", None)):
            raise ValueError(f"{type(model).__name__} is not a time-anchored DiffusionGemma: only DiffusionGemma-class "
                             "bases generate after a prompt")
        if settings.sampler not in (None, "entropy-bound"):
            raise ValueError("a post-training base samples with 'entropy-bound' (Algorithm 2), "
                             f"not {settings.sampler!r}")
        self.model, self.tokenizer, self.settings, self.name = model.eval(), tokenizer, settings, name
        self.fusion_mode = model.anchor_cache.mode  # set for each batch (the model is shared)
        self.steps = BASE_STEPS if settings.steps is None else settings.steps
        options = EntropyBoundSamplerConfig(num_steps=self.steps, **settings.sampler_options)  # validates
        if options.categorical != "multinomial":
            raise ValueError(f"a base samples with its own generate, whose draws are multinomial; "
                             f"categorical={options.categorical!r} is not available there")
        self.options = options
        self.device = next(model.parameters()).device
        self.eos_ids = _eos_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id)
        self.pad_id = tokenizer.pad_token_id

    @classmethod
    def load(
        cls, base: str, settings: GenerationSettings, *, adapter: str | None = None, backbone: str = "diffusion-gemma",
        tokenizer: str | None = None, split: tuple[int, int] | None = None, naive: bool = False,
        device: str | torch.device = "cpu", dtype: str = "auto",
    ) -> BlockGenerator:
        """Load ``base`` (a directory or Hub id), attach ``adapter`` (or split it by ``split`` = (S, A))."""
        if adapter is not None and split is not None:
            raise ValueError("give an adapter or a split, not both: an adapter fixes its own split")
        if backbone != "diffusion-gemma":
            raise ValueError(f"backbone {backbone!r} has no prompt encoder: only DiffusionGemma-class bases "
                             "('diffusion-gemma') generate after a prompt")
        model, _ = posttrain.load_time_anchored(base, adapter=adapter, split=SplitSpec(*split) if split else None, naive=naive,
                                      dtype=dtype, device=device)
        tok = load_hf_tokenizer(str(tokenizer or base))
        return cls(model, tok, settings, name=Path(str(base)).name + (f"+{Path(adapter).name}" if adapter else ""))

    def with_settings(self, settings: GenerationSettings, *, naive: bool | None = None) -> BlockGenerator:
        """A generator over the same model and tokenizer (not reloaded) with other settings (K, sampler
        options) and, when ``naive`` is given, the naive-reuse baseline on or off."""
        other = BlockGenerator(self.model, self.tokenizer, settings, name=self.name)
        other.fusion_mode = self.fusion_mode if naive is None else ("naive" if naive else "paired")
        return other

    @property
    def canvas_length(self) -> int:
        return int(self.model.config.canvas_length if self.settings.canvas_length is None
                   else self.settings.canvas_length)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; BOS is added unless the text already starts with it (a chat template's)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        add = not (bos and text.startswith(bos))
        return list(self.tokenizer(text, add_special_tokens=add)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generation_kwargs(self, max_new_tokens: int) -> dict[str, Any]:
        """The base's generation-config fields for these settings (every step runs unless adaptive stopping)."""
        # deferred: transformers is an optional dependency (the posttrain and tasks extras)
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
            EntropyBoundSamplerConfig as HFEntropyBoundSamplerConfig,
        )

        o = self.options
        stopping = (1, 0.005) if self.settings.adaptive_stopping else (None, None)  # the base's released values
        return dict(max_new_tokens=max_new_tokens, max_denoising_steps=self.steps,
                    sampler_config=HFEntropyBoundSamplerConfig(entropy_bound=float(o.entropy_bound)),
                    t_min=float(o.temperature_min), t_max=float(o.temperature_max),
                    stability_threshold=stopping[0], confidence_threshold=stopping[1],
                    eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id, return_dict_in_generate=True)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 generator: torch.Generator | None = None, stop: StopCheck | None = None,
                 progress: bool = False) -> BatchOutput:
        """Generate ``ceil(max_new_tokens / L)`` canvases after each prompt (left-padded into one batch).

        ``stop(row, ids)`` is asked after each canvas; a row for which it is true (e.g. a stop string
        appeared) gets no further canvas, and the batch ends when every row is done. ``progress``: a
        progress bar over the denoising steps.
        """
        # deferred: transformers is an optional dependency (the posttrain and tasks extras)
        from transformers import StoppingCriteriaList

        ids, mask = (t.to(self.device) for t in left_pad(prompts, self.pad_id if self.pad_id is not None else 0))
        criteria = [] if stop is None else [_RowStop(stop, self.eos_ids, ids.shape[1], max_new_tokens)]
        streamer = _StepProgress(-(-max_new_tokens // self.canvas_length) * self.steps) if progress else None
        run = lambda: self.model.generate(  # noqa: E731
            ids, attention_mask=mask, stopping_criteria=StoppingCriteriaList(criteria), streamer=streamer,
            refresh_policy=self.settings.policy, naive=self.fusion_mode == "naive", generator=generator,
            canvas_length=self.canvas_length, self_conditioning=self.settings.self_conditioning,
            **self.generation_kwargs(max_new_tokens))
        out, seconds = _timed(self.device, run)
        record = self.model.last_generation
        new = out.sequences[:, ids.shape[1]:]
        rows = [cut_at_eos(row, self.eos_ids, max_new_tokens) for row in new.tolist()]
        return BatchOutput(tokens=[r[0] for r in rows], ended=[r[1] for r in rows],
                           layer_calls=record.layer_calls.as_dict(), encoder_layer_calls=record.encoder_layer_calls,
                           decoder_forward_passes=_passes(new, out.tokens_per_forward, self.pad_id), seconds=seconds)

    def describe(self) -> dict[str, Any]:
        """Settings as written to results files."""
        return {"kind": self.kind, "name": self.name, "fusion_mode": self.fusion_mode,
                "split": _split(self.model.layer_split), "sampler": "entropy-bound", "steps": self.steps,
                "canvas_length": self.canvas_length, "sampler_options": dict(self.settings.sampler_options),
                "refresh_policy": self.settings.policy.config(), "self_conditioning": self.settings.self_conditioning,
                "adaptive_stopping": self.settings.adaptive_stopping}


def _passes(new: Tensor, tokens_per_forward: Tensor, pad_id: int | None) -> list[int]:
    """Per row, the denoising passes it took part in, from the base's ``tokens_per_forward`` (valid tokens / passes)."""
    valid = new.shape[1] if pad_id is None else (new != pad_id).sum(dim=-1)
    valid = torch.as_tensor(valid, dtype=torch.float64).expand(new.shape[0])
    rate = tokens_per_forward.double().cpu()
    return [int(round(float(v / r))) if r > 0 else 0 for v, r in zip(valid.cpu(), rate)]


# -------------------------------------------------------------------------------- tadm's own models
class PrefixGenerator:
    """One of tadm's own masked diffusion models, generating after a prompt by prefix infilling.

    The canvas holds ``[BOS] + prompt`` followed by the generation budget (at most the model's
    ``max_seq_len``; a longer prompt keeps its last tokens), generated by :func:`tadm.sampling.generate`
    with the prompt as its ``prefix`` (kept at every step; the run ends with the sampler's final step).

    Args:
        model: a masked :class:`~tadm.protocol.CacheableDenoiser` (TADM, MDLM, ADLM).
        tokenizer: its :class:`~tadm.training.tokenization.TextTokenizer`.
        settings: refresh policy and sampler (default ``mdlm``) settings.
    """

    kind = "tadm"

    def __init__(self, model: Any, tokenizer: Any, settings: GenerationSettings, *, name: str = "") -> None:
        if model.mask_token_id is None:
            raise ValueError(f"model {name or type(model).__name__!r} has no mask token: not a masked diffusion model")
        if tokenizer.vocab_size != model.vocab_size:
            raise ValueError(f"tokenizer vocabulary ({tokenizer.vocab_size}) != model vocabulary ({model.vocab_size})")
        self.model, self.tokenizer, self.settings, self.name = model.eval(), tokenizer, settings, name
        self.steps = OWN_MODEL_STEPS if settings.steps is None else settings.steps
        self.sampler_name = settings.sampler or "mdlm"
        self.sampler = build_sampler(self.sampler_name, model, **settings.sampler_options)
        self.max_seq_len = int(model.config.max_seq_len)
        self.device = next(model.parameters()).device
        self.eos_ids = [tokenizer.eos_id]

    @classmethod
    def load(cls, spec: str, settings: GenerationSettings, *, tokenizer: str | None = None,
             device: str | torch.device = "cpu", tokenizer_hint: str = TOKENIZER_HINT) -> PrefixGenerator:
        """The model named by ``spec`` (:func:`tadm.specs.resolve_model`) and its tokenizer; without a tokenizer
        found, a FileNotFoundError ending in ``tokenizer_hint`` (how the caller's user names one)."""
        model = resolve_model(spec, device=device)
        try:
            found = find_tokenizer(spec, tokenizer)
        except FileNotFoundError as err:
            if tokenizer is not None:
                raise
            raise FileNotFoundError(f"no tokenizer found for model {str(spec)!r}: {tokenizer_hint}") from err
        return cls(model, found, settings, name=str(spec))

    def with_settings(self, settings: GenerationSettings) -> PrefixGenerator:
        """A generator over the same model and tokenizer (not reloaded) with other settings."""
        return PrefixGenerator(self.model, self.tokenizer, settings, name=self.name)

    def encode(self, text: str) -> list[int]:
        """``[BOS] + ids(text)``: documents start after a separator in training."""
        return [self.tokenizer.bos_id, *self.tokenizer.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 generator: torch.Generator | None = None, stop: StopCheck | None = None) -> BatchOutput:
        """Denoise ``min(max_new_tokens, max_seq_len - 1)`` positions after each prompt (one canvas, so
        ``stop`` has nothing to end early and is not used). A prompt longer than the rest of the canvas keeps
        its last tokens; the output counts the tokens each row lost."""
        budget = max(1, min(int(max_new_tokens), self.max_seq_len - 1))
        kept = [list(p)[-(self.max_seq_len - budget):] for p in prompts]
        run = lambda: generate_canvas(  # noqa: E731
            self.model, self.sampler, batch_size=len(kept), seq_len=max(len(r) for r in kept) + budget,
            num_steps=self.steps, policy=self.settings.policy, generator=generator, device=self.device, prefix=kept)
        out, seconds = _timed(self.device, run)
        calls, starts = out.layer_calls, out.prefix_lengths
        rows = [cut_at_eos(out.new_tokens(n).tolist(), self.eos_ids, budget) for n in range(len(kept))]
        return BatchOutput(tokens=[r[0] for r in rows], ended=[r[1] for r in rows], layer_calls=calls.as_dict(),
                           encoder_layer_calls=0, decoder_forward_passes=[calls.denoiser_calls] * len(rows),
                           seconds=seconds, prompt_tokens_dropped=[len(p) - s for p, s in zip(prompts, starts)])

    def describe(self) -> dict[str, Any]:
        """Settings as written to results files."""
        return {"kind": self.kind, "name": self.name, "split": _split(self.model.layer_split),
                "sampler": self.sampler_name, "steps": self.steps, "max_seq_len": self.max_seq_len,
                "sampler_options": dict(self.settings.sampler_options),
                "refresh_policy": self.settings.policy.config()}
