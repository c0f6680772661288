"""Baselines: MDLM, ADLM (naive anchor reuse) and the causal AR Transformer."""

import pytest
import torch

from tadm.nn.baselines import (
    ADLM,
    MDLM,
    ADLMConfig,
    ARConfig,
    MDLMConfig,
    adlm_small,
    adlm_tiny,
    ar_small,
    ar_tiny,
    mdlm_small,
    mdlm_tiny,
)
from tadm.nn.dit import NEG_INF, DiTBlock
from tadm.protocol import CacheableDenoiser, LayerSplit

MASK = 64


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module.eval()


def canvas(seed: int = 1, B: int = 2, L: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(0, MASK, (B, L), generator=g)
    z[torch.rand(B, L, generator=g) < 0.5] = MASK
    z[:, 0], z[:, 1] = MASK, 7
    return z


def assert_subs(lp: torch.Tensor, z: torch.Tensor) -> None:
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(z.shape), atol=1e-5, rtol=0)
    assert (lp[..., MASK] < NEG_INF / 2).all()
    unmasked = z != MASK
    assert (lp[unmasked].gather(-1, z[unmasked][:, None]) == 0).all()
    assert (lp[unmasked].exp().sum(-1) == 1).all()
    assert lp[~unmasked][:, :MASK].std() > 0


def block_calls(model: torch.nn.Module, fn) -> int:
    calls = [0]
    handles = [
        m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for m in model.modules()
        if isinstance(m, DiTBlock)
    ]
    fn()
    for h in handles:
        h.remove()
    return calls[0]


# -------------------------------------------------------------------------------------------- MDLM
def test_mdlm_shapes_subs_and_protocol() -> None:
    model = randomize(mdlm_tiny(), seed=1)
    assert isinstance(model, CacheableDenoiser)
    assert model.layer_split == LayerSplit(0, 0, 3)
    z = canvas()
    lp = model(z)
    assert lp.shape == (2, 10, 65)
    assert_subs(lp, z)


@pytest.mark.slow
def test_mdlm_cache_is_a_no_op() -> None:
    model = randomize(mdlm_tiny(), seed=2)
    z, z_old = canvas(seed=3), canvas(seed=4)
    c = model.encode(z)
    assert model.compute_anchor(c) is c
    stale = model.compute_anchor(model.encode(z_old))
    torch.testing.assert_close(model.predict(z, c, stale), model(z))  # anchor ignored
    assert block_calls(model, lambda: model.compute_anchor(c)) == model.layer_split.anchor == 0
    assert block_calls(model, lambda: model.predict(z, c, c)) == model.layer_split.denoiser == 3


@pytest.mark.slow
def test_mdlm_time_conditioning() -> None:
    z = canvas(seed=5)
    t1, t2 = torch.tensor([0.1, 0.8]), torch.tensor([0.5, 0.3])
    off = randomize(mdlm_tiny(), seed=6)
    torch.testing.assert_close(off(z, t1), off(z, t2))
    on = randomize(mdlm_tiny(time_conditioning=True), seed=6)
    assert not torch.allclose(on(z, t1), on(z, t2))


# -------------------------------------------------------------------------------------------- ADLM
@pytest.mark.slow
def test_adlm_shapes_subs_and_anchor_distribution() -> None:
    model = randomize(adlm_tiny(), seed=7)
    assert isinstance(model, CacheableDenoiser)
    assert model.layer_split == LayerSplit(0, 2, 1)
    z = canvas(seed=8)
    lp, anchor_lp = model(z)
    assert lp.shape == anchor_lp.shape == (2, 10, 65)
    assert_subs(lp, z)
    torch.testing.assert_close(anchor_lp.logsumexp(-1), torch.zeros(2, 10), atol=1e-5, rtol=0)
    assert (anchor_lp[..., MASK] < NEG_INF / 2).all()
    # The anchor representation is the linear projection of the anchor probabilities.
    y = model.compute_anchor(model.encode(z))
    expected = anchor_lp.exp() @ model.anchor_proj.weight.T + model.anchor_proj.bias
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_adlm_naive_reuse() -> None:
    model = randomize(adlm_tiny(), seed=9)
    z = canvas(seed=10)
    lp, _ = model(z)
    cached = model.compute_anchor(model.encode(z))
    # A cached anchor from the same z reproduces the forward pass ...
    torch.testing.assert_close(model.predict(z, model.encode(z), cached), lp)
    # ... and a stale one is reused as-is: the current state does not enter the denoiser.
    z_new = z.clone()
    z_new[:, 0] = 3
    stale = model.predict(z_new, model.encode(z_new), cached)
    other_c = torch.randn_like(model.encode(z_new))
    torch.testing.assert_close(model.predict(z_new, other_c, cached), stale)
    fresh, _ = model(z_new)
    assert not torch.allclose(stale[:, 1:], fresh[:, 1:])
    assert block_calls(model, lambda: model.compute_anchor(model.encode(z))) == 2
    assert block_calls(model, lambda: model.predict(z, None, cached)) == 1


# ---------------------------------------------------------------------------------------------- AR
@pytest.mark.slow
def test_ar_shapes_and_causality() -> None:
    model = randomize(ar_tiny(), seed=11)
    assert model.config.vocab_size == 64
    g = torch.Generator().manual_seed(12)
    x = torch.randint(0, 64, (2, 10), generator=g)
    logits = model(x)
    assert logits.shape == (2, 10, 64) and logits.dtype == torch.float32
    x2 = x.clone()
    x2[:, 6] = (x2[:, 6] + 1) % 64
    logits2 = model(x2)
    torch.testing.assert_close(logits[:, :6], logits2[:, :6], atol=1e-5, rtol=0)
    assert not torch.allclose(logits[:, 6:], logits2[:, 6:], atol=1e-3)
    assert all(block.causal for block in model.blocks.blocks)


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("cls", "overrides", "field"),
    [
        (MDLMConfig, dict(num_layers=0), "num_layers"),
        (MDLMConfig, dict(mask_token_id=99, vocab_size=10), "mask_token_id"),
        (MDLMConfig, dict(hidden_size=10, num_heads=3), "hidden_size"),
        (ADLMConfig, dict(anchor_layers=0), "anchor_layers"),
        (ADLMConfig, dict(dropout=-0.1), "dropout"),
        (ADLMConfig, dict(time_conditioning="no"), "time_conditioning"),
        (ARConfig, dict(vocab_size=0), "vocab_size"),
        (ARConfig, dict(num_layers=1.0), "num_layers"),
    ],
)
def test_config_validation(cls: type, overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**overrides)


def test_max_seq_len_enforced() -> None:
    for model in (mdlm_tiny(), adlm_tiny(), ar_tiny()):
        with pytest.raises(ValueError, match="max_seq_len"):
            model(torch.zeros(1, 65, dtype=torch.long))


# ------------------------------------------------------------------------------------------- sizes
def test_small_parameter_counts() -> None:
    with torch.device("meta"):
        mdlm, adlm, ar = mdlm_small(), adlm_small(), ar_small()
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in [("MDLM", mdlm), ("ADLM", adlm), ("AR", ar)]}
    print("small parameter counts: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    assert abs(counts["MDLM"] - 170e6) / 170e6 < 0.03
    assert abs(counts["ADLM"] - 293e6) / 293e6 < 0.03
    # Arithmetic of the module docstring in tadm/nn/baselines.py.
    assert counts["MDLM"] == 169_627_218 and counts["ADLM"] == 293_139_620
    assert isinstance(adlm, ADLM) and isinstance(mdlm, MDLM)
    assert adlm.layer_split == LayerSplit(0, 12, 6) and mdlm.layer_split == LayerSplit(0, 0, 12)
    assert ar.config.vocab_size == 50257 and len(ar.blocks.blocks) == 12
