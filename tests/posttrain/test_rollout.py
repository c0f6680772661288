"""Rollout bookkeeping (i_a, i_s), cache-age sampling and the on-policy rollout against a hand-written loop."""

import math

import pytest
import torch

from tadm.diffusion import get_schedule, uniform_corrupt
from tadm.nn import mdlm_tiny
from tadm.posttrain import (
    AnchoredBackbone,
    DiffusionGemmaBackbone,
    FusionSpec,
    MDLMBackbone,
    SplitSpec,
    StackContext,
    draw_rollout,
    forward_rollout,
    on_policy_rollout,
    rollout_indices,
    sample_cache_ages,
)
from tadm.sampling.entropy_bound import EntropyBoundSampler

from .conftest import randomize

V, L, T = 128, 8, 48


def _indices(t, k, num_steps=T):
    i_a, i_s = rollout_indices(torch.tensor(t, dtype=torch.float64), torch.tensor(k), num_steps)
    return i_a.tolist(), i_s.tolist()


def test_rollout_indices_edge_cases():
    # t' = 0 snaps to 0 and is clipped up to k + 1; t' = 1 gives T.
    assert _indices([0.0, 0.0, 0.0], [0, 1, 2]) == ([1, 2, 3], [1, 1, 1])
    assert _indices([1.0, 1.0, 1.0], [0, 1, 2]) == ([48, 48, 48], [48, 47, 46])
    # Rounding to the nearest grid point, halves up: t' T = 0.5 -> 1, just below -> 0 -> clipped to 1.
    assert _indices([0.5 / T, (0.5 - 1e-9) / T], [0, 0]) == ([1, 1], [1, 1])
    assert _indices([10.5 / T, (10.5 - 1e-9) / T, 10.49 / T], [0, 0, 0]) == ([11, 10, 10], [11, 10, 10])
    assert _indices([(T - 0.5) / T, (T - 0.51) / T], [1, 1]) == ([48, 47], [47, 46])
    # The lower clip binds only when the nearest point is below k + 1.
    assert _indices([1 / T, 1 / T, 3 / T], [2, 0, 2]) == ([3, 1, 3], [1, 1, 1])
    # A single-step grid.
    assert _indices([0.0, 0.7], [0, 0], num_steps=1) == ([1, 1], [1, 1])


def test_rollout_indices_match_the_formula_everywhere():
    t = torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    k = torch.randint(0, 3, (4000,), generator=torch.Generator().manual_seed(1))
    i_a, i_s = rollout_indices(t, k, T)
    for ti, ki, a, s in zip(t.tolist(), k.tolist(), i_a.tolist(), i_s.tolist()):
        expected = min(max(math.floor(ti * T + 0.5), ki + 1), T)
        assert (a, s) == (expected, expected - ki)
    assert bool((i_s >= 1).all()) and bool((i_a <= T).all())


def test_rollout_indices_reject_bad_inputs():
    with pytest.raises(ValueError, match="cache ages must lie in 0..T-1 = 0..1"):
        rollout_indices(torch.tensor([0.5]), torch.tensor([2]), 2)
    with pytest.raises(ValueError, match="same shape"):
        rollout_indices(torch.tensor([0.5, 0.2]), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match="integer >= 1"):
        rollout_indices(torch.tensor([0.5]), torch.tensor([0]), 0)


def test_cache_ages_follow_the_paper_probabilities():
    ages = sample_cache_ages(30000, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(ages, minlength=3).double() / 30000
    torch.testing.assert_close(freq, torch.tensor([0.34, 0.33, 0.33], dtype=torch.float64), atol=0.01, rtol=0)
    again = sample_cache_ages(30000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ages, again)
    assert set(sample_cache_ages(50, ages=(4,), probs=(1.0,)).tolist()) == {4}
    with pytest.raises(ValueError, match="equally long"):
        sample_cache_ages(3, ages=(0, 1), probs=(1.0,))
    with pytest.raises(ValueError, match="positive sum"):
        sample_cache_ages(3, ages=(0, 1), probs=(0.0, 0.0))


def _model(gemma):
    model = AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), FusionSpec(rank=8, num_heads=2))
    randomize(model.fusion, seed=9, std=0.2)
    return model


def _x0(B=3, seed=0):
    return torch.randint(3, V, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_rollout_equals_a_hand_loop_with_the_anchor_fixed(gemma, k):
    """k reverse steps j = i_a, ..., i_s + 1 with the cached anchor of z_t', no self-conditioning."""
    model = _model(gemma)
    sampler = EntropyBoundSampler(V, num_steps=T)
    schedule = get_schedule("loglinear")
    B = 3
    x0, t_anchor, ages = _x0(B), torch.tensor([0.9, 0.31, 0.02]), torch.full((B,), k)
    prompt = model.backbone.prefill(torch.randint(3, V, (B, 4), generator=torch.Generator().manual_seed(1)))
    state = on_policy_rollout(model, x0, sampler=sampler, schedule=schedule, prompt=prompt, cache_age=ages,
                              t_anchor=t_anchor, self_conditioning_prob=0.0, generator=torch.Generator().manual_seed(5))
    i_a, i_s = rollout_indices(t_anchor, ages, T)
    assert torch.equal(state.i_a, i_a) and torch.equal(state.i_s, i_s) and torch.equal(state.i_a - state.i_s, ages)
    # The hand loop, drawing from an identically seeded generator in the same order.
    g = torch.Generator().manual_seed(5)
    z = uniform_corrupt(x0, schedule.alpha(t_anchor.double()).float(), V, g)
    torch.rand(B, generator=g)  # the self-conditioning coin flips
    ctx = StackContext(prompt=prompt)
    prepared = model.prepare(z, ctx)
    c0 = model.encode(z, prepared=prepared)
    anchor = model.compute_anchor(c0, prepared=prepared)
    assert torch.equal(state.z_anchor, z) and torch.equal(state.anchor, anchor)
    with torch.no_grad():
        for r in range(k):
            p = model.prepare(z, ctx)
            logits = model.predict_logits(z, model.encode(z, prepared=p), anchor, prepared=p)
            z = sampler.step(logits, i_a - r, z, g).prev_sample
    assert torch.equal(state.z_current, z)
    assert torch.equal(state.c_current, model.encode(z, prepared=model.prepare(z, ctx)))
    if k == 0:
        assert torch.equal(state.z_current, state.z_anchor)
    else:
        assert not torch.equal(state.z_current, state.z_anchor)


def test_rows_with_different_ages_move_independently(gemma):
    model = _model(gemma)
    sampler = EntropyBoundSampler(V, num_steps=T)
    x0 = _x0(4, seed=3)
    prompt = model.backbone.prefill(torch.randint(3, V, (4, 4), generator=torch.Generator().manual_seed(2)))
    state = on_policy_rollout(model, x0, sampler=sampler, schedule=get_schedule("loglinear"), prompt=prompt,
                              cache_age=torch.tensor([0, 2, 0, 1]), self_conditioning_prob=0.5,
                              generator=torch.Generator().manual_seed(0))
    assert torch.equal(state.z_current[[0, 2]], state.z_anchor[[0, 2]])
    h0, c0 = model.unpack_anchor(state.anchor)
    assert torch.equal(state.c_current[[0, 2]], c0[[0, 2]])  # fresh rows: C == C0 exactly
    assert not torch.equal(state.z_current[1], state.z_anchor[1])
    # Antithetic anchor times: one per quarter of [0, 1).
    assert sorted((state.t_anchor * 4).floor().long().tolist()) == [0, 1, 2, 3]


def test_no_self_conditioning_signal_at_the_first_grid_step(gemma):
    """With i_a = T there is no previous step: the anchor sees a zero signal even for rows with self-conditioning."""
    model = _model(gemma)
    x0 = _x0(2, seed=4)
    prompt = model.backbone.prefill(torch.randint(3, V, (2, 4), generator=torch.Generator().manual_seed(2)))
    kw = dict(sampler=EntropyBoundSampler(V, num_steps=T), schedule=get_schedule("loglinear"), prompt=prompt,
              cache_age=torch.zeros(2, dtype=torch.long), self_conditioning_prob=1.0,
              generator=torch.Generator().manual_seed(1))
    at_top = on_policy_rollout(model, x0, t_anchor=torch.ones(2), **kw)
    plain = model.encode(at_top.z_anchor, prepared=model.prepare(at_top.z_anchor, StackContext(prompt=prompt)))
    assert bool(at_top.self_conditioning.all())
    assert torch.equal(model.unpack_anchor(at_top.anchor)[1], plain)
    lower = on_policy_rollout(model, x0, t_anchor=torch.full((2,), 0.5), **kw)
    plain = model.encode(lower.z_anchor, prepared=model.prepare(lower.z_anchor, StackContext(prompt=prompt)))
    assert not torch.equal(model.unpack_anchor(lower.anchor)[1], plain)  # a bootstrapped signal is used


def test_a_masked_backbone_rolls_out_with_a_masked_sampler_only():
    model = AnchoredBackbone(MDLMBackbone(mdlm_tiny()), SplitSpec(1, 1), FusionSpec(rank=8, num_heads=2))
    with pytest.raises(ValueError, match="a mask-prior backbone \\(MDLMBackbone\\) rolls out with a masked sampler"):
        on_policy_rollout(model, torch.zeros(1, 4, dtype=torch.long), sampler=EntropyBoundSampler(65),
                          schedule=get_schedule("loglinear"), self_conditioning_prob=0.0)
    with pytest.raises(ValueError, match="rollout mode 'teacher' is unknown; valid: on-policy, forward"):
        draw_rollout(model, torch.zeros(1, 4, dtype=torch.long), sampler=EntropyBoundSampler(65),
                     schedule=get_schedule("loglinear"), mode="teacher")


@pytest.mark.parametrize("k", [0, 2])
def test_forward_rollout_draws_both_canvases_from_the_forward_process(gemma, k):
    """The ablation: z_t ~ q(. | x0) at t = t' - k/T, z_t' ~ q(z_t' | z_t) with keep alpha_t'/alpha_t; no model step."""
    model = _model(gemma)
    sampler = EntropyBoundSampler(V, num_steps=T)
    schedule = get_schedule("loglinear")
    B = 3
    x0, t_anchor, ages = _x0(B), torch.tensor([0.9, 0.31, 0.03]), torch.full((B,), k)
    prompt = model.backbone.prefill(torch.randint(3, V, (B, 4), generator=torch.Generator().manual_seed(1)))
    state = forward_rollout(model, x0, sampler=sampler, schedule=schedule, prompt=prompt, cache_age=ages,
                            t_anchor=t_anchor, self_conditioning_prob=0.0, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    t_now = torch.clamp(t_anchor.double() - k / T, min=0.0)
    z_t = uniform_corrupt(x0, schedule.alpha(t_now).float(), V, g)
    keep = (schedule.alpha(t_anchor.double()) / schedule.alpha(t_now)).clamp(0, 1)
    z_anchor = uniform_corrupt(z_t, keep.float(), V, g)
    assert torch.equal(state.z_current, z_t) and torch.equal(state.z_anchor, z_anchor)
    ctx = StackContext(prompt=prompt)
    p0 = model.prepare(z_anchor, ctx)
    assert torch.equal(state.anchor, model.compute_anchor(model.encode(z_anchor, prepared=p0), prepared=p0))
    assert torch.equal(state.c_current, model.encode(z_t, prepared=model.prepare(z_t, ctx)))
    assert torch.equal(state.i_a - state.i_s, ages)
    if k == 0:
        assert torch.equal(state.z_current, state.z_anchor)
    else:  # the anchor's canvas is noisier: it keeps fewer of x0's tokens
        assert int((state.z_anchor == x0).sum()) < int((state.z_current == x0).sum())


@pytest.mark.parametrize("mode", ["on-policy", "forward"])
def test_the_rollout_is_stop_gradient(gemma, mode, monkeypatch):
    """Every network pass of the rollout runs without autograd (the module's stop-gradient), also the passes outside
    the sampling loop; the canvas pair and the anchor carry no graph into the loss."""
    model = _model(gemma)
    grad_modes = []
    prepare = model.prepare

    def recording_prepare(*args, **kwargs):
        grad_modes.append(torch.is_grad_enabled())
        return prepare(*args, **kwargs)

    monkeypatch.setattr(model, "prepare", recording_prepare)
    prompt = model.backbone.prefill(torch.randint(3, V, (3, 4), generator=torch.Generator().manual_seed(2)))
    state = draw_rollout(model, _x0(3, seed=5), sampler=EntropyBoundSampler(V, num_steps=T), mode=mode,
                         schedule=get_schedule("loglinear"), prompt=prompt, cache_age=torch.tensor([2, 1, 0]),
                         t_anchor=torch.full((3,), 0.5), self_conditioning_prob=1.0,
                         generator=torch.Generator().manual_seed(0))
    assert grad_modes and not any(grad_modes)
    assert torch.is_grad_enabled()  # restored for the loss
    assert state.anchor.grad_fn is None and state.c_current.grad_fn is None
