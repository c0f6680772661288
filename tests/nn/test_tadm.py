"""TADM: composition S -> A -> Phi -> D, SUBS outputs, stale anchors, layer counts, configs, sizes."""

import pytest
import torch

from tadm.nn.dit import NEG_INF, DiTBlock
from tadm.nn.tadm import TADM, TADMConfig, TADMOutput, tadm_small, tadm_tiny
from tadm.protocol import CacheableDenoiser, LayerSplit

MASK = 64


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def random_model(seed: int = 0, **overrides: object) -> TADM:
    return randomize(tadm_tiny(**overrides), seed).eval()


def canvas(seed: int = 1, B: int = 2, L: int = 12, mask_rate: float = 0.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(0, MASK, (B, L), generator=g)
    z[torch.rand(B, L, generator=g) < mask_rate] = MASK
    z[:, 0] = MASK  # at least one masked and
    z[:, 1] = 5  # one unmasked position per row
    return z


def count_block_calls(model: torch.nn.Module) -> tuple[list[int], list]:
    calls = [0]
    handles = [
        m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for m in model.modules()
        if isinstance(m, DiTBlock)
    ]
    return calls, handles


def test_tiny_config_and_protocol() -> None:
    model = tadm_tiny()
    assert isinstance(model, CacheableDenoiser)
    assert model.layer_split == LayerSplit(shared=0, anchor=2, denoiser=1)
    assert model.vocab_size == 65 and model.mask_token_id == 64
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_heads, cfg.cond_dim, cfg.dropout, cfg.max_seq_len) == (32, 2, 16, 0.0, 64)
    assert len(model.anchor.blocks) == 2 and len(model.denoiser.blocks) == 1
    assert TADMConfig(vocab_size=10, mask_token_id=0).resolved_mask_token_id == 0
    assert TADM(TADMConfig(vocab_size=10, hidden_size=8, num_heads=2, cond_dim=4)).mask_token_id == 9


def test_forward_equals_manual_composition_with_zero_init_fusion() -> None:
    model = random_model()
    with torch.no_grad():
        model.fusion.delta_out.weight.zero_()
        model.fusion.delta_out.bias.zero_()
    z = canvas()
    out = model(z)
    assert isinstance(out, TADMOutput)
    h = model.compute_anchor(model.encode(z))
    expected = model.denoise(model.fusion.norm_out(h), z)
    torch.testing.assert_close(out.log_probs, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.anchor_hidden, h)


def test_forward_equals_predict_path() -> None:
    model = random_model(seed=2)
    z = canvas(seed=3)
    out = model(z)
    c = model.encode(z)
    torch.testing.assert_close(out.log_probs, model.predict(z, c, model.compute_anchor(c)))
    torch.testing.assert_close(out.anchor_log_probs, model.anchor_log_probs(out.anchor_hidden))


def test_subs_output_properties() -> None:
    model = random_model(seed=4)
    z = canvas(seed=5)
    lp = model(z).log_probs
    assert lp.shape == (2, 12, 65) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(2, 12), atol=1e-5, rtol=0)
    assert (lp[..., MASK] < NEG_INF / 2).all()
    unmasked = z != MASK
    one_hot = torch.nn.functional.one_hot(z, 65).bool()
    assert (lp[unmasked][one_hot[unmasked]] == 0).all()
    assert (lp[unmasked][~one_hot[unmasked]] <= NEG_INF).all()
    masked_rows = lp[~unmasked][:, :MASK]
    assert (masked_rows > NEG_INF / 2).all() and masked_rows.std() > 0  # real predictions, not constants


def test_stale_anchor_comes_from_z_anchor() -> None:
    model = random_model(seed=6)
    z_t = canvas(seed=7, mask_rate=0.3)
    z_anchor = z_t.clone()
    z_anchor[:, 2:8] = MASK  # a further-corrupted, earlier state z_t'
    out = model(z_t, z_anchor=z_anchor)
    h = model.compute_anchor(model.encode(z_anchor))
    manual = model.denoise(model.fuse(model.encode(z_t), h), z_t)
    torch.testing.assert_close(out.anchor_hidden, h)
    torch.testing.assert_close(out.log_probs, manual)
    torch.testing.assert_close(out.anchor_log_probs, model.anchor_log_probs(h))
    assert not torch.allclose(out.log_probs, model(z_t).log_probs)  # the anchor really matters
    with pytest.raises(ValueError, match="z_anchor shape"):
        model(z_t, z_anchor=z_anchor[:, :5])


def test_block_calls_match_layer_split() -> None:
    model = random_model(seed=8, anchor_layers=3, denoiser_layers=2)
    calls, handles = count_block_calls(model)
    z = canvas(seed=9)
    c = model.encode(z)
    h = model.compute_anchor(c)
    assert calls[0] == model.layer_split.anchor == 3
    model.predict(z, c, h)
    assert calls[0] == model.layer_split.total == 5
    calls[0] = 0
    model.predict(z, model.encode(z), h)
    assert calls[0] == model.layer_split.denoiser == 2
    calls[0] = 0
    model(z)
    assert calls[0] == 5
    calls[0] = 0
    model(z, z_anchor=z)
    assert calls[0] == 5
    for handle in handles:
        handle.remove()


def test_time_conditioning() -> None:
    z = canvas(seed=10)
    t1, t2 = torch.tensor([0.2, 0.9]), torch.tensor([0.7, 0.1])
    off = random_model(seed=11)
    torch.testing.assert_close(off(z, t=t1).log_probs, off(z).log_probs)
    on = random_model(seed=11, time_conditioning=True)
    assert not torch.allclose(on(z, t=t1).log_probs, on(z, t=t2).log_probs)
    # The anchor sees t_anchor, the denoiser sees t.
    out = on(z, z_anchor=z, t=t1, t_anchor=t2)
    h = on.compute_anchor(on.encode(z), t2)
    torch.testing.assert_close(out.anchor_hidden, h)
    torch.testing.assert_close(out.log_probs, on.predict(z, on.encode(z), h, t1))
    assert not torch.allclose(out.anchor_hidden, on(z, t=t1).anchor_hidden)


def test_without_anchor_head() -> None:
    model = tadm_tiny(anchor_lm_head=False)
    out = model(canvas())
    assert out.anchor_log_probs is None
    assert model.inference_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(RuntimeError, match="anchor_lm_head"):
        model.anchor_log_probs(out.anchor_hidden)
    with_head = tadm_tiny()
    head = sum(p.numel() for p in with_head.anchor_head.parameters())
    assert with_head.inference_parameters() == model.inference_parameters()
    assert sum(p.numel() for p in with_head.parameters()) == model.inference_parameters() + head


def test_anchor_log_probs_are_normalised_without_mask() -> None:
    model = random_model(seed=12)
    alp = model(canvas(seed=13)).anchor_log_probs
    assert alp.shape == (2, 12, 65)
    torch.testing.assert_close(alp.logsumexp(-1), torch.zeros(2, 12), atol=1e-5, rtol=0)
    assert (alp[..., MASK] < NEG_INF / 2).all()


def test_zero_initialised_parts_receive_gradients() -> None:
    model = tadm_tiny()
    z = canvas(seed=14)
    target = torch.randint(0, MASK, (2, 12, 1), generator=torch.Generator().manual_seed(0))

    def backward() -> None:
        model.zero_grad()
        out = model(z)
        (-(out.log_probs.gather(-1, target).sum()) - out.anchor_log_probs[..., 3].sum()).backward()

    backward()
    # adaLN-zero: at initialisation only the zero-initialised output layers get gradients.
    assert torch.count_nonzero(model.head.linear.weight.grad) > 0
    assert torch.count_nonzero(model.anchor_head.linear.weight.grad) > 0
    assert torch.count_nonzero(model.fusion.delta_out.weight.grad) == 0
    with torch.no_grad():  # as after a first optimiser step on the output layer
        model.head.linear.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    backward()
    # The fusion update W_2 (still exactly zero) now learns from the stale-anchor objective.
    assert torch.count_nonzero(model.fusion.delta_out.weight) == 0
    assert torch.count_nonzero(model.fusion.delta_out.weight.grad) > 0


def test_sequence_length_and_shape_checks() -> None:
    model = tadm_tiny()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        model.encode(torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(hidden_size=30, num_heads=4), "hidden_size"),
        (dict(hidden_size=12, num_heads=4), "even"),
        (dict(mask_token_id=50258), "mask_token_id"),
        (dict(mask_token_id=-1), "mask_token_id"),
        (dict(anchor_layers=0), "anchor_layers"),
        (dict(denoiser_layers=-2), "denoiser_layers"),
        (dict(vocab_size=1), "vocab_size"),
        (dict(num_heads=True), "num_heads"),
        (dict(cond_dim=2.5), "cond_dim"),
        (dict(dropout=1.0), "dropout"),
        (dict(time_conditioning=1), "time_conditioning"),
        (dict(anchor_lm_head="yes"), "anchor_lm_head"),
        (dict(max_seq_len=0), "max_seq_len"),
    ],
)
def test_config_validation(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TADMConfig(**overrides)


def test_small_parameter_counts() -> None:
    with torch.device("meta"):
        model = tadm_small()
    inference = model.inference_parameters()
    head = sum(p.numel() for p in model.anchor_head.parameters())
    fusion = sum(p.numel() for p in model.fusion.parameters())
    print(f"TADM small: inference graph {inference:,}, anchor LM head {head:,}, fusion {fusion:,}")
    assert model.layer_split == LayerSplit(0, 12, 6)
    assert abs(inference - 224e6) / 224e6 < 0.03
    assert abs(head - 38.85e6) / 38.85e6 < 0.01
    # Arithmetic of the module docstring in tadm/nn/baselines.py.
    assert inference == 223_960_146 and head == 38_847_314 and fusion == 8_266_752
