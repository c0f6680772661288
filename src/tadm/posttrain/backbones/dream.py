"""Dream (``DreamModel``, the Dream-org/Dream-v0-*-7B checkpoints) as a :class:`~tadm.posttrain.backbone.LayerStackBackbone`.

A Dream pass runs over the whole sequence: token embedding ``model.model.embed_tokens`` -> the
Qwen2-style decoder layers ``model.model.layers`` run without a causal mask (rotary tables from
``model.model.rotary_emb`` on explicit position ids; a padded batch gets a boolean (B, 1, L, L) mask
and positions counted from each row's first real token) -> ``model.model.norm`` -> ``model.lm_head``.
Dream keeps the autoregressive convention of its initialisation: the logit at position i predicts
token i + 1, and ``diffusion_generate`` shifts the logits right by one position (position 0 reuses
its own). :meth:`DreamBackbone.logits` returns them shifted, aligned with the canvas as tadm's loop
expects, and the output parameterisation is SUBS (Eq. (mdlm-posterior-unk)). The mask, position ids
and shift are built as ``diffusion_generate`` builds them (tested against the public implementation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tadm.nn.dit import subs_log_probs
from tadm.posttrain.backbones.shape import DenseStackShape
from tadm.posttrain.backbones.whole_sequence import WholeSequenceBackbone

__all__ = ["DREAM_7B", "DREAM_MASK_TOKEN_ID", "DreamBackbone", "dream_7b_config", "dream_shape", "shift_logits"]

DREAM_MASK_TOKEN_ID = 151666  # <|mask|> of the Dream-7B tokenizer
DREAM_7B = "Dream-org/Dream-v0-Instruct-7B"


def dream_7b_config() -> dict[str, Any]:
    """The architecture fields of Dream-7B's ``config.json`` (Base and Instruct share them), without a download.

    Qwen2.5-7B's layers: 28 layers of width 3,584 with 28 query and 4 key/value heads (head 128) and
    q/k/v biases, SwiGLU width 18,944, RMSNorm (eps 1e-6), RoPE theta 1,000,000, vocabulary 152,064,
    an untied head, mask id 151,666: the released ``config.json`` as public code reads it.
    """
    return dict(model_type="Dream", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=False, mask_token_id=DREAM_MASK_TOKEN_ID,
                max_position_embeddings=131072)


def dream_shape(config: Mapping[str, Any]) -> DenseStackShape:
    """The dense-stack shape of a Dream ``config.json`` (a mapping of its fields)."""
    d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return DenseStackShape(
        layers=int(config["num_hidden_layers"]), hidden=d, heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=d // heads,
        ffn=int(config["intermediate_size"]), vocab=int(config["vocab_size"]), qkv_bias=True, out_bias=False,
        tied_head=bool(config.get("tie_word_embeddings", False)))


def shift_logits(logits: Tensor) -> Tensor:
    """Position i takes the logits computed at i - 1 (position 0 keeps its own): (B, L, V) -> (B, L, V)."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


@dataclass
class _DreamPass:
    """Prepared state of one Dream pass."""

    context: Any  # the StackContext it was prepared for
    attention_mask: Tensor | None  # (B, 1, L, L) bool, None without padding (full attention)
    position_ids: Tensor  # (B, L) or (1, L) long
    position_embeddings: tuple[Tensor, Tensor]  # cos, sin: (B or 1, L, head_dim)


class DreamBackbone(WholeSequenceBackbone):
    """A loaded ``DreamModel`` (any module with its layout) as a frozen :class:`LayerStackBackbone`.

    Args:
        model: the loaded model: ``model.model`` holds ``embed_tokens``, ``layers``, ``norm`` and
            ``rotary_emb``; ``model.lm_head`` the head; ``model.config`` its Dream config.
        mask_token_id: the mask id (default: the config's ``mask_token_id``, else 151,666).
    """

    family = "Dream"
    default_mask_token_id = DREAM_MASK_TOKEN_ID

    def __init__(self, model: nn.Module, mask_token_id: int | None = None) -> None:
        super().__init__()
        base = getattr(model, "model", None)
        missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, name)]
        missing += [name for name in ("lm_head", "config") if not hasattr(model, name)]
        if missing:
            raise TypeError(f"{type(model).__name__} does not have Dream's layout (model.model with embed_tokens, "
                            f"layers, norm, rotary_emb; lm_head; config); missing: {', '.join(missing)}")
        self._adopt(model)
        self.num_layers: int = len(model.model.layers)
        self.hidden_size: int = int(model.config.hidden_size)
        self.vocab_size: int = int(model.lm_head.out_features)
        self.mask_token_id: int | None = self._mask_token_id(mask_token_id, model.config)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    def prepare(self, batch_size: int, length: int, device: torch.device, context: Any) -> _DreamPass:
        """Mask, position ids and rotary tables for a (B, L) canvas, as ``diffusion_generate`` builds them.

        With padding in ``context.attention_mask`` (B, L): position ids count real tokens from 0 (padding
        gets 1) and the boolean mask lets real tokens attend to real tokens only; without padding: positions
        0..L-1 and full attention.
        """
        mask = self._padding_mask(batch_size, length, context)
        attention = None
        if mask is not None and bool((mask == 0).any()):
            mask = mask.to(device)
            position_ids = mask.long().cumsum(-1) - 1  # (B, L)
            position_ids = position_ids.masked_fill(mask == 0, 1)
            real = mask.bool()
            attention = real[:, None, None, :] & real[:, None, :, None]  # (B, 1, L, L)
        else:
            position_ids = torch.arange(length, device=device)[None]  # (1, L)
        ref = torch.empty(0, dtype=self.dtype, device=device)  # the rotary module reads only dtype and device
        tables = self.model.model.rotary_emb(ref, position_ids)
        return _DreamPass(context=context, attention_mask=attention, position_ids=position_ids,
                          position_embeddings=tables)

    def embed(self, z: Tensor, prepared: _DreamPass) -> Tensor:
        """Token embedding: (B, L) -> (B, L, d)."""
        if z.dim() != 2 or z.dtype != torch.long:
            raise ValueError(f"canvas (B, L) must be a LongTensor of token ids; got {z.dtype} of shape {tuple(z.shape)}")
        return self.model.model.embed_tokens(z)

    def run_layers(self, h: Tensor, start: int, stop: int, prepared: _DreamPass) -> Tensor:
        """Decoder layers ``start <= i < stop`` on h (B, L, d) with the pass's mask and rotary tables."""
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) is outside 0..{self.num_layers}")
        for layer in self.model.model.layers[start:stop]:
            h = layer(h, attention_mask=prepared.attention_mask, position_ids=prepared.position_ids,
                      position_embeddings=prepared.position_embeddings)[0]  # (B, L, d)
        return h

    def logits(self, h: Tensor, prepared: _DreamPass | None = None) -> Tensor:
        """Final RMSNorm and head, shifted right by one (:func:`shift_logits`): float32 (B, L, V) aligned with the canvas."""
        return shift_logits(self.model.lm_head(self.model.model.norm(h))).to(torch.float32)

    def log_probs(self, logits: Tensor, z: Tensor) -> Tensor:
        """SUBS on the aligned logits: the mask gets zero probability and unmasked positions are carried over."""
        assert self.mask_token_id is not None
        return subs_log_probs(logits, z, self.mask_token_id)
