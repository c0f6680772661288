"""Pretraining objectives checked against hand computations on tiny models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tadm.diffusion import further_mask, get_schedule, mask_corrupt, sample_stale_anchor_times, sample_t
from tadm.nn import build_model
from tadm.training.objectives import (
    OBJECTIVES,
    ObjectiveConfig,
    adlm_objective,
    ar_objective,
    get_objective,
    mdlm_objective,
    rare_token_mask,
    tadm_objective,
    validation_config,
)

V = 65  # tiny presets: 64 tokens + the mask (id 64)
MASK = V - 1
B, L = 6, 16


def randomize(model: torch.nn.Module, seed: int = 0, keep_zero: tuple[str, ...] = ()) -> torch.nn.Module:
    """Perturb every parameter (the presets zero-initialise heads and adaLN) except those named in keep_zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(keep_zero):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def clean_tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V - 1, (B, L), generator=torch.Generator().manual_seed(seed))


def cond_of(model: torch.nn.Module) -> torch.Tensor:
    # Time conditioning is off in every preset: the embedder sees t = 0.
    return F.silu(model.time_embed(torch.zeros(B)))  # (B, cond_dim)


def log_softmax_no_mask(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float().clone()
    logits[..., MASK] = -math.inf
    return logits.log_softmax(-1)


def masked_nelbo_by_hand(log_probs: torch.Tensor, x: torch.Tensor, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """sum over masked positions of (1/t) * -log p(x), divided by B * L (log-linear schedule)."""
    nll = -log_probs.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # (B, L)
    weighted = torch.where(z == MASK, nll / t[:, None], torch.zeros(()))
    return weighted.sum() / x.numel()


# ------------------------------------------------------------------------------------------- TADM
@pytest.mark.slow
def test_tadm_fresh_anchor_with_zero_fusion_equals_unsplit_masked_nelbo() -> None:
    model = randomize(build_model("tadm-tiny", anchor_lm_head=False), keep_zero=("fusion.delta_out",))
    assert torch.count_nonzero(model.fusion.delta_out.weight) == 0
    x = clean_tokens()
    cfg = ObjectiveConfig(refresh_intervals=(1,))  # K = 1: k = 0, t' = t, z_t' = z_t
    out = tadm_objective(model, x, torch.Generator().manual_seed(7), cfg)
    z_t, t = out.tensors["z_t"], out.tensors["t"]
    assert torch.equal(out.tensors["z_tp"], z_t) and torch.equal(out.tensors["t_anchor"], t)
    assert 0 < int((z_t == MASK).sum()) < z_t.numel()

    with torch.no_grad():  # S -> A -> LN -> D, written out
        cond = cond_of(model)
        h = model.anchor(model.embed(z_t), cond)  # (B, L, D)
        logits = model.head(model.denoiser(model.fusion.norm_out(h), cond), cond)  # (B, L, V)
    expected = masked_nelbo_by_hand(log_softmax_no_mask(logits), x, z_t, t)
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert out.num_tokens == B * L
    torch.testing.assert_close(out.parts["diffusion"], expected, rtol=1e-5, atol=1e-6)
    assert out.parts["anchor"].item() == 0.0


@pytest.mark.slow
def test_tadm_stale_anchor_feeds_z_tp_to_the_anchor_and_z_t_to_fusion() -> None:
    model = randomize(build_model("tadm-tiny", anchor_lm_head=False))  # fusion update non-zero too
    x = clean_tokens()
    cfg = ObjectiveConfig(refresh_intervals=(8,), step_budgets=(16,))
    out = tadm_objective(model, x, torch.Generator().manual_seed(3), cfg)
    z_t, z_tp, t = out.tensors["z_t"], out.tensors["z_tp"], out.tensors["t"]
    assert not torch.equal(z_t, z_tp)

    fusion = model.fusion
    with torch.no_grad():
        cond = cond_of(model)
        c = model.embed(z_t)  # (B, L, D)
        h = model.anchor(model.embed(z_tp), cond)  # (B, L, D)
        u = torch.cat([fusion.norm_c(c), fusion.norm_h(h)], dim=-1)  # (B, L, 2D)
        g = torch.sigmoid(u @ fusion.gate.weight.T + fusion.gate.bias)
        delta = F.gelu(u @ fusion.delta_in.weight.T + fusion.delta_in.bias) @ fusion.delta_out.weight.T
        fused = fusion.norm_out(h + g * (delta + fusion.delta_out.bias))
        logits = model.head(model.denoiser(fused, cond), cond)
    expected = masked_nelbo_by_hand(log_softmax_no_mask(logits), x, z_t, t)
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tadm_noise_follows_the_core_forward_process() -> None:
    model = build_model("tadm-tiny", anchor_lm_head=False)
    x = clean_tokens()
    cfg = ObjectiveConfig(refresh_intervals=(2, 4), step_budgets=(8, 32))
    out = tadm_objective(model, x, torch.Generator().manual_seed(11), cfg)

    gen = torch.Generator().manual_seed(11)  # the same draws, in the documented order
    sched = get_schedule("loglinear")
    t = sample_t(B, cfg.eps, True, gen)
    times = sample_stale_anchor_times(t, cfg.refresh_intervals, cfg.step_budgets, gen)
    z_t = mask_corrupt(x, sched.alpha(times.t), MASK, gen)
    z_tp = further_mask(z_t, sched.alpha(times.t), sched.alpha(times.t_anchor), MASK, gen)
    assert torch.equal(out.tensors["t"], t)
    assert torch.equal(out.tensors["t_anchor"], times.t_anchor)
    assert torch.equal(out.tensors["z_t"], z_t)
    assert torch.equal(out.tensors["z_tp"], z_tp)
    again = tadm_objective(model, x, torch.Generator().manual_seed(11), cfg)
    assert torch.equal(again.loss, out.loss)
    other = tadm_objective(model, x, torch.Generator().manual_seed(12), cfg)
    assert not torch.equal(other.tensors["z_t"], out.tensors["z_t"])


@pytest.mark.slow
def test_tadm_z_tp_masks_are_a_superset_of_z_t_masks() -> None:
    model = build_model("tadm-tiny", anchor_lm_head=False)
    x = torch.randint(0, V - 1, (64, L), generator=torch.Generator().manual_seed(0))
    cfg = ObjectiveConfig(refresh_intervals=(8,), step_budgets=(16,))
    out = tadm_objective(model, x, torch.Generator().manual_seed(5), cfg)
    z_t, z_tp = out.tensors["z_t"], out.tensors["z_tp"]
    t, t_anchor, k = out.tensors["t"], out.tensors["t_anchor"], out.tensors["cache_age"]
    assert bool(((z_t == MASK) <= (z_tp == MASK)).all())  # masked in z_t => masked in z_t'
    kept = z_tp != MASK
    assert torch.equal(z_tp[kept], x[kept])  # what survives is clean
    assert int(((z_tp == MASK) & (z_t != MASK)).sum()) > 0  # strictly more masks somewhere
    torch.testing.assert_close(t_anchor, torch.clamp(t + k.float() / 16, max=1.0))
    assert bool((t_anchor >= t).all()) and int(k.max()) > 0


@pytest.mark.slow
def test_tadm_gamma_adds_gamma_times_weighted_anchor_cross_entropy() -> None:
    model = randomize(build_model("tadm-tiny", anchor_lm_head=True))
    x = clean_tokens()
    base = ObjectiveConfig(refresh_intervals=(8,), step_budgets=(16,))
    gamma = 0.3
    out0 = tadm_objective(model, x, torch.Generator().manual_seed(9), base)
    out1 = tadm_objective(model, x, torch.Generator().manual_seed(9), ObjectiveConfig(
        gamma=gamma, refresh_intervals=(8,), step_budgets=(16,)))
    z_tp, t_anchor, t = out1.tensors["z_tp"], out1.tensors["t_anchor"], out1.tensors["t"]
    assert torch.equal(out0.tensors["z_tp"], z_tp)
    assert bool((t_anchor > t).any())

    with torch.no_grad():  # anchor CE at positions masked in z_t', weight 1/t' (not 1/t)
        cond = cond_of(model)
        h = model.anchor(model.embed(z_tp), cond)
        anchor_lp = log_softmax_no_mask(model.anchor_head(h, cond))
    anchor = masked_nelbo_by_hand(anchor_lp, x, z_tp, t_anchor)
    torch.testing.assert_close(out1.parts["anchor"], anchor, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out1.loss - out0.loss, gamma * anchor, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out1.parts["diffusion"], out0.loss.detach())


def test_tadm_gamma_without_anchor_head_is_a_clear_error() -> None:
    model = build_model("tadm-tiny", anchor_lm_head=False)
    with pytest.raises(ValueError, match="anchor_lm_head"):
        tadm_objective(model, clean_tokens(), torch.Generator().manual_seed(0), ObjectiveConfig(gamma=0.1))


# ---------------------------------------------------------------------------------- baselines
@pytest.mark.slow
def test_mdlm_objective_is_the_masked_nelbo() -> None:
    model = randomize(build_model("mdlm-tiny"))
    x = clean_tokens()
    out = mdlm_objective(model, x, torch.Generator().manual_seed(2), ObjectiveConfig())
    z_t, t = out.tensors["z_t"], out.tensors["t"]
    with torch.no_grad():
        cond = cond_of(model)
        logits = model.head(model.blocks(model.embed(z_t), cond), cond)
    expected = masked_nelbo_by_hand(log_softmax_no_mask(logits), x, z_t, t)
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_adlm_objective_adds_anchor_loss_on_rare_tokens_only() -> None:
    model = randomize(build_model("adlm-tiny"))
    x = clean_tokens()
    rare = torch.zeros(V, dtype=torch.bool)
    rare[::3] = True  # an arbitrary anchor vocabulary
    gamma = 0.5
    cfg = ObjectiveConfig(gamma=gamma, anchor_token_mask=rare)
    out = adlm_objective(model, x, torch.Generator().manual_seed(4), cfg)
    z_t, t = out.tensors["z_t"], out.tensors["t"]
    with torch.no_grad():
        cond = cond_of(model)
        anchor_lp = log_softmax_no_mask(model.anchor_head(model.anchor(model.embed(z_t), cond), cond))
        proj = anchor_lp.exp() @ model.anchor_proj.weight.T + model.anchor_proj.bias
        logits = model.head(model.denoiser(proj, cond), cond)
    diffusion = masked_nelbo_by_hand(log_softmax_no_mask(logits), x, z_t, t)
    z_rare = torch.where(rare[x], z_t, x)  # non-anchor positions count as "not masked" for the anchor term
    anchor = masked_nelbo_by_hand(anchor_lp, x, z_rare, t)
    assert 0 < anchor < masked_nelbo_by_hand(anchor_lp, x, z_t, t)
    torch.testing.assert_close(out.parts["diffusion"], diffusion, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.parts["anchor"], anchor, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.detach(), diffusion + gamma * anchor, rtol=1e-5, atol=1e-6)
    plain = adlm_objective(model, x, torch.Generator().manual_seed(4), ObjectiveConfig())
    torch.testing.assert_close(plain.loss.detach(), diffusion, rtol=1e-5, atol=1e-6)


def test_ar_objective_is_next_token_cross_entropy() -> None:
    model = randomize(build_model("ar-tiny"))
    x = torch.randint(0, 64, (B, L), generator=torch.Generator().manual_seed(0))
    out = ar_objective(model, x, None, ObjectiveConfig())
    with torch.no_grad():
        lp = model(x).log_softmax(-1)  # (B, L, V)
    expected = -sum(lp[b, i, x[b, i + 1]] for b in range(B) for i in range(L - 1)) / (B * (L - 1))
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert out.num_tokens == B * (L - 1)


@pytest.mark.slow
def test_objectives_backpropagate_into_every_parameter() -> None:
    x = clean_tokens()
    for arch, kwargs, cfg in [
        ("tadm", {"anchor_lm_head": True}, ObjectiveConfig(gamma=0.1)),
        ("tadm", {"anchor_lm_head": False}, ObjectiveConfig()),
        ("mdlm", {}, ObjectiveConfig()),
        ("adlm", {}, ObjectiveConfig(gamma=0.1)),
    ]:
        model = randomize(build_model(f"{arch}-tiny", **kwargs)).train()
        get_objective(arch)(model, x, torch.Generator().manual_seed(0), cfg).loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, (arch, missing)


@pytest.mark.parametrize("arch", ["tadm", "mdlm", "adlm", "ar"])
def test_a_batch_scored_in_pieces_gives_the_whole_batch_loss(arch: str) -> None:
    """``rows``: the noise is drawn for the whole batch, so the pieces' token-weighted losses add up to it."""
    model = randomize(build_model(f"{arch}-tiny"))
    x, objective, cfg = clean_tokens(), get_objective(arch), ObjectiveConfig(refresh_intervals=(1, 2, 4))
    whole = objective(model, x, torch.Generator().manual_seed(5), cfg)
    pieces = [objective(model, x, torch.Generator().manual_seed(5), cfg, rows=slice(lo, lo + 4)) for lo in (0, 4)]
    assert [p.num_tokens for p in pieces] == ([4 * (L - 1), 2 * (L - 1)] if arch == "ar" else [4 * L, 2 * L])
    total = sum(p.loss.double() * p.num_tokens for p in pieces) / sum(p.num_tokens for p in pieces)
    torch.testing.assert_close(total, whole.loss.double(), rtol=1e-6, atol=1e-7)
    if arch != "ar":  # the pieces saw the whole batch's noise, row for row
        torch.testing.assert_close(torch.cat([p.tensors["z_t"] for p in pieces]), whole.tensors["z_t"])
        torch.testing.assert_close(torch.cat([p.tensors["t"] for p in pieces]), whole.tensors["t"])


# ---------------------------------------------------------------------------------- helpers
def test_rare_token_mask_by_hand() -> None:
    counts = torch.tensor([5, 3, 1, 1, 0])  # total 10
    # 0.5 of the mass: id 0 alone covers 5 -> common {0}
    assert rare_token_mask(counts, 0.5).tolist() == [False, True, True, True, True]
    # 0.6: ids 0, 1 (8 >= 6)
    assert rare_token_mask(counts, 0.6).tolist() == [False, False, True, True, True]
    # 0.9: ties between ids 2 and 3 go by id -> common {0, 1, 2}
    assert rare_token_mask(counts, 0.9).tolist() == [False, False, False, True, True]
    # 1.0: only the unseen id stays rare; excluded ids never are
    assert rare_token_mask(counts, 1.0).tolist() == [False, False, False, False, True]
    assert rare_token_mask(counts, 0.5, exclude=[3, 4]).tolist() == [False, True, True, False, False]
    with pytest.raises(ValueError, match="common_mass"):
        rare_token_mask(counts, 0.0)


def test_registry_and_validation_config() -> None:
    assert set(OBJECTIVES) == {"tadm", "mdlm", "adlm", "ar"}
    assert get_objective("tadm") is tadm_objective
    with pytest.raises(ValueError, match="valid: tadm, mdlm, adlm, ar"):
        get_objective("sedd")
    val = validation_config(ObjectiveConfig(gamma=0.3, refresh_intervals=(1, 2, 4)))
    assert val.gamma == 0.0 and val.refresh_intervals == (1,)
