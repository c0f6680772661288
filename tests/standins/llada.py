"""A stand-in for LLaDA's ``LLaDAModelLM``: a bidirectional Llama-style Transformer predicting x0.

Architecture (the LLaDA-8B description): token embedding ``wte``; ``n_layers`` pre-norm blocks, each
RMSNorm -> multi-head self-attention with rotary embeddings on all positions (no causal mask; a
padding mask becomes an additive key bias) -> residual, RMSNorm -> SwiGLU MLP (``ff_proj`` gate,
``up_proj``, ``ff_out``) -> residual; final RMSNorm ``ln_f`` and an untied output layer ``ff_out``.
Module paths, parameter names and forward signatures are those of the released model
(``model.transformer.blocks[i].q_proj``, ``LLaDAModelLM.forward(input_ids, attention_mask=...)``);
``tests/fixtures/llada`` holds the reference's logits for these weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llada"


@dataclass
class LLaDAConfig:
    """The fields of LLaDA's config that the architecture reads (the released config has more)."""

    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int | None = None
    n_layers: int = 4
    mlp_hidden_size: int = 48
    vocab_size: int = 64
    embedding_size: int | None = None
    mask_token_id: int = 60
    eos_token_id: int = 61
    pad_token_id: int = 62
    max_sequence_length: int = 64
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    weight_tying: bool = False
    include_bias: bool = False
    input_emb_norm: bool = False
    scale_logits: bool = False
    block_group_size: int = 1
    rope: bool = True
    alibi: bool = False
    model_type: str = "llada"

    @property
    def effective_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @classmethod
    def from_json(cls, path: Path) -> LLaDAConfig:
        data = json.loads(Path(path).read_text())
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


class RMSLayerNorm(nn.Module):
    """x / rms(x) computed in float32, cast back, times a learned weight."""

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.weight = nn.Parameter(torch.ones(config.d_model))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary embeddings on positions 0..T-1, rotating the two halves of each head, in float32."""

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        self.head_dim = config.d_model // config.n_heads
        self.theta = config.rope_theta

    def tables(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponent)  # (hs / 2,)
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float), inv_freq)  # (T, hs / 2)
        angles = torch.cat((angles, angles), dim=-1)[None, None]  # (1, 1, T, hs)
        return angles.sin(), angles.cos()

    @staticmethod
    def rotate(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
        first, second = x.chunk(2, dim=-1)
        return (x * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        sin, cos = self.tables(k.shape[-2], q.device)
        q_, k_ = q.float(), k.float()
        return self.rotate(q_, sin, cos).type_as(q), self.rotate(k_, sin, cos).type_as(k)


class LLaDALlamaBlock(nn.Module):
    """Pre-norm block: x + Attn(RMSNorm(x)), then + SwiGLU(RMSNorm(.))."""

    def __init__(self, layer_id: int, config: LLaDAConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        d, head_dim = config.d_model, config.d_model // config.n_heads
        kv = config.effective_n_kv_heads * head_dim
        bias = config.include_bias
        self.attn_norm = RMSLayerNorm(config)
        self.ff_norm = RMSLayerNorm(config)
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, kv, bias=bias)
        self.v_proj = nn.Linear(d, kv, bias=bias)
        self.attn_out = nn.Linear(d, d, bias=bias)
        self.ff_proj = nn.Linear(d, config.mlp_hidden_size, bias=bias)
        self.up_proj = nn.Linear(d, config.mlp_hidden_size, bias=bias)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d, bias=bias)
        self.act = nn.SiLU()
        self.dropout = nn.Dropout(0.0)
        self.rotary_emb = RotaryEmbedding(config)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, attention_bias: Tensor | None) -> Tensor:
        B, T, C = q.shape
        heads, kv_heads = self.config.n_heads, self.config.effective_n_kv_heads
        q = q.view(B, T, heads, C // heads).transpose(1, 2)  # (B, H, T, hs)
        k = k.view(B, T, kv_heads, C // heads).transpose(1, 2)  # (B, Hkv, T, hs)
        v = v.view(B, T, kv_heads, C // heads).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        if attention_bias is not None:
            attention_bias = attention_bias[:, :, :T, :T].to(q.dtype)
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias, is_causal=False)  # (B, H, T, hs)
        return self.attn_out(att.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x: Tensor, attention_bias: Tensor | None = None, layer_past: Any = None,
                use_cache: bool = False) -> tuple[Tensor, None]:
        h = self.attn_norm(x)
        x = x + self.dropout(self.attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), attention_bias))
        h = self.ff_norm(x)
        h = self.act(self.ff_proj(h)) * self.up_proj(h)
        return x + self.dropout(self.ff_out(h)), None


class LLaDAOutput(NamedTuple):
    logits: Tensor
    attn_key_values: Any = None
    hidden_states: Any = None


class LLaDAModel(nn.Module):
    """``transformer``: ``wte``, ``emb_drop``, ``blocks``, ``ln_f`` and (untied) ``ff_out``."""

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        self.config = config
        vocab = config.embedding_size or config.vocab_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, config.d_model), emb_drop=nn.Dropout(0.0), ln_f=RMSLayerNorm(config),
            blocks=nn.ModuleList(LLaDALlamaBlock(i, config) for i in range(config.n_layers))))
        if not config.weight_tying:
            self.transformer["ff_out"] = nn.Linear(config.d_model, vocab, bias=config.include_bias)

    def forward(self, input_ids: Tensor, input_embeddings: Tensor | None = None, attention_mask: Tensor | None = None,
                attention_bias: Tensor | None = None, past_key_values: Any = None, use_cache: bool = False,
                last_logits_only: bool = False, output_hidden_states: bool | None = None) -> LLaDAOutput:
        x = self.transformer.wte(input_ids) if input_embeddings is None else input_embeddings  # (B, T, d)
        B = x.shape[0]
        if self.config.input_emb_norm:
            x = x * self.config.d_model ** 0.5
        x = self.transformer.emb_drop(x)
        bias = None
        if attention_mask is not None and bool((attention_mask == 0).any()):
            keep = attention_mask.to(torch.float).view(B, -1)[:, None, None, :]  # (B, 1, 1, T)
            bias = (1.0 - keep) * torch.finfo(keep.dtype).min
        for block in self.transformer.blocks:
            x, _ = block(x, attention_bias=bias)
        x = self.transformer.ln_f(x)
        if self.config.weight_tying:
            logits = F.linear(x, self.transformer.wte.weight)
        else:
            logits = self.transformer.ff_out(x)
        if self.config.scale_logits:
            logits = logits * (1 / math.sqrt(self.config.d_model))
        return LLaDAOutput(logits=logits)


@dataclass
class _Output:
    logits: Tensor


class LLaDAModelLM(nn.Module):
    """The wrapper users load: ``.model`` is the :class:`LLaDAModel`; ``forward`` returns ``.logits``."""

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LLaDAModel(config)

    @property
    def device(self) -> torch.device:
        return self.model.transformer.wte.weight.device

    def forward(self, input_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
                attention_mask: Tensor | None = None, attention_bias: Tensor | None = None,
                past_key_values: Any = None, labels: Any = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, cache_position: Any = None) -> _Output:
        out = self.model(input_ids, input_embeddings=inputs_embeds, attention_mask=attention_mask,
                         attention_bias=attention_bias)
        return _Output(logits=out.logits)


def load_llada(directory: Path = FIXTURE) -> LLaDAModelLM:
    """The stand-in with the fixture's config and weights, in eval mode."""
    model = LLaDAModelLM(LLaDAConfig.from_json(directory / "config.json"))
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    return model.eval()
