"""Backbone adapters: a pretrained layer-stack diffusion LM seen as embed -> layers[i:j] -> head.

TADM:Post-train (sec. "TADM:Post-train", appendix "TADM:Post-train") splits a frozen pretrained
denoiser into a shared network S, an anchor network A and a denoiser D by layer index. Everything
the split needs from a backbone is the small :class:`LayerStackBackbone` protocol:

    prepared = backbone.prepare(batch_size, length, device, context)   # rotary tables, masks, ...
    h = backbone.embed(z, prepared)                                    # token (+ self-conditioning) input
    h = backbone.run_layers(h, start, stop, prepared)                  # Transformer layers [start, stop)
    logits = backbone.logits(h, prepared)                              # final norm + output head
    log_probs = backbone.log_probs(logits, z)                          # the model's output parameterisation

Four adapters are provided: :class:`DiffusionGemmaBackbone` wraps ``transformers``'
``DiffusionGemmaForBlockDiffusion`` (a uniform-state block-diffusion LM) through the model's own
modules, :class:`MDLMBackbone` wraps tadm's own MDLM DiT stack (:class:`tadm.nn.MDLM`), and
:class:`~tadm.posttrain.backbones.LLaDABackbone` and :class:`~tadm.posttrain.backbones.DreamBackbone`
wrap a loaded LLaDA or Dream model (bidirectional Transformers over the whole sequence,
:mod:`tadm.posttrain.backbones`).

Other layer-stack diffusion LMs plug in by implementing the same five methods; nothing else in
:mod:`tadm.posttrain` looks inside a backbone.
``transformers`` is imported only when a DiffusionGemma backbone is built or loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tadm.devices import resolve_dtype
from tadm.hf import check_hf_source, first_line, load_hf, refuse_custom_code
from tadm.nn import load_model
from tadm.nn.baselines import MDLM
from tadm.nn.dit import subs_log_probs, time_condition
from tadm.nn.released_mdlm import is_released_mdlm_source
from tadm.posttrain.backbones import DreamBackbone, LLaDABackbone

__all__ = ["BACKBONES", "DiffusionGemmaBackbone", "DreamBackbone", "LLaDABackbone", "LayerStackBackbone", "MDLMBackbone",
           "PromptCache", "StackContext", "WRAPPED_CLASSES", "check_base", "load_backbone", "load_diffusion_gemma",
           "resolve_dtype", "tiny_diffusion_gemma_config", "wrap_backbone"]


# ------------------------------------------------------------------------------------------ inputs
@dataclass
class PromptCache:
    """The encoded context of a block-diffusion backbone: KV cache plus its padding mask.

    ``past_key_values`` is the backbone's own cache object (a ``transformers`` ``Cache`` for
    DiffusionGemma), written by the encoder and only read by the denoiser layers.
    """

    past_key_values: Any
    attention_mask: Tensor  # (B, P) bool, False at (left) padding
    batch_size: int

    @property
    def length(self) -> int:
        """P, the number of context positions (the first canvas position is P)."""
        return int(self.attention_mask.shape[1])


@dataclass
class StackContext:
    """Everything besides the canvas tokens that one denoiser pass reads.

    prompt: encoded context (DiffusionGemma); None for unconditional backbones.
    self_conditioning_logits: (B, L, V) temperature-scaled logits of the previous reverse step;
        None means a zero self-conditioning signal (the first step).
    self_conditioning_mask: (B,) bool; rows set to False get a zero signal.
    t: (B,) diffusion time, read only by time-conditioned backbones.
    attention_mask: (B, L) padding mask of a canvas that holds the prompt too (LLaDA, Dream): 1 at
        real tokens, 0 at (left) padding; None means no padding.
    """

    prompt: PromptCache | None = None
    self_conditioning_logits: Tensor | None = None
    self_conditioning_mask: Tensor | None = None
    t: Tensor | None = None
    attention_mask: Tensor | None = None

    def with_time(self, t: Tensor | None) -> StackContext:
        return self if t is None else replace(self, t=t)


@runtime_checkable
class LayerStackBackbone(Protocol):
    """A pretrained diffusion LM exposed stage by stage (see the module docstring)."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    mask_token_id: int | None
    prior: str  # forward-process prior: "uniform" or "mask"
    supports_self_conditioning: bool
    time_conditioned: bool  # the stack reads the diffusion time
    dtype: torch.dtype  # of its embeddings (self-conditioning logits are cast to it)

    def prepare(self, batch_size: int, length: int, device: torch.device, context: StackContext | None) -> Any:
        """Per-pass state (rotary tables, attention masks, conditioning) for a (B, L) canvas."""

    def embed(self, z: Tensor, prepared: Any) -> Tensor:
        """Token ids (B, L) -> input representation (B, L, d), self-conditioning included."""

    def run_layers(self, h: Tensor, start: int, stop: int, prepared: Any) -> Tensor:
        """Transformer layers ``start <= i < stop`` on h (B, L, d) -> (B, L, d)."""

    def logits(self, h: Tensor, prepared: Any) -> Tensor:
        """Final norm and output head: (B, L, d) -> float32 logits (B, L, V)."""

    def log_probs(self, logits: Tensor, z: Tensor) -> Tensor:
        """The model's output parameterisation: logits (B, L, V) and canvas (B, L) -> log x_theta."""


def check_base(path: str | Path, *, model_type: str) -> None:
    """Refuse a base-model ``path`` that does not exist or is not a ``model_type`` checkpoint directory (one line)."""
    check_hf_source(path, "base model")
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return  # a hub id: the loader fetches and checks it
    refuse_custom_code(config_file.parent, "base model")
    try:
        found = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        raise ValueError(f"base model {str(path)!r}: {config_file} is not a valid JSON object") from None
    if found != model_type:
        raise ValueError(f"base model {str(path)!r} is a {found!r} checkpoint; this backbone loads {model_type!r}")


def load_diffusion_gemma(path: str | Path, **kwargs: Any) -> nn.Module:
    """``DiffusionGemmaForBlockDiffusion.from_pretrained(path, **kwargs)`` after :func:`check_base`.

    Never runs code shipped with the checkpoint (``trust_remote_code=False``). A missing path, a
    directory that is no DiffusionGemma checkpoint or an unreachable hub id is a one-line
    FileNotFoundError or ValueError naming ``path``.
    """
    # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
    from transformers import DiffusionGemmaForBlockDiffusion

    check_base(path, model_type="diffusion_gemma")
    try:
        return load_hf(DiffusionGemmaForBlockDiffusion.from_pretrained, path, "base model", **kwargs)
    except OSError as err:
        raise FileNotFoundError(f"could not load base model {str(path)!r}: {first_line(err)}") from None


def _checkpointing(model: nn.Module) -> bool:
    """Whether ``model``'s gradient (activation) checkpointing is on (transformers renamed the property in 5.x)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def _check_tokens(z: Tensor, what: str = "canvas (B, L)") -> None:
    if z.dim() != 2 or z.dtype != torch.long:
        raise ValueError(f"{what} must be a LongTensor of token ids; got {z.dtype} of shape {tuple(z.shape)}")


# ----------------------------------------------------------------------------------- DiffusionGemma
@dataclass
class _GemmaPass:
    """Prepared state of one DiffusionGemma decoder pass."""

    context: StackContext
    position_ids: Tensor  # (1, L) int32
    position_embeddings: dict[str, tuple[Tensor, Tensor]]  # layer type -> (cos, sin)
    masks: dict[str, Any]  # layer type -> 4-D mask or None (full attention over context + canvas)


class DiffusionGemmaBackbone(nn.Module):
    """``DiffusionGemmaForBlockDiffusion`` as a :class:`LayerStackBackbone` (weights frozen).

    The decoder pass over a canvas is the model's scaled embedding + self-conditioning block,
    ``num_layers`` decoder layers (rotary tables and masks per layer type, sliding or full) reading the
    prompt KV cache, final RMSNorm, the tied LM head and tanh soft-capping: run in order, the layers
    reproduce the model's ``forward`` bit for bit. The prompt (and every finished canvas) is encoded by
    the model's causal encoder, which shares the decoder's weights, into a ``transformers``
    ``DynamicCache`` (:meth:`prefill`, :meth:`append`).
    """

    prior = "uniform"
    supports_self_conditioning = True
    time_conditioned = False  # DiffusionGemma's decoder reads no diffusion time
    mask_token_id = None

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not any(cls.__name__ == "DiffusionGemmaForBlockDiffusion" for cls in type(model).__mro__):
            raise TypeError(f"expected a DiffusionGemmaForBlockDiffusion, got {type(model).__name__}")
        model.requires_grad_(False)
        model.eval()
        self.model = model
        text = model.config.text_config
        self.text_config = text
        self.num_layers: int = int(text.num_hidden_layers)
        self.hidden_size: int = int(text.hidden_size)
        self.vocab_size: int = int(text.vocab_size)
        self.layer_types: list[str] = list(text.layer_types)
        self.canvas_length: int = int(model.config.canvas_length)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu"
    ) -> DiffusionGemmaBackbone:
        """Load a checkpoint directory or hub id with :func:`load_diffusion_gemma` (one-line errors naming it)."""
        device = torch.device(device)
        placement = {} if device.type == "cpu" else {"device_map": str(device)}  # load straight onto the GPU
        model = load_diffusion_gemma(path, dtype=resolve_dtype(dtype, device), **placement)
        return cls(model.to(device))

    @property
    def decoder(self) -> nn.Module:
        return self.model.model.decoder

    @property
    def encoder(self) -> nn.Module:
        return self.model.model.encoder

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    def train(self, mode: bool = True) -> DiffusionGemmaBackbone:
        """The frozen backbone always stays in eval mode."""
        return super().train(False)

    # ---------------------------------------------------------------- context (encoder + KV cache)
    def _encode_into(self, cache: Any, ids: Tensor, attention_mask: Tensor, start: int) -> None:
        """Run the causal encoder on ``ids`` (B, n) at positions start..start+n-1, appending to ``cache``."""
        B, n = ids.shape
        position_ids = torch.arange(start, start + n, dtype=torch.int32, device=ids.device).unsqueeze(0)  # (1, n)
        # Only shape, dtype and device of the embeddings are read by the mask builder.
        dummy = torch.empty((B, n, 0), dtype=self.model.dtype, device=ids.device)
        masks = self.encoder.create_masks_for_generate(
            config=self.model.config, inputs_embeds=dummy, attention_mask=attention_mask, past_key_values=cache,
            position_ids=position_ids, mm_token_type_ids=None,
        )
        self.encoder(input_ids=ids.contiguous(), attention_mask=masks, past_key_values=cache, position_ids=position_ids)

    def prefill(self, prompt_ids: Tensor, attention_mask: Tensor | None = None) -> PromptCache:
        """Encode a (left-padded) prompt (B, P) into a fresh KV cache; ``attention_mask`` (B, P) marks real tokens.

        Positions are 0..P-1 for every row, as in ``generate``. Every row needs at least one real token.
        """
        # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
        from transformers import DynamicCache

        _check_tokens(prompt_ids, "prompt ids (B, P)")
        if prompt_ids.shape[1] < 1:
            raise ValueError("DiffusionGemma needs a prompt of at least one token (e.g. BOS) to condition on")
        mask = (torch.ones_like(prompt_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.to(device=prompt_ids.device, dtype=torch.bool))
        if mask.shape != prompt_ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must match prompt ids {tuple(prompt_ids.shape)}")
        cache = DynamicCache(config=self.model.config.get_text_config(decoder=True))
        self._encode_into(cache, prompt_ids, mask, start=0)
        return PromptCache(past_key_values=cache, attention_mask=mask, batch_size=prompt_ids.shape[0])

    def append(self, prompt: PromptCache, canvas: Tensor) -> PromptCache:
        """Encode a finished canvas (B, L) after the context; returns the extended context (cache updated in place)."""
        _check_tokens(canvas)
        start = prompt.length
        mask = F.pad(prompt.attention_mask, (0, canvas.shape[1]), value=True)  # (B, P + L)
        self._encode_into(prompt.past_key_values, canvas, mask, start=start)
        return PromptCache(past_key_values=prompt.past_key_values, attention_mask=mask, batch_size=prompt.batch_size)

    # ---------------------------------------------------------------- one decoder pass, stage by stage
    def prepare(
        self, batch_size: int, length: int, device: torch.device, context: StackContext | None
    ) -> _GemmaPass:
        """Rotary tables per layer type and the decoder masks for a (B, L) canvas after ``context.prompt``."""
        if context is None or context.prompt is None:
            raise ValueError("a DiffusionGemma pass needs the encoded prompt: build it with "
                             "backbone.prefill(prompt_ids) and pass StackContext(prompt=...)")
        prompt = context.prompt
        if prompt.batch_size != batch_size:
            raise ValueError(f"prompt cache holds {prompt.batch_size} rows but the canvas has {batch_size}")
        start = prompt.length
        position_ids = torch.arange(start, start + length, dtype=torch.int32, device=device).unsqueeze(0)  # (1, L)
        decoder_mask = F.pad(prompt.attention_mask, (0, length), value=True)  # (B, P + L)
        masks = self.decoder.create_diffusion_decoder_attention_mask(
            config=self.model.config, past_key_values=prompt.past_key_values, decoder_attention_mask=decoder_mask,
            # Only (B, L), dtype and device are read; this is the dummy ``generate`` passes too.
            inputs_embeds=torch.zeros(batch_size, length, 1, dtype=torch.long, device=device),
        )
        ref = torch.empty(0, dtype=self.dtype, device=device)
        rotary = {lt: self.decoder.rotary_emb(ref, position_ids, lt) for lt in sorted(set(self.layer_types))}
        return _GemmaPass(context=context, position_ids=position_ids, position_embeddings=rotary, masks=masks)

    def self_conditioning_embeddings(self, like: Tensor, context: StackContext) -> Tensor:
        """Soft embeddings s = softmax(previous scaled logits) E * sqrt(d), or zeros: (B, L, d)."""
        embed = self.decoder.embed_tokens
        sc = context.self_conditioning_logits
        if sc is None:
            return torch.zeros_like(like)
        if sc.shape[:2] != like.shape[:2] or sc.shape[-1] != self.vocab_size:
            raise ValueError(f"self-conditioning logits {tuple(sc.shape)} must be (B, L, V) = "
                             f"({like.shape[0]}, {like.shape[1]}, {self.vocab_size})")
        probs = sc.softmax(dim=-1, dtype=torch.float32).to(embed.weight.dtype)  # (B, L, V)
        soft = torch.matmul(probs, embed.weight) * embed.embed_scale.to(like.dtype)  # (B, L, d)
        if context.self_conditioning_mask is not None:
            soft = soft * context.self_conditioning_mask.to(soft.dtype)[:, None, None]
        return soft

    def embed(self, z: Tensor, prepared: _GemmaPass) -> Tensor:
        """Scaled token embedding plus the self-conditioning block: (B, L) -> (B, L, d)."""
        _check_tokens(z)
        inputs = self.decoder.embed_tokens(z)  # (B, L, d)
        return self.decoder.self_conditioning(inputs, self.self_conditioning_embeddings(inputs, prepared.context))

    def run_layers(self, h: Tensor, start: int, stop: int, prepared: _GemmaPass) -> Tensor:
        """Decoder layers [start, stop) with their own rotary table and mask (sliding or full)."""
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) is outside 0..{self.num_layers}")
        cache = prepared.context.prompt.past_key_values if prepared.context.prompt is not None else None
        # The frozen layers stay in eval mode, where transformers' own checkpointing is off: with the model's
        # gradient checkpointing on, a pass that needs gradients (the fusion's, through the denoiser) recomputes
        # each layer in backward instead of keeping its activations.
        checkpointing = torch.is_grad_enabled() and h.requires_grad and _checkpointing(self.model)
        for i in range(start, stop):
            layer_type = self.layer_types[i]
            inputs = dict(position_embeddings=prepared.position_embeddings[layer_type],
                          attention_mask=prepared.masks[layer_type], position_ids=prepared.position_ids,
                          past_key_values=cache)
            if checkpointing:
                h = checkpoint(self.decoder.layers[i], h, use_reentrant=False, **inputs)  # (B, L, d)
            else:
                h = self.decoder.layers[i](h, **inputs)  # (B, L, d)
        return h

    def logits(self, h: Tensor, prepared: _GemmaPass | None = None) -> Tensor:
        """Final RMSNorm, tied LM head and soft-capping cap * tanh(x / cap): (B, L, d) -> float32 (B, L, V)."""
        logits = self.model.lm_head(self.decoder.norm(h)).to(torch.float32)  # (B, L, V)
        cap = self.model.final_logit_softcapping
        if cap is None:
            return logits
        if torch.is_grad_enabled() and logits.requires_grad:
            return torch.tanh(logits / cap) * cap
        # Without gradients the same three operations in place (bit-identical), on the head's fresh output:
        # two (B, L, V) float32 temporaries fewer at the peak of a sampling pass.
        return logits.div_(cap).tanh_().mul_(cap)

    def log_probs(self, logits: Tensor, z: Tensor) -> Tensor:
        """Uniform-state model: a plain log-softmax over the vocabulary."""
        return F.log_softmax(logits.float(), dim=-1)


def tiny_diffusion_gemma_config(
    vocab_size: int = 128,
    hidden_size: int = 32,
    num_layers: int = 6,
    canvas_length: int = 8,
    num_heads: int = 2,
    head_dim: int = 16,
    sliding_window: int = 16,
    num_experts: int = 4,
    top_k_experts: int = 2,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    bos_token_id: int = 2,
    **text_overrides: Any,
) -> Any:
    """A test-sized ``DiffusionGemmaConfig``: the real architecture (sliding and full layers, MoE,
    self-conditioning, tied encoder/decoder) at toy sizes.

    The text stack has ``num_layers`` layers, every sixth and the last with full attention. The
    vision tower cannot be left out of a ``DiffusionGemmaConfig``; it gets one 8-wide layer (a few
    hundred parameters) and is never run on text.
    """
    # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
    from transformers import DiffusionGemmaConfig

    text = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=1, head_dim=head_dim, global_head_dim=head_dim,
        num_global_key_value_heads=1, sliding_window=sliding_window, num_experts=num_experts,
        top_k_experts=top_k_experts, moe_intermediate_size=hidden_size // 2, max_position_embeddings=4096,
        pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id, **text_overrides,
    )
    vision = dict(
        model_type="gemma4_vision", hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=8, position_embedding_size=16, patch_size=2,
    )
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length)


DIFFUSION_GEMMA_26B = "google/diffusiongemma-26B-A4B-it"


def diffusion_gemma_26b_config() -> Any:
    """The architecture of DiffusionGemma-26B-A4B (``google/diffusiongemma-26B-A4B-it``), built without a download.

    Where each value comes from:

    * hidden size 2816, 30 text layers, 128 experts with top-8 routing and the 262,144-token
      vocabulary: the paper's appendix ("30 text layers") and the model card (26B total / 4B active,
      128 experts, 8 active, 262K vocabulary);
    * every other text value (16 query heads of dimension 256; 8 key/value heads on sliding layers and
      2 of dimension 512 on the full-attention ones, ``attention_k_eq_v``; dense FFN 2,112 beside the
      experts' 704; sliding window 1,024; every sixth layer full attention; context 262,144; logit
      soft-capping 30; tied embeddings) and the vision tower (27 layers, width 1,152, 16 heads of 72,
      FFN 4,304, patch 16, pooling 3, 10,240 position embeddings): the ``config.json`` the checkpoint
      is released with, as public conversions of it read it;
    * canvas 256: the model card and the paper (canvas 256, 48 steps).

    ``tadm posttrain plan`` builds the model from it on the meta device; the GPU campaign builds it
    with random bf16 weights. A downloaded checkpoint's own ``config.json`` always takes precedence.
    """
    # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
    from transformers import DiffusionGemmaConfig

    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)]
    text = dict(
        vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024, layer_types=layer_types,
        max_position_embeddings=262_144, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    vision = dict(
        model_type="gemma4_vision", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
        position_embedding_size=10240,
    )
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=256)


# --------------------------------------------------------------------------------------------- MDLM
@dataclass
class _DiTPass:
    context: StackContext
    cond: Tensor  # (B, cond_dim)
    rotary: tuple[Tensor, Tensor]  # (L, head_dim) each


class MDLMBackbone(nn.Module):
    """tadm's :class:`~tadm.nn.MDLM` (embedding -> DiT blocks -> output layer, SUBS) as a :class:`LayerStackBackbone`."""

    prior = "mask"
    supports_self_conditioning = False

    @property
    def time_conditioned(self) -> bool:
        return bool(self.model.config.time_conditioning)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed.weight.dtype

    def __init__(self, model: MDLM) -> None:
        super().__init__()
        if not isinstance(model, MDLM):
            raise TypeError(f"expected a tadm MDLM, got {type(model).__name__}")
        model.requires_grad_(False)
        model.eval()
        self.model = model
        self.num_layers: int = len(model.blocks.blocks)
        self.hidden_size: int = int(model.config.hidden_size)
        self.vocab_size: int = int(model.vocab_size)
        self.mask_token_id: int | None = model.mask_token_id

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str | torch.dtype | None = "fp32", device: str | torch.device = "cpu"
    ) -> MDLMBackbone:
        """Load a tadm MDLM checkpoint directory (or hub id), or a released MDLM-family checkpoint (a Hub-layout
        directory or a Lightning ``.ckpt``, read by tadm itself without its custom code:
        :mod:`tadm.nn.released_mdlm`); a missing path is a one-line FileNotFoundError."""
        if not is_released_mdlm_source(path):
            check_base(path, model_type="mdlm")
        return cls(load_model(path).to(device=device, dtype=resolve_dtype(dtype, device)))

    def train(self, mode: bool = True) -> MDLMBackbone:
        """The frozen backbone always stays in eval mode (no dropout)."""
        return super().train(False)

    def prepare(self, batch_size: int, length: int, device: torch.device, context: StackContext | None) -> _DiTPass:
        context = context if context is not None else StackContext()
        if context.self_conditioning_logits is not None:
            raise ValueError("MDLM has no self-conditioning input; pass self_conditioning_logits=None")
        if length > self.model.config.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len={self.model.config.max_seq_len}")
        cond = time_condition(
            self.model.time_embed, context.t, batch_size, torch.device(device), self.model.config.time_conditioning
        )  # (B, cond_dim)
        return _DiTPass(context=context, cond=cond, rotary=self.model.blocks.rotary(length, device))

    def embed(self, z: Tensor, prepared: _DiTPass) -> Tensor:
        return self.model.encode(z)  # (B, L, d)

    def run_layers(self, h: Tensor, start: int, stop: int, prepared: _DiTPass) -> Tensor:
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) is outside 0..{self.num_layers}")
        for block in self.model.blocks.blocks[start:stop]:
            h = block(h, prepared.cond, prepared.rotary)  # (B, L, d)
        return h

    def logits(self, h: Tensor, prepared: _DiTPass) -> Tensor:
        return self.model.head(h, prepared.cond).float()  # (B, L, V)

    def log_probs(self, logits: Tensor, z: Tensor) -> Tensor:
        """SUBS: the mask gets zero probability and unmasked positions are carried over."""
        assert self.mask_token_id is not None
        return subs_log_probs(logits, z, self.mask_token_id)


# ----------------------------------------------------------------------------------------- registry
BACKBONES: dict[str, Callable[..., nn.Module]] = {
    "diffusion-gemma": DiffusionGemmaBackbone.from_pretrained,
    "mdlm": MDLMBackbone.from_pretrained,
    "llada": LLaDABackbone.from_pretrained,  # refuses: the user loads the model (its code ships with it)
    "dream": DreamBackbone.from_pretrained,  # refuses, likewise
}
"""Backbone kind -> loader ``f(path, *, dtype, device)``."""


def load_backbone(
    kind: str, path: str | Path, *, dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu"
) -> nn.Module:
    """Load a pretrained backbone of the given kind ("diffusion-gemma", "mdlm") from a directory or hub id.

    "llada" and "dream" are refused with a one-line error: their modeling code ships with the checkpoint,
    so the user loads the model and passes it to :func:`wrap_backbone`.
    """
    try:
        loader = BACKBONES[kind]
    except KeyError:
        raise ValueError(f"unknown backbone kind {kind!r}; valid: {', '.join(sorted(BACKBONES))}") from None
    return loader(path, dtype=dtype, device=device)


WRAPPED_CLASSES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "DiffusionGemmaForBlockDiffusion": DiffusionGemmaBackbone,
    "LLaDAModelLM": LLaDABackbone,
    "DreamModel": DreamBackbone,
}
"""Class name of a loaded model -> its adapter (models whose code tadm does not import are matched by name)."""


def wrap_backbone(model: nn.Module) -> nn.Module:
    """The adapter for an already-built model: a DiffusionGemmaForBlockDiffusion, LLaDAModelLM, DreamModel or tadm MDLM."""
    if isinstance(model, (DiffusionGemmaBackbone, MDLMBackbone, LLaDABackbone, DreamBackbone)):
        return model
    adapter = next((WRAPPED_CLASSES[c.__name__] for c in type(model).__mro__ if c.__name__ in WRAPPED_CLASSES), None)
    if adapter is not None:  # the class or a subclass of it (the time-anchored DiffusionGemma)
        return adapter(model)
    if isinstance(model, MDLM):
        return MDLMBackbone(model)
    raise TypeError(
        f"no backbone adapter for {type(model).__name__}; supported: {', '.join(WRAPPED_CLASSES)}, tadm MDLM "
        "(other stacks plug in by implementing tadm.posttrain.backbone.LayerStackBackbone)"
    )
