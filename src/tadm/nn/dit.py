"""MDLM-style diffusion Transformer ("DDiT") pieces shared by every network in :mod:`tadm.nn`.

Blocks follow the DiT recipe MDLM uses for text: weight-only LayerNorms, adaLN-zero modulation
from a conditioning vector, rotary position embeddings on queries and keys, and a GELU(tanh) MLP.
The SUBS output parameterisation (:func:`subs_log_probs`) lives here too, so that every diffusion
model turns logits into log-probabilities identically.
"""

from __future__ import annotations

from typing import Any, TypeVar

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ModuleT = TypeVar("ModuleT", bound=nn.Module)

NEG_INF: float = -1e6
"""Stand-in for log 0 in SUBS log-probabilities.

A large finite negative rather than ``-inf`` so that expressions such as ``p * log p`` or a
gathered log-probability of the mask token stay NaN-free; ``exp(NEG_INF)`` is exactly 0 in
float32, so probabilities are unaffected.
"""


# ------------------------------------------------------------------------------- output parameter
def remove_mask_log_probs(logits: Tensor, mask_token_id: int | None) -> Tensor:
    """Float32 ``log_softmax`` over the vocabulary (..., V) with the mask token (if any) at :data:`NEG_INF`.

    On the (n, V) logits of the n masked positions a sampler decodes this step, these are the rows
    :func:`subs_log_probs` gives there (x_theta at masked positions), computed without the others.
    """
    logits = logits.float()
    if mask_token_id is not None:
        mask_column = torch.tensor([mask_token_id], device=logits.device)
        logits = logits.index_fill(-1, mask_column, NEG_INF)
    return logits.log_softmax(dim=-1)


masked_log_probs = remove_mask_log_probs  # the name the output layer (tadm.nn.base) calls on decoded rows


def subs_log_probs(logits: Tensor, z_t: Tensor, mask_token_id: int) -> Tensor:
    """SUBS parameterisation of MDLM (zero masking probabilities + carry-over unmasking).

    The mask token gets zero probability, the rest is a softmax in float32, and every position
    already unmasked in ``z_t`` is a point mass on its token (the reverse process never changes
    it; see Eq. (mdlm-posterior-unk)). log 0 is represented by :data:`NEG_INF`.

    Args:
        logits: (B, L, V) raw network outputs.
        z_t: (B, L) current token ids.
        mask_token_id: index of the mask token in the vocabulary.

    Returns:
        (B, L, V) float32 log-probabilities; rows sum to one in probability space.
    """
    log_probs = remove_mask_log_probs(logits, mask_token_id)  # (B, L, V)
    unmasked = (z_t != mask_token_id).unsqueeze(-1)  # (B, L, 1)
    log_probs = log_probs.masked_fill(unmasked, NEG_INF)  # (B, L, V)
    index = z_t.unsqueeze(-1)  # (B, L, 1)
    # Unmasked rows get log 1 = 0 at their token; masked rows (index = mask id) keep their value.
    at_index = torch.where(unmasked, torch.zeros((), device=logits.device), log_probs.gather(-1, index))
    return log_probs.scatter(-1, index, at_index)  # (B, L, V)


# -------------------------------------------------------------------------------------- embeddings
class RotaryEmbedding(nn.Module):
    """Rotary position tables (RoFormer) in the rotate-half layout.

    The module has no parameters. ``forward(L)`` returns float32 ``(cos, sin)``, each (L, head_dim),
    cached for the last (length, device, inference-mode) requested.
    """

    def __init__(self, head_dim: int, base: float = 10_000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        self._cache: tuple[tuple, tuple[Tensor, Tensor]] | None = None

    def forward(self, seq_len: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        device = torch.device(device) if device is not None else torch.device("cpu")
        # Tables built under inference_mode cannot be saved for backward later, so they are keyed apart.
        key = (seq_len, device, torch.is_inference_mode_enabled())
        if self._cache is None or self._cache[0] != key:
            exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
            inv_freq = self.base**-exponents  # (hd/2,)
            positions = torch.arange(seq_len, device=device, dtype=torch.float32)  # (L,)
            angles = torch.outer(positions, inv_freq)  # (L, hd/2)
            angles = torch.cat([angles, angles], dim=-1)  # (L, hd)
            self._cache = (key, (angles.cos(), angles.sin()))
        return self._cache[1]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., L, hd) by position: pairs (x_i, x_{i+hd/2}) turn by angle pos * theta_i."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (L, hd)
    x1, x2 = x.chunk(2, dim=-1)  # each (..., L, hd/2)
    rotated = torch.cat([-x2, x1], dim=-1)  # (..., L, hd)
    return x * cos + rotated * sin


TIME_INPUTS: tuple[str, ...] = ("t", "sigma-loglinear")
"""What a time-conditioned network embeds: the diffusion time t itself (tadm's models), or MDLM's total noise
sigma(t) = -log(1 - (1 - 1e-3) t) of the log-linear schedule (what the released MDLM / DUO code feeds its DiT)."""

MDLM_LOGLINEAR_EPS: float = 1e-3  # eps of MDLM's LogLinearNoise: alpha_t = 1 - (1 - eps) t


def check_time_input(owner: str, value: object) -> str:
    """``value`` if it names a :data:`TIME_INPUTS` entry, else a ValueError naming ``owner`` and the valid ones."""
    if value not in TIME_INPUTS:
        raise ValueError(f"{owner}.time_input must be one of {', '.join(map(repr, TIME_INPUTS))}, got {value!r}")
    return str(value)


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of a scalar time (256 frequencies) followed by an MLP to ``cond_dim``.

    Features are ``[cos(s w_k), sin(s w_k)]`` with ``w_k = max_period^(-k/half)``, as in DiT, where
    ``s`` is the time t itself (``time_input="t"``) or MDLM's log-linear total noise
    sigma(t) = -log(1 - (1 - 1e-3) t) (``time_input="sigma-loglinear"``, as the released MDLM code
    conditions its DiT; sigma(0) = 0, so an unconditioned network sees zeros either way).
    """

    def __init__(
        self, cond_dim: int, frequency_size: int = 256, max_period: float = 10_000.0, time_input: str = "t"
    ) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.max_period = max_period
        self.time_input = check_time_input("TimestepEmbedder", time_input)
        self.mlp = nn.Sequential(
            nn.Linear(frequency_size, cond_dim),
            nn.SiLU(),
            nn.Linear(cond_dim, cond_dim),
        )

    @staticmethod
    def sinusoidal(t: Tensor, dim: int, max_period: float = 10_000.0) -> Tensor:
        """(B,) times -> (B, dim) float32 sinusoidal features."""
        half = dim // 2
        k = torch.arange(half, device=t.device, dtype=torch.float32)  # (half,)
        freqs = torch.exp(-math.log(max_period) * k / half)  # (half,)
        args = t.float()[:, None] * freqs[None, :]  # (B, half)
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (B, 2 * half)
        if dim % 2:
            features = F.pad(features, (0, 1))  # (B, dim)
        return features

    def forward(self, t: Tensor) -> Tensor:
        """(B,) times -> (B, cond_dim)."""
        if self.time_input == "sigma-loglinear":
            t = -torch.log1p(-(1.0 - MDLM_LOGLINEAR_EPS) * t.float())  # (B,) sigma(t)
        features = self.sinusoidal(t, self.frequency_size, self.max_period)  # (B, 256)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


def time_condition(
    embedder: TimestepEmbedder, t: Tensor | None, batch_size: int, device: torch.device, enabled: bool
) -> Tensor:
    """Conditioning vector SiLU(embedder(t)) of shape (B, cond_dim), as MDLM feeds its DiT.

    Without time conditioning (``enabled`` False) or without ``t``, the embedder sees zeros, so
    the adaLN parameters exist (and count) but carry no time information.
    ``t`` may be a scalar, (B,) or (B, 1).
    """
    if not enabled or t is None:
        t = torch.zeros(batch_size, device=device)
    else:
        t = torch.as_tensor(t, device=device).reshape(-1)  # (B,) or (1,)
        if t.numel() == 1:
            t = t.expand(batch_size)  # (B,)
        elif t.numel() != batch_size:
            raise ValueError(f"t must have one time per sequence ({batch_size}), got shape {tuple(t.shape)}")
    return F.silu(embedder(t))  # (B, cond_dim)


# ------------------------------------------------------------------------------------------ blocks
def zero_init(module: ModuleT) -> ModuleT:
    """``module`` with every parameter zeroed: adaLN-zero, and layers whose output starts at exactly 0."""
    for parameter in module.parameters():
        nn.init.zeros_(parameter)
    return module


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulation x * (1 + scale) + shift; shift/scale (B, 1, D) broadcast over positions."""
    return x * (1 + scale) + shift


class DiTBlock(nn.Module):
    """One DiT block with adaLN-zero modulation (MDLM's DDiTBlock).

    ``x + gate_msa * Attn(modulate(LN(x)))`` then ``x + gate_mlp * MLP(modulate(LN(x)))``, where
    shift/scale/gate for both halves come from one zero-initialised ``Linear(cond_dim, 6d)``; at
    initialisation every gate is 0, so the block is the identity.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        cond_dim: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        causal: bool = False,
    ) -> None:
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.causal = causal
        self.norm1 = nn.LayerNorm(hidden_size, bias=False)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.attn_out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm2 = nn.LayerNorm(hidden_size, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, mlp_ratio * hidden_size),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * hidden_size, hidden_size),
        )
        self.dropout = nn.Dropout(dropout)
        self.adaLN_modulation = zero_init(nn.Linear(cond_dim, 6 * hidden_size))

    def forward(self, x: Tensor, cond: Tensor, rotary: tuple[Tensor, Tensor]) -> Tensor:
        """x (B, L, D), cond (B, cond_dim), rotary = (cos, sin) each (L, head_dim) -> (B, L, D)."""
        B, L, D = x.shape
        modulation = self.adaLN_modulation(cond)[:, None, :]  # (B, 1, 6D)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation.chunk(6, dim=-1)  # (B, 1, D)

        h = modulate(self.norm1(x), shift_msa, scale_msa)  # (B, L, D)
        qkv = self.qkv(h).view(B, L, 3, self.num_heads, self.head_dim)  # (B, L, 3, H, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, L, hd)
        cos, sin = rotary
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # (B, H, L, hd)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, H, L, hd)
        attn = attn.transpose(1, 2).reshape(B, L, D)  # (B, L, D)
        x = x + gate_msa * self.dropout(self.attn_out(attn))  # (B, L, D)

        h = modulate(self.norm2(x), shift_mlp, scale_mlp)  # (B, L, D)
        return x + gate_mlp * self.dropout(self.mlp(h))  # (B, L, D)


class FinalLayer(nn.Module):
    """Output head: weight-only LayerNorm, adaLN (shift, scale) and a zero-initialised Linear(d, out_dim)."""

    def __init__(self, hidden_size: int, out_dim: int, cond_dim: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, bias=False)
        self.linear = zero_init(nn.Linear(hidden_size, out_dim))
        self.adaLN_modulation = zero_init(nn.Linear(cond_dim, 2 * hidden_size))

    def forward(self, x: Tensor, cond: Tensor, rows: Tensor | None = None) -> Tensor:
        """x (B, L, D), cond (B, cond_dim) -> (B, L, out_dim); with ``rows`` (n, 2) of (batch, position)
        pairs, only those positions: (n, out_dim), the same rows as the full output's."""
        shift, scale = self.adaLN_modulation(cond)[:, None, :].chunk(2, dim=-1)  # each (B, 1, D)
        if rows is not None:
            x = x[rows[:, 0], rows[:, 1]]  # (n, D)
            shift, scale = shift[rows[:, 0], 0], scale[rows[:, 0], 0]  # each (n, D)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def stack_kwargs(config: Any) -> dict[str, Any]:
    """The DiTStack size arguments shared by every model config (hidden size, heads, cond dim, MLP ratio, dropout)."""
    return dict(
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        cond_dim=config.cond_dim,
        mlp_ratio=config.mlp_ratio,
        dropout=config.dropout,
    )


class DiTStack(nn.Module):
    """``num_layers`` DiT blocks applied in order, sharing one rotary table."""

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        cond_dim: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(hidden_size // num_heads)
        self.blocks = nn.ModuleList(
            DiTBlock(hidden_size, num_heads, cond_dim, mlp_ratio, dropout, causal) for _ in range(num_layers)
        )

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        """x (B, L, D), cond (B, cond_dim) -> (B, L, D)."""
        rotary = self.rotary(x.shape[1], x.device)  # (L, hd) each
        for block in self.blocks:
            x = block(x, cond, rotary)
        return x


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """Token embedding initialised like MDLM's (Kaiming-uniform with a = sqrt(5) on the (V, D) table)."""
    embedding = nn.Embedding(vocab_size, hidden_size)
    nn.init.kaiming_uniform_(embedding.weight, a=math.sqrt(5))
    return embedding
