"""LLaDA (``LLaDAModelLM``, the GSAI-ML/LLaDA-8B checkpoints) as a :class:`~tadm.posttrain.backbone.LayerStackBackbone`.

A LLaDA pass runs over the whole sequence, prompt and generation alike: token embedding
``model.transformer.wte`` -> the Llama-style blocks ``model.transformer.blocks`` (bidirectional
attention; a padding mask is an additive key bias) -> final RMSNorm ``ln_f`` -> output layer
``ff_out`` (or the tied embedding). Position i's logits predict x0 at position i (mask predictor), so
the output parameterisation is SUBS (Eq. (mdlm-posterior-unk)): the mask token gets zero
probability and unmasked positions are carried over. Calling the blocks in order with the bias the
model itself builds reproduces ``LLaDAModelLM.forward`` bit for bit (tested against the public
implementation's logits).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tadm.nn.dit import subs_log_probs
from tadm.posttrain.backbones.shape import DenseStackShape
from tadm.posttrain.backbones.whole_sequence import WholeSequenceBackbone

__all__ = ["LLADA_8B", "LLADA_MASK_TOKEN_ID", "LLaDABackbone", "llada_8b_config", "llada_shape"]

LLADA_MASK_TOKEN_ID = 126336  # <|mdm_mask|> of the LLaDA-8B tokenizer
LLADA_8B = "GSAI-ML/LLaDA-8B-Instruct"


def llada_8b_config() -> dict[str, Any]:
    """The architecture fields of LLaDA-8B's ``config.json`` (Base and Instruct share them), without a download.

    32 ``llama`` blocks of width 4,096 with 32 query and 32 key/value heads, SwiGLU width 12,288,
    RMSNorm (eps 1e-5), RoPE theta 500,000, vocabulary and embedding size 126,464, no biases, an untied
    output layer, mask id 126,336: the released ``config.json`` as public code reads it.
    """
    return dict(model_type="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
                vocab_size=126464, embedding_size=126464, rms_norm_eps=1e-5, rope_theta=500000.0,
                include_bias=False, include_qkv_bias=False, weight_tying=False, mask_token_id=LLADA_MASK_TOKEN_ID,
                max_sequence_length=4096)


def llada_shape(config: Mapping[str, Any]) -> DenseStackShape:
    """The dense-stack shape of a LLaDA ``config.json`` (a mapping of its fields)."""
    d, heads = int(config["d_model"]), int(config["n_heads"])
    kv = config.get("n_kv_heads") or heads
    bias = bool(config.get("include_bias", False))
    return DenseStackShape(
        layers=int(config["n_layers"]), hidden=d, heads=heads, kv_heads=int(kv), head_dim=d // heads,
        ffn=int(config.get("mlp_hidden_size") or config.get("mlp_ratio", 4) * d),
        vocab=int(config.get("embedding_size") or config["vocab_size"]),
        qkv_bias=bias or bool(config.get("include_qkv_bias", False)), out_bias=bias,
        tied_head=bool(config.get("weight_tying", False)))


@dataclass
class _LLaDAPass:
    """Prepared state of one LLaDA pass."""

    context: Any  # the StackContext it was prepared for
    attention_bias: Tensor | None  # (B, 1, 1, L) float32 key-padding bias; None without padding


class LLaDABackbone(WholeSequenceBackbone):
    """A loaded ``LLaDAModelLM`` (any module with its layout) as a frozen :class:`LayerStackBackbone`.

    Args:
        model: the loaded model: ``model.model.transformer`` holds ``wte``, ``blocks`` (or
            ``block_groups``), ``ln_f`` and, untied, ``ff_out``; ``model.config`` its LLaDA config.
        mask_token_id: the mask id (default: the config's ``mask_token_id``, else 126,336).
    """

    family = "LLaDA"
    default_mask_token_id = LLADA_MASK_TOKEN_ID

    def __init__(self, model: nn.Module, mask_token_id: int | None = None) -> None:
        super().__init__()
        transformer = getattr(getattr(model, "model", None), "transformer", None)
        missing = [name for name in ("wte", "ln_f") if transformer is None or name not in transformer]
        if transformer is not None and "blocks" not in transformer and "block_groups" not in transformer:
            missing.append("blocks")
        if missing or not hasattr(model, "config"):
            raise TypeError(f"{type(model).__name__} does not have LLaDA's layout (model.model.transformer with wte, "
                            f"blocks, ln_f and a config); missing: {', '.join(missing) or 'config'}")
        self._adopt(model)
        config = model.config
        if getattr(config, "alibi", False):
            raise ValueError("LLaDA configs with ALiBi are not supported (the released checkpoints use RoPE)")
        self.num_layers: int = len(self.blocks)
        self.hidden_size: int = int(config.d_model)
        self.vocab_size: int = int(self.transformer.wte.num_embeddings)
        self.mask_token_id: int | None = self._mask_token_id(mask_token_id, config)

    @property
    def transformer(self) -> nn.ModuleDict:
        return self.model.model.transformer

    @property
    def blocks(self) -> list[nn.Module]:
        """The blocks in order (block groups, if the config uses them, flattened)."""
        if "blocks" in self.transformer:
            return list(self.transformer.blocks)
        return [block for group in self.transformer.block_groups for block in group]

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

    def prepare(self, batch_size: int, length: int, device: torch.device, context: Any) -> _LLaDAPass:
        """The key-padding bias of ``context.attention_mask`` (B, L): 0 where attended, the float32 minimum where not.

        As in ``LLaDAModel.forward``, a mask without zeros gives no bias at all.
        """
        mask = self._padding_mask(batch_size, length, context)
        bias = None
        if mask is not None and bool((mask == 0).any()):
            keep = mask.to(device=device, dtype=torch.float32)[:, None, None, :]  # (B, 1, 1, L)
            bias = (1.0 - keep) * torch.finfo(torch.float32).min
        return _LLaDAPass(context=context, attention_bias=bias)

    def embed(self, z: Tensor, prepared: _LLaDAPass) -> Tensor:
        """Token embedding (times sqrt(d) with ``input_emb_norm``, plus ``wpe`` without RoPE): (B, L) -> (B, L, d)."""
        if z.dim() != 2 or z.dtype != torch.long:
            raise ValueError(f"canvas (B, L) must be a LongTensor of token ids; got {z.dtype} of shape {tuple(z.shape)}")
        x = self.transformer.wte(z)  # (B, L, d)
        if getattr(self.model.config, "input_emb_norm", False):
            x = x * (self.hidden_size ** 0.5)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(torch.arange(z.shape[1], device=z.device))[None]
        return self.transformer.emb_drop(x) if "emb_drop" in self.transformer else x

    def run_layers(self, h: Tensor, start: int, stop: int, prepared: _LLaDAPass) -> Tensor:
        """Blocks ``start <= i < stop`` on h (B, L, d), each with the pass's attention bias."""
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) is outside 0..{self.num_layers}")
        for block in self.blocks[start:stop]:
            h, _ = block(h, attention_bias=prepared.attention_bias)  # (B, L, d)
        return h

    def logits(self, h: Tensor, prepared: _LLaDAPass | None = None) -> Tensor:
        """Final RMSNorm and output layer (scaled by 1 / sqrt(d) with ``scale_logits``): float32 (B, L, V)."""
        x = self.transformer.ln_f(h)
        if getattr(self.model.config, "weight_tying", False):
            logits = F.linear(x, self.transformer.wte.weight)
        else:
            logits = self.transformer.ff_out(x)  # (B, L, V)
        if getattr(self.model.config, "scale_logits", False):
            logits = logits * (1 / math.sqrt(self.hidden_size))
        return logits.to(torch.float32)

    def log_probs(self, logits: Tensor, z: Tensor) -> Tensor:
        """SUBS: the mask gets zero probability and unmasked positions are carried over."""
        assert self.mask_token_id is not None
        return subs_log_probs(logits, z, self.mask_token_id)
