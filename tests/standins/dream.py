"""A stand-in for Dream's ``DreamModel``: a Qwen2-style Transformer run bidirectionally, logits not shifted.

Architecture (the Dream-7B description, Qwen2.5-7B's layers): token embedding; ``num_hidden_layers``
pre-norm layers, each RMSNorm -> grouped-query self-attention (q/k/v with biases, o without) with
rotary embeddings on explicit position ids and an optional boolean (B, 1, N, N) mask, no causal mask
-> residual, RMSNorm -> SwiGLU MLP (``gate_proj``, ``up_proj``, ``down_proj``) -> residual; final
RMSNorm and an untied ``lm_head``. The logit at position i predicts token i + 1: Dream's generation
shifts them right by one. Module paths, parameter names and forward signatures are those of the
released model; ``tests/fixtures/dream`` holds the reference's logits for these weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dream"


@dataclass
class DreamConfig:
    """The fields of Dream's config that the architecture reads."""

    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 48
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = False
    mask_token_id: int = 60
    pad_token_id: int = 62
    model_type: str = "Dream"

    @classmethod
    def from_json(cls, path: Path) -> DreamConfig:
        data = json.loads(Path(path).read_text())
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


class DreamRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(dtype)


class DreamRotaryEmbedding(nn.Module):
    """cos and sin tables (B, N, head_dim) for position ids (B, N), in the dtype of ``x``."""

    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta ** exponent), persistent=False)

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)  # (B, dim / 2, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)  # (B, N, dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class DreamMLP(nn.Module):
    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DreamSdpaAttention(nn.Module):
    def __init__(self, config: DreamConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.hidden_size = config.hidden_size
        kv = self.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, kv, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, kv, bias=True)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.rotary_emb = DreamRotaryEmbedding(config)

    def forward(self, hidden_states: Tensor, attention_mask: Any = None, position_ids: Tensor | None = None,
                past_key_value: Any = None, output_attentions: bool = False, use_cache: bool = False,
                cache_position: Any = None, position_embeddings: tuple[Tensor, Tensor] | None = None,
                ) -> tuple[Tensor, None, Any]:
        B, N, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, hd)
        k = self.k_proj(hidden_states).view(B, N, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, N, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings if position_embeddings is not None else self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = self.num_heads // self.num_key_value_heads
        k = k[:, :, None].expand(B, self.num_key_value_heads, groups, N, self.head_dim).reshape(B, -1, N, self.head_dim)
        v = v[:, :, None].expand(B, self.num_key_value_heads, groups, N, self.head_dim).reshape(B, -1, N, self.head_dim)
        mask = attention_mask if isinstance(attention_mask, Tensor) else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)  # (B, H, N, hd)
        return self.o_proj(out.transpose(1, 2).contiguous().view(B, N, self.hidden_size)), None, past_key_value


class DreamDecoderLayer(nn.Module):
    def __init__(self, config: DreamConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DreamSdpaAttention(config, layer_idx)
        self.mlp = DreamMLP(config)
        self.input_layernorm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: Tensor, attention_mask: Any = None, position_ids: Tensor | None = None,
                past_key_value: Any = None, output_attentions: bool = False, use_cache: bool = False,
                cache_position: Any = None, position_embeddings: tuple[Tensor, Tensor] | None = None,
                **kwargs: Any) -> tuple[Tensor]:
        attn, _, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                    position_ids=position_ids, position_embeddings=position_embeddings)
        hidden_states = hidden_states + attn
        return (hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)),)


@dataclass
class _Output:
    logits: Tensor | None = None
    last_hidden_state: Tensor | None = None


class DreamBaseModel(nn.Module):
    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DreamDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DreamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DreamRotaryEmbedding(config)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Any = None, position_ids: Tensor | None = None,
                past_key_values: Any = None, inputs_embeds: Tensor | None = None, **kwargs: Any) -> _Output:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, N, d)
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device)[None]
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask, position_ids=position_ids,
                      position_embeddings=position_embeddings)[0]
        return _Output(last_hidden_state=self.norm(h))


class DreamModel(nn.Module):
    """The model users load: ``.model`` (:class:`DreamBaseModel`) and ``.lm_head``; unshifted logits."""

    def __init__(self, config: DreamConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids: Tensor | None = None, attention_mask: Any = None, position_ids: Tensor | None = None,
                past_key_values: Any = None, inputs_embeds: Tensor | None = None, labels: Any = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                cache_position: Any = None, num_logits_to_keep: int = 0, **kwargs: Any) -> _Output:
        hidden = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds).last_hidden_state
        return _Output(logits=self.lm_head(hidden[:, -num_logits_to_keep:, :]))


def load_dream(directory: Path = FIXTURE) -> DreamModel:
    """The stand-in with the fixture's config and weights, in eval mode."""
    model = DreamModel(DreamConfig.from_json(directory / "config.json"))
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    return model.eval()
