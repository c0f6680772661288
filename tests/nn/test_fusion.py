"""Fusion modules: gated residual (pretraining) and paired attention (post-training)."""

import math

import pytest
import torch
import torch.nn.functional as F

from tadm.nn.fusion import GatedResidualFusion, PairedAttentionFusion


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def inputs(*shape: int, n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * 2 + 0.5 for _ in range(n)]


# ------------------------------------------------------------------------------------ gated residual
def test_gated_fusion_at_init_is_layernorm_of_anchor() -> None:
    fusion = GatedResidualFusion(16)
    c, h = inputs(2, 5, 16, n=2)
    assert torch.count_nonzero(fusion.delta_out.weight) == 0 and torch.count_nonzero(fusion.delta_out.bias) == 0
    assert torch.equal(fusion(c, h), fusion.norm_out(h))
    # Still exact with non-trivial LayerNorm affine parameters everywhere else.
    randomize(fusion, seed=2)
    with torch.no_grad():
        fusion.delta_out.weight.zero_()
        fusion.delta_out.bias.zero_()
    assert torch.equal(fusion(c, h), fusion.norm_out(h))
    assert not torch.allclose(fusion(c, h), F.layer_norm(h, (16,)))  # the output LN is really applied


def test_gated_fusion_matches_formula_after_training_starts() -> None:
    fusion = GatedResidualFusion(8)
    c, h = inputs(2, 4, 8, n=2)
    before = fusion(c, h)
    with torch.no_grad():
        fusion.delta_out.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    after = fusion(c, h)
    assert not torch.allclose(before, after)
    g, delta = fusion.gate_and_delta(c, h)
    assert g.shape == delta.shape == (2, 4, 8)
    assert ((g > 0) & (g < 1)).all()
    # Direct computation from the appendix equations.
    u = torch.cat([F.layer_norm(c, (8,), fusion.norm_c.weight, fusion.norm_c.bias),
                   F.layer_norm(h, (8,), fusion.norm_h.weight, fusion.norm_h.bias)], dim=-1)  # (B, L, 16)
    g_ref = torch.sigmoid(u @ fusion.gate.weight.T + fusion.gate.bias)
    hidden = F.gelu(u @ fusion.delta_in.weight.T + fusion.delta_in.bias)  # (B, L, 32)
    delta_ref = hidden @ fusion.delta_out.weight.T + fusion.delta_out.bias
    expected = F.layer_norm(h + g_ref * delta_ref, (8,), fusion.norm_out.weight, fusion.norm_out.bias)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)
    assert fusion.delta_in.out_features == 32 and fusion.gate.in_features == 16


def test_gated_fusion_update_gets_gradient_at_init() -> None:
    fusion = GatedResidualFusion(8)
    c, h = inputs(2, 4, 8, n=2)
    (fusion(c, h) * torch.randn(2, 4, 8)).sum().backward()
    assert torch.count_nonzero(fusion.delta_out.weight.grad) > 0


# ----------------------------------------------------------------------------------- paired attention
def reference_paired(f: PairedAttentionFusion, C, C0, H0, mask=None) -> torch.Tensor:
    """Appendix "TADM:Post-train" equations in float64 with explicit per-head attention."""
    p = {k: v.double() for k, v in f.state_dict().items()}
    C, C0, H0 = C.double(), C0.double(), H0.double()
    s_c = torch.sqrt((C0**2).mean(-1, keepdim=True) + f.eps)
    s_h = torch.sqrt((H0**2).mean(-1, keepdim=True) + f.eps)
    Z, Z0, U = (C / s_c) @ p["proj_c.weight"].T, (C0 / s_c) @ p["proj_c.weight"].T, (H0 / s_h) @ p["proj_h.weight"].T
    B, L, r = Z.shape
    hd = r // f.num_heads

    def phi(z: torch.Tensor) -> torch.Tensor:
        J = torch.cat([z, U], -1)
        Q, K, V = J @ p["q.weight"].T, J @ p["k.weight"].T, J @ p["v.weight"].T
        mha = torch.zeros(B, L, r, dtype=torch.float64)
        for b in range(B):
            for head in range(f.num_heads):
                cols = slice(head * hd, (head + 1) * hd)
                scores = Q[b, :, cols] @ K[b, :, cols].T / math.sqrt(hd)  # (L, L)
                if mask is not None:
                    scores = scores.masked_fill(~mask[b].bool()[None, :], float("-inf"))
                mha[b, :, cols] = scores.softmax(-1) @ V[b, :, cols]
        R = z + mha @ p["attn_out.weight"].T
        return R + F.silu(R @ p["ffn_in.weight"].T) @ p["ffn_out.weight"].T

    M = phi(Z) - phi(Z0)
    feats = torch.cat([U, Z0, Z - Z0, M], -1)
    g = torch.sigmoid(F.silu(feats @ p["gate_in.weight"].T) @ p["gate_out.weight"].T + p["gate_out.bias"])
    return H0 + g * s_h * (M @ p["up.weight"].T)


def test_paired_fusion_matches_reference() -> None:
    f = randomize(PairedAttentionFusion(24, rank=8, num_heads=2), seed=4)
    C, C0, H0 = inputs(2, 6, 24, seed=5)
    torch.testing.assert_close(f(C, C0, H0).double(), reference_paired(f, C, C0, H0), atol=1e-4, rtol=1e-4)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    torch.testing.assert_close(
        f(C, C0, H0, attention_mask=mask).double(), reference_paired(f, C, C0, H0, mask), atol=1e-4, rtol=1e-4
    )


@pytest.mark.slow
def test_paired_fusion_is_exact_when_current_equals_cached() -> None:
    f = randomize(PairedAttentionFusion(24, rank=8, num_heads=2), seed=6)
    assert torch.count_nonzero(f.up.weight) > 0 and torch.count_nonzero(f.gate_out.weight) > 0
    C, _, H0 = inputs(3, 7, 24, seed=7)
    C0 = C.clone()  # equal values, distinct tensors: no short-circuit
    assert C0 is not C
    g, update = f.correction(C, C0, H0)
    assert torch.count_nonzero(update) == 0 and ((g > 0) & (g < 1)).all()
    assert torch.equal(f(C, C0, H0), H0)
    assert torch.equal(f(C, C0, H0, attention_mask=torch.ones(3, 7)), H0)
    assert f(C, C, H0) is H0  # same object: short-circuit
    # A changed canvas does change the anchor.
    C_new = C.clone()
    C_new[:, 2] += torch.randn(24, generator=torch.Generator().manual_seed(8))
    out = f(C_new, C0, H0)
    assert not torch.allclose(out, H0)
    assert not torch.allclose(out[:, 0], H0[:, 0])  # attention spreads the change to other tokens


def test_paired_fusion_initial_gate_and_identity() -> None:
    f = PairedAttentionFusion(24, rank=8, num_heads=2)
    C, C0, H0 = inputs(2, 5, 24, seed=9)
    g, update = f.correction(C, C0, H0)
    assert g.shape == (2, 5, 1) and update.shape == (2, 5, 24)
    torch.testing.assert_close(g, torch.full_like(g, torch.sigmoid(torch.tensor(-3.0)).item()), atol=0, rtol=0)
    assert torch.equal(f(C, C0, H0), H0)  # W_up = 0 at init
    f2 = PairedAttentionFusion(24, rank=8, num_heads=2, gate_bias=1.5)
    g2, _ = f2.correction(C, C0, H0)
    torch.testing.assert_close(g2, torch.full_like(g2, torch.sigmoid(torch.tensor(1.5)).item()), atol=0, rtol=0)


def test_paired_fusion_padding_is_ignored() -> None:
    f = randomize(PairedAttentionFusion(24, rank=8, num_heads=2), seed=10)
    C, C0, H0 = inputs(1, 6, 24, seed=11)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    C_pad = C.clone()
    C_pad[:, 4:] = torch.randn(1, 2, 24)
    a = f(C, C0, H0, attention_mask=mask)
    b = f(C_pad, C0, H0, attention_mask=mask)
    torch.testing.assert_close(a[:, :4], b[:, :4], atol=1e-6, rtol=0)
    c = f(C_pad, C0, H0)  # without the mask the padding leaks in
    assert not torch.allclose(a[:, :4], c[:, :4], atol=1e-4)


def test_paired_fusion_parameter_count_and_adapter_params() -> None:
    with torch.device("meta"):
        f = PairedAttentionFusion(2816, rank=256, num_heads=4)
    n = sum(p.numel() for p in f.parameters())
    print(f"paired-attention fusion parameters (d=2816, r=256, 4 heads): {n:,}")
    # W_C, W_H, W_up: 3 * 2816 * 256; Q, K, V: 3 * 512 * 256; W_O 256^2; FFN 2 * 256 * 512;
    # gate 1024 * 256 + 256 + 1.
    assert n == 3 * 2816 * 256 + 3 * 512 * 256 + 256 * 256 + 2 * 256 * 512 + 1024 * 256 + 257
    assert abs(n - 3.1e6) / 3.1e6 < 0.10
    params = f.adapter_params()
    assert set(params) == {name for name, _ in f.named_parameters()}
    assert sum(p.numel() for p in params.values()) == n
    with pytest.raises(ValueError, match="divisible"):
        PairedAttentionFusion(24, rank=10, num_heads=4)
