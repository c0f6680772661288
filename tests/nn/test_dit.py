"""DiT pieces: rotary, timestep features, DiT block and output layer, SUBS."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from tadm.nn.dit import (
    NEG_INF,
    DiTBlock,
    DiTStack,
    FinalLayer,
    RotaryEmbedding,
    TimestepEmbedder,
    apply_rotary,
    remove_mask_log_probs,
    subs_log_probs,
    time_condition,
)


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def rotate_complex(x: torch.Tensor, base: float = 10_000.0) -> torch.Tensor:
    """Reference rotary: pair (x_i, x_{i+hd/2}) as a complex number times exp(i * pos * theta_i)."""
    L, hd = x.shape[-2], x.shape[-1]
    theta = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
    angle = torch.arange(L, dtype=torch.float64)[:, None] * theta[None, :]  # (L, hd/2)
    z = torch.complex(x[..., : hd // 2].double(), x[..., hd // 2 :].double()) * torch.exp(1j * angle)
    return torch.cat([z.real, z.imag], dim=-1)


# -------------------------------------------------------------------------------------------- rotary
def test_rotary_preserves_norms() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 11, 8, generator=g)  # (B, H, L, hd)
    cos, sin = RotaryEmbedding(8)(11)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(y[..., 1:, :], x[..., 1:, :])  # it does rotate beyond position 0
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :])  # position 0 is not rotated


def test_rotary_matches_complex_rotation_and_is_relative() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 13, 16, generator=g)  # (B, L, hd)
    cos, sin = RotaryEmbedding(16)(13)
    torch.testing.assert_close(apply_rotary(x, cos, sin).double(), rotate_complex(x), atol=1e-5, rtol=1e-5)
    # The same q and k placed everywhere: <R_m q, R_n k> depends on m - n only.
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)
    rq = apply_rotary(q.expand(13, 16), cos, sin)  # (L, hd)
    rk = apply_rotary(k.expand(13, 16), cos, sin)  # (L, hd)
    scores = rq @ rk.T  # (L, L)
    for offset in range(-3, 4):
        diagonal = torch.diagonal(scores, offset)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), atol=1e-4, rtol=1e-4)


def test_rotary_rejects_odd_head_dim() -> None:
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)


def test_rotary_tables_from_inference_mode_do_not_break_training() -> None:
    stack = randomize(DiTStack(1, 8, 2, 4))
    reference = copy.deepcopy(stack)  # never sees inference mode
    x, cond = torch.randn(1, 5, 8), torch.randn(1, 4)
    with torch.inference_mode():
        stack(x, cond)
    stack(x, cond).sum().backward()  # raises if inference-mode tables were reused
    reference(x, cond).sum().backward()
    grad, expected = stack.blocks[0].qkv.weight.grad, reference.blocks[0].qkv.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    torch.testing.assert_close(grad, expected)


# ------------------------------------------------------------------------------------------ timestep
def test_timestep_features_match_hand_computation() -> None:
    t = torch.tensor([0.0, 0.5, 3.0])
    features = TimestepEmbedder.sinusoidal(t, 256)
    assert features.shape == (3, 256)
    for row, tv in enumerate(t.tolist()):
        for k in (0, 1, 17, 127):
            w = 10_000.0 ** (-k / 128)
            assert features[row, k].item() == pytest.approx(math.cos(tv * w), abs=1e-6)
            assert features[row, 128 + k].item() == pytest.approx(math.sin(tv * w), abs=1e-6)
    embedder = TimestepEmbedder(16)
    assert embedder(t).shape == (3, 16)
    assert [m.__class__.__name__ for m in embedder.mlp] == ["Linear", "SiLU", "Linear"]
    assert embedder.mlp[0].in_features == 256


def test_time_condition_off_ignores_t() -> None:
    embedder = randomize(TimestepEmbedder(8))
    zeros = F.silu(embedder(torch.zeros(3)))
    off = time_condition(embedder, torch.tensor([0.1, 0.5, 0.9]), 3, torch.device("cpu"), enabled=False)
    none = time_condition(embedder, None, 3, torch.device("cpu"), enabled=True)
    torch.testing.assert_close(off, zeros)
    torch.testing.assert_close(none, zeros)
    on = time_condition(embedder, torch.tensor([0.1, 0.5, 0.9]), 3, torch.device("cpu"), enabled=True)
    assert not torch.allclose(on, zeros)
    scalar = time_condition(embedder, torch.tensor(0.5), 3, torch.device("cpu"), enabled=True)
    torch.testing.assert_close(scalar, F.silu(embedder(torch.full((3,), 0.5))))
    with pytest.raises(ValueError, match="one time per sequence"):
        time_condition(embedder, torch.zeros(2), 3, torch.device("cpu"), enabled=True)


# --------------------------------------------------------------------------------------------- block
def reference_block(block: DiTBlock, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """The DiT block written out in float64 with explicit per-head softmax attention."""
    p = {k: v.double() for k, v in block.state_dict().items()}
    x, cond = x.double(), cond.double()
    B, L, D = x.shape
    H, hd = block.num_heads, D // block.num_heads

    def ln(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        mu = v.mean(-1, keepdim=True)
        var = ((v - mu) ** 2).mean(-1, keepdim=True)
        return (v - mu) / torch.sqrt(var + 1e-5) * w

    mod = cond @ p["adaLN_modulation.weight"].T + p["adaLN_modulation.bias"]  # (B, 6D)
    sm, scm, gm, sp, scp, gp = (m[:, None, :] for m in mod.split(D, dim=-1))
    h = ln(x, p["norm1.weight"]) * (1 + scm) + sm
    q, k, v = (h @ p["qkv.weight"].T).split(D, dim=-1)  # (B, L, D) each
    attn = torch.zeros(B, L, D, dtype=torch.float64)
    for b in range(B):
        for head in range(H):
            cols = slice(head * hd, (head + 1) * hd)
            qh, kh = rotate_complex(q[b, :, cols]), rotate_complex(k[b, :, cols])
            scores = qh @ kh.T / math.sqrt(hd)  # (L, L)
            if block.causal:
                scores = scores.masked_fill(torch.ones(L, L).triu(1).bool(), float("-inf"))
            attn[b, :, cols] = scores.softmax(-1) @ v[b, :, cols]
    x = x + gm * (attn @ p["attn_out.weight"].T)
    h = ln(x, p["norm2.weight"]) * (1 + scp) + sp
    mlp = F.gelu(h @ p["mlp.0.weight"].T + p["mlp.0.bias"], approximate="tanh") @ p["mlp.2.weight"].T + p["mlp.2.bias"]
    return x + gp * mlp


def run_block(block: DiTBlock, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    return block(x, cond, RotaryEmbedding(block.head_dim)(x.shape[1]))


def test_block_at_init_is_identity() -> None:
    block = DiTBlock(16, 2, 8, dropout=0.5)
    assert torch.count_nonzero(block.adaLN_modulation.weight) == 0
    assert torch.count_nonzero(block.adaLN_modulation.bias) == 0
    x, cond = torch.randn(2, 7, 16), torch.randn(2, 8)
    block.train()
    assert torch.equal(run_block(block, x, cond), x)


@pytest.mark.parametrize("causal", [False, True])
def test_block_matches_reference(causal: bool) -> None:
    block = randomize(DiTBlock(16, 2, 8, causal=causal), seed=3).eval()
    g = torch.Generator().manual_seed(4)
    x, cond = torch.randn(2, 6, 16, generator=g), torch.randn(2, 8, generator=g)
    out = run_block(block, x, cond)
    assert out.shape == (2, 6, 16)
    torch.testing.assert_close(out.double(), reference_block(block, x, cond), atol=1e-4, rtol=1e-4)


def test_parameter_layout() -> None:
    block = DiTBlock(16, 2, 8)
    assert block.norm1.bias is None and block.norm2.bias is None
    assert block.qkv.bias is None and block.attn_out.bias is None
    assert block.mlp[0].bias is not None and block.mlp[0].out_features == 64
    assert block.adaLN_modulation.out_features == 6 * 16
    with pytest.raises(ValueError, match="divisible"):
        DiTBlock(10, 3, 4)


def test_causal_attention_does_not_look_ahead() -> None:
    g = torch.Generator().manual_seed(5)
    x, cond = torch.randn(1, 9, 16, generator=g), torch.randn(1, 8, generator=g)
    x2 = x.clone()
    x2[:, 6] += torch.randn(16, generator=g)  # perturb one token (not by a constant: LayerNorm removes that)
    causal = randomize(DiTBlock(16, 2, 8, causal=True), seed=6)
    a, b = run_block(causal, x, cond), run_block(causal, x2, cond)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-4)  # later tokens see it through attention
    bidirectional = randomize(DiTBlock(16, 2, 8, causal=False), seed=6)
    a, b = run_block(bidirectional, x, cond), run_block(bidirectional, x2, cond)
    assert not torch.allclose(a[:, :6], b[:, :6], atol=1e-4)  # so the check above can fail


def test_final_layer_zero_init_and_formula() -> None:
    layer = FinalLayer(16, 5, 8)
    x, cond = torch.randn(2, 3, 16), torch.randn(2, 8)
    assert torch.equal(layer(x, cond), torch.zeros(2, 3, 5))
    randomize(layer, seed=7)
    shift, scale = (cond @ layer.adaLN_modulation.weight.T + layer.adaLN_modulation.bias).chunk(2, dim=-1)
    normed = F.layer_norm(x, (16,), layer.norm_final.weight)
    expected = (normed * (1 + scale[:, None]) + shift[:, None]) @ layer.linear.weight.T + layer.linear.bias
    torch.testing.assert_close(layer(x, cond), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- SUBS
def test_subs_log_probs_by_hand() -> None:
    mask = 3
    logits = torch.tensor([[[1.0, 2.0, 0.5, 9.0], [0.0, 0.0, 0.0, 5.0], [1.0, -1.0, 2.0, 0.0]]])  # (1, 3, 4)
    z_t = torch.tensor([[mask, 1, mask]])
    out = subs_log_probs(logits, z_t, mask)
    assert out.dtype == torch.float32 and out.shape == (1, 3, 4)
    # Masked rows: softmax over the non-mask tokens only.
    for row in (0, 2):
        expected = torch.log_softmax(logits[0, row, :3], dim=-1)
        torch.testing.assert_close(out[0, row, :3], expected)
        assert out[0, row, mask].item() < NEG_INF / 2
    # Unmasked row: point mass on its token.
    assert out[0, 1, 1].item() == 0.0
    assert (out[0, 1, [0, 2, 3]] <= NEG_INF).all()
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(1, 3))
    assert torch.isfinite(out).all() and not torch.isnan(out.exp() * out).any()


def test_subs_gradient_only_through_masked_rows() -> None:
    logits = torch.randn(1, 4, 6, requires_grad=True)
    z_t = torch.tensor([[5, 2, 5, 0]])
    subs_log_probs(logits, z_t, 5).sum().backward()
    assert torch.count_nonzero(logits.grad[0, 1]) == 0 and torch.count_nonzero(logits.grad[0, 3]) == 0
    assert torch.count_nonzero(logits.grad[0, 0]) > 0


def test_remove_mask_log_probs() -> None:
    logits = torch.randn(2, 3, 6)
    out = remove_mask_log_probs(logits, 2)
    assert (out[..., 2] < NEG_INF / 2).all()
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2, 3))
    torch.testing.assert_close(remove_mask_log_probs(logits, None), logits.log_softmax(-1))
