"""Fusion modules Phi: correct a cached (stale) anchor with the current-state representation.

* :class:`GatedResidualFusion` - the pretraining fusion (appendix "TADM:Pretrain"), a per-dimension
  gated residual MLP on ``[LN(c_t); LN(h_t')]``, Eq. (stale-anchor-fusion) followed by an output LN.
* :class:`PairedAttentionFusion` - the post-training adapter (appendix "TADM:Post-train"), which
  compares a shared attention mixer evaluated on the current and on the cached shallow state,
  Eq. (paired-attention-difference) and Eq. (stale-anchor-fusion-app).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tadm.nn.dit import zero_init


def _upcast(x: Tensor) -> Tensor:
    """``x`` in float32, or in its own dtype when that is wider (float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class GatedResidualFusion(nn.Module):
    """``h~ = LN(h + g * Delta)`` with ``u = [LN(c); LN(h)]`` (appendix "TADM:Pretrain").

    ``g = sigmoid(W_g u + b_g)`` is a per-token, per-dimension gate and
    ``Delta = W_2 GELU(W_1 u + b_1) + b_2`` with ``W_1: 2d -> 4d`` and ``W_2: 4d -> d``. ``W_2`` and
    ``b_2`` start at zero, so at initialisation the output is exactly ``LN_out(h)``: the stale anchor
    passes to the denoiser uncorrected (Eq. (stale-anchor-fusion), plus the output LayerNorm).
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        d = hidden_size
        self.norm_c = nn.LayerNorm(d)
        self.norm_h = nn.LayerNorm(d)
        self.gate = nn.Linear(2 * d, d)
        self.delta_in = nn.Linear(2 * d, 4 * d)
        self.delta_out = zero_init(nn.Linear(4 * d, d))
        self.norm_out = nn.LayerNorm(d)

    def gate_and_delta(self, c: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """Gate g in (0, 1) and update Delta, each (B, L, D), from c (B, L, D) and h (B, L, D)."""
        u = torch.cat([self.norm_c(c), self.norm_h(h)], dim=-1)  # (B, L, 2D)
        g = torch.sigmoid(self.gate(u))  # (B, L, D)
        delta = self.delta_out(F.gelu(self.delta_in(u)))  # (B, L, D)
        return g, delta

    def forward(self, c: Tensor, h: Tensor) -> Tensor:
        """Current state c (B, L, D) and cached anchor h (B, L, D) -> fused anchor (B, L, D)."""
        g, delta = self.gate_and_delta(c, h)
        return self.norm_out(h + g * delta)


class PairedAttentionFusion(nn.Module):
    """Paired-attention adapter for a split pretrained backbone (appendix "TADM:Post-train").

    Given the current shallow state ``C``, the shallow state ``C0`` cached with the anchor, and the
    cached deep anchor ``H0`` (all (B, L, d)):

    * RMS scales ``s_C`` from ``C0`` and ``s_H`` from ``H0`` per token;
      ``Z = (C/s_C) W_C``, ``Z0 = (C0/s_C) W_C``, ``U = (H0/s_H) W_H`` (rank r);
    * mixer ``phi(Z, U)``: attention with Q, K, V from ``[Z, U]``, ``R = Z + MHA W_O``,
      ``phi = R + SiLU(R W_1) W_2``;
    * ``M = phi(Z, U) - phi(Z0, U)``, Eq. (paired-attention-difference);
    * scalar gate per token ``g = sigmoid(SiLU([U; Z0; Z - Z0; M] W_g1) W_g2 + b_g)``;
    * ``H~ = H0 + g * s_H * (M W_up)``, Eq. (stale-anchor-fusion-app).

    Both mixer branches run through identical arithmetic, so ``C == C0`` gives ``M == 0`` and
    ``H~ == H0`` bit for bit. ``W_up`` starts at zero (the adapter starts as the identity on H0);
    ``W_g2`` also starts at zero so the gate starts at exactly ``sigmoid(gate_bias)`` on every token.
    """

    def __init__(
        self,
        hidden_size: int,
        rank: int = 256,
        num_heads: int = 4,
        eps: float = 1e-6,
        gate_bias: float = -3.0,
    ) -> None:
        super().__init__()
        if rank % num_heads != 0:
            raise ValueError(f"rank {rank} is not divisible by num_heads {num_heads}")
        self.hidden_size = hidden_size
        self.rank = rank
        self.num_heads = num_heads
        self.eps = eps
        self.gate_bias = gate_bias
        r = rank
        self.proj_c = nn.Linear(hidden_size, r, bias=False)  # W_C
        self.proj_h = nn.Linear(hidden_size, r, bias=False)  # W_H
        self.q = nn.Linear(2 * r, r, bias=False)
        self.k = nn.Linear(2 * r, r, bias=False)
        self.v = nn.Linear(2 * r, r, bias=False)
        self.attn_out = nn.Linear(r, r, bias=False)  # W_O
        self.ffn_in = nn.Linear(r, 2 * r, bias=False)  # W_1
        self.ffn_out = nn.Linear(2 * r, r, bias=False)  # W_2
        self.gate_in = nn.Linear(4 * r, r, bias=False)  # W_g1
        self.gate_out = nn.Linear(r, 1)  # W_g2, b_g
        nn.init.zeros_(self.gate_out.weight)
        nn.init.constant_(self.gate_out.bias, gate_bias)
        self.up = zero_init(nn.Linear(r, hidden_size, bias=False))  # W_up

    def reset_parameters(self) -> None:
        """Draw the initial adapter again: default linear layers, ``W_up = 0`` (the identity on H0), ``W_g2 = 0``
        and ``b_g = gate_bias`` (the gate starts at ``sigmoid(gate_bias)``), as the constructor does."""
        for module in self.children():
            module.reset_parameters()
        nn.init.zeros_(self.gate_out.weight)
        nn.init.constant_(self.gate_out.bias, self.gate_bias)
        nn.init.zeros_(self.up.weight)

    def adapter_params(self) -> dict[str, nn.Parameter]:
        """All trainable parameters of the adapter, by name (they are saved apart from the backbone)."""
        return dict(self.named_parameters())

    def rms(self, x: Tensor) -> Tensor:
        """Tokenwise RMS scale sqrt(mean(x^2) + eps), at least in float32: (B, L, d) -> (B, L, 1)."""
        return _upcast(x).pow(2).mean(dim=-1, keepdim=True).add(self.eps).sqrt()

    def mixer(self, z: Tensor, u: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """phi(Z, U): z, u (B, L, r) -> (B, L, r); ``attention_mask`` (B, L), True/1 = real token."""
        B, L, r = z.shape
        H, hd = self.num_heads, r // self.num_heads
        j = torch.cat([z, u], dim=-1)  # (B, L, 2r)
        q, k, v = (proj(j).view(B, L, H, hd).transpose(1, 2) for proj in (self.q, self.k, self.v))  # (B, H, L, hd)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, L) keys to attend
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, L, hd)
        attn = attn.transpose(1, 2).reshape(B, L, r)  # (B, L, r)
        res = z + self.attn_out(attn)  # (B, L, r)
        return res + self.ffn_out(F.silu(self.ffn_in(res)))  # (B, L, r)

    def correction(
        self, C: Tensor, C0: Tensor, H0: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Gate g (B, L, 1) and unscaled-by-gate update s_H * (M W_up) (B, L, d); H~ = H0 + g * update."""
        dtype = self.proj_c.weight.dtype
        s_c = self.rms(C0)  # (B, L, 1)
        s_h = self.rms(H0)  # (B, L, 1)
        # Both shallow branches share the cached-state scale and projection, so C == C0 gives Z == Z0.
        z = self.proj_c((_upcast(C) / s_c).to(dtype))  # (B, L, r)
        z0 = self.proj_c((_upcast(C0) / s_c).to(dtype))  # (B, L, r)
        u = self.proj_h((_upcast(H0) / s_h).to(dtype))  # (B, L, r)
        # Two separate, same-shaped calls: identical inputs give bitwise identical outputs.
        m = self.mixer(z, u, attention_mask) - self.mixer(z0, u, attention_mask)  # (B, L, r)
        features = torch.cat([u, z0, z - z0, m], dim=-1)  # (B, L, 4r)
        g = torch.sigmoid(self.gate_out(F.silu(self.gate_in(features))))  # (B, L, 1)
        update = s_h.to(dtype) * self.up(m)  # (B, L, d)
        return g, update

    def forward(self, C: Tensor, C0: Tensor, H0: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Fused anchor H~ (B, L, d) from current C, cached C0 and cached H0 (each (B, L, d)).

        ``attention_mask`` (B, L) marks real tokens (True/1); padded keys are ignored by the mixer.
        Every sequence needs at least one real token.
        """
        if C is C0:  # a fresh anchor: M = 0 exactly
            return H0
        g, update = self.correction(C, C0, H0, attention_mask)
        return H0 + (g * update).to(H0.dtype)
