"""Stale-anchor likelihood: exact agreement with the fresh and discrete bounds, direct computations, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from tadm.diffusion import discrete_cached_nelbo, further_mask, get_schedule, last_refresh_step, mask_corrupt, sample_t
from tadm.eval.likelihood import (
    _anchor_seed,
    anchored_log_probs,
    cached_process_nelbo,
    diffusion_nelbo,
    packed_eval_blocks,
    stale_anchor_nelbo,
)
from tadm.nn import NaiveReuse, adlm_tiny
from tadm.sampling import generate, get_sampler
from tadm.sampling.anchor_cache import is_refresh_step
from tests.eval.test_evaluator import randomize_, tiny_ar, tiny_diffusion, tiny_tokenizer

EPS = 1e-3


def blocks(n: int = 5, length: int = 12, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny_tokenizer().vocab_size - 1, (n, length), generator=g)


def anchored(kind: str) -> torch.nn.Module:
    if kind == "adlm":
        return randomize_(adlm_tiny(vocab_size=tiny_tokenizer().vocab_size), seed=2)
    model = tiny_diffusion("tadm")
    return NaiveReuse(model).eval() if kind == "naive" else model


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tadm", "adlm", "naive"])
@pytest.mark.parametrize("batch_size,num_t", [(2, 1), (3, 2)])
def test_age_zero_equals_the_fresh_nelbo_to_the_last_digit(kind, batch_size, num_t):
    model, x = anchored(kind), blocks()
    fresh = diffusion_nelbo(model, x, num_t_samples=num_t, batch_size=batch_size, seed=7)
    stale = stale_anchor_nelbo(model, x, steps=(4, 16), max_age=3, num_t_samples=num_t, batch_size=batch_size, seed=7)
    assert stale.fresh == fresh.nll  # exact: same draws, same arithmetic
    assert stale.curves[4][0] == stale.curves[16][0] == fresh.nll
    assert stale.num_tokens == fresh.num_tokens and stale.num_sequences == fresh.num_sequences


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tadm", "adlm"])
def test_discrete_cached_bound_with_k1_equals_the_discrete_nelbo(kind):
    model, x = anchored(kind), blocks(n=3, length=10)
    discrete = diffusion_nelbo(model, x, discrete_steps=6, batch_size=2, seed=4)
    cached = cached_process_nelbo(model, x, num_steps=6, refresh_intervals=[1, 2, 3], batch_size=2, seed=4)
    assert cached.bounds[1] == discrete.nll
    assert cached.bounds[2] != cached.bounds[1] and all(math.isfinite(v) for v in cached.bounds.values())
    assert cached.as_dict()["increase"]["1"] == 0.0


@pytest.mark.slow
@torch.no_grad()
def test_stale_curve_equals_a_direct_computation():
    """One batch written out: t' = min(1, t + k/T), z_t' by Eq. (12) with one shared uniform, TADM.forward."""
    model, x = tiny_diffusion("tadm"), blocks(n=3)
    T, max_age = 4, 5  # ages past T reach t' = 1
    result = stale_anchor_nelbo(model, x, steps=(T,), max_age=max_age, batch_size=8, seed=11, uninformative=True)
    sched = get_schedule("loglinear")
    g = torch.Generator().manual_seed(11)
    ga = torch.Generator().manual_seed(_anchor_seed(11))
    B, L = x.shape
    t = sample_t(B, eps=EPS, generator=g)
    z = mask_corrupt(x, sched.alpha(t), model.mask_token_id, g)
    u = torch.rand((B, L), generator=ga)
    for k in range(max_age + 1):
        t_anchor = torch.clamp(t + k / T, max=1.0)
        keep = sched.alpha(t_anchor).double() / sched.alpha(t).double()  # (B,)
        z_anchor = torch.where(u < keep[:, None], z, torch.full_like(z, model.mask_token_id))
        log_probs = model(z, z_anchor=z_anchor).log_probs  # (B, L, V)
        total = sum(-float(log_probs[b, i, x[b, i]]) / float(t[b])
                    for b in range(B) for i in range(L) if z[b, i] == model.mask_token_id)
        assert result.curves[T][k] == pytest.approx(total / (B * L), rel=1e-5), k
    blank = torch.full_like(z, model.mask_token_id)
    log_probs = model(z, z_anchor=blank).log_probs
    total = sum(-float(log_probs[b, i, x[b, i]]) / float(t[b])
                for b in range(B) for i in range(L) if z[b, i] == model.mask_token_id)
    assert result.uninformative == pytest.approx(total / (B * L), rel=1e-5)


def test_anchor_masks_are_nested_across_ages():
    x, sched = blocks(n=4, length=64), get_schedule("loglinear")
    g = torch.Generator().manual_seed(0)
    t = torch.full((4,), 0.3)
    z = mask_corrupt(x, sched.alpha(t), 319, g)
    u = torch.rand(z.shape, generator=g)
    previous = z == 319
    for k in range(1, 6):
        z_anchor = further_mask(z, sched.alpha(t), sched.alpha(t + k / 10), 319, uniform=u)
        masked = z_anchor == 319
        assert bool((masked | ~previous).all())  # every earlier mask is still masked
        assert int(masked.sum()) >= int(previous.sum())
        previous = masked
    with pytest.raises(ValueError, match="do not match"):
        further_mask(z, 0.5, 0.4, 319, uniform=u[:, :3])


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("kind", ["tadm", "adlm", "naive"])
def test_age_zero_anchor_is_what_the_cache_holds_after_a_refresh(kind):
    """anchored_log_probs at age 0 equals the log-probabilities of a K = 1 generation step."""
    model = anchored(kind)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    sampler = get_sampler("mdlm", model.mask_token_id)
    real_step = sampler.step

    def recording_step(log_probs, i, z_t, generator=None):
        seen.append((z_t.clone(), log_probs.clone()))
        return real_step(log_probs, i, z_t, generator)

    sampler.step = recording_step  # type: ignore[method-assign]
    generate(model, sampler, batch_size=2, seq_len=10, num_steps=5, refresh_interval=1,
             generator=torch.Generator().manual_seed(3))
    for z, log_probs in seen:
        t = torch.full((2,), 0.5)
        torch.testing.assert_close(anchored_log_probs(model, z, t, z, t), log_probs, rtol=0, atol=0)


@pytest.mark.slow
def test_naive_reuse_ignores_the_current_state_but_equals_the_model_when_fresh():
    model = tiny_diffusion("tadm")
    naive = NaiveReuse(model)
    z = blocks(n=2, length=8)
    z[:, ::2] = model.mask_token_id
    fresh = model(z).log_probs
    torch.testing.assert_close(naive.predict(z, naive.encode(z), naive.compute_anchor(naive.encode(z))), fresh)
    stale = z.clone()
    stale[:, 1::2] = model.mask_token_id
    anchor = naive.compute_anchor(naive.encode(stale))
    a = naive.predict(z, naive.encode(z), anchor)
    b = naive.predict(z, torch.zeros_like(naive.encode(z)), anchor)
    torch.testing.assert_close(a, b)  # the current representation is not used
    assert not torch.allclose(a, model(z, z_anchor=stale).log_probs)  # the fusion does use it
    assert naive.layer_split == model.layer_split
    with pytest.raises(TypeError, match="wraps a TADM"):
        NaiveReuse(tiny_diffusion("mdlm"))


@pytest.mark.parametrize("T,K", [(8, 1), (8, 3), (10, 4), (5, 8)])
def test_last_refresh_step_follows_algorithm_1(T, K):
    refreshed = None
    for i in range(T, 0, -1):
        if is_refresh_step(i, T, K):
            refreshed = i
        assert last_refresh_step(i, T, K) == refreshed
    with pytest.raises(ValueError, match="step index must be in 1..8"):
        last_refresh_step(0, 8, 2)


def test_discrete_cached_bound_gives_each_step_its_last_refresh_time():
    calls: list[tuple[float, float, bool]] = []
    x = blocks(n=2, length=6)

    def fake(z_t, t, z_a, t_a):
        calls.append((round(float(t[0]) * 6), round(float(t_a[0]) * 6), z_a is z_t))  # step indices i and j
        return torch.full((*z_t.shape, 320), -math.log(320.0))

    sched = get_schedule("loglinear")
    totals = discrete_cached_nelbo(fake, x, 6, [1, 4], sched, 319, torch.Generator().manual_seed(0))
    steps = [c for c in calls if c[0] > 0]
    # K = 1 is fresh; K = 4 reuses the anchor of step 6 at steps 5, 4, 3 and of step 2 at step 1
    for i in range(1, 7):
        j = {6: 6, 5: 6, 4: 6, 3: 6, 2: 2, 1: 2}[i]
        assert {c for c in steps if c[0] == i} == {(i, i, True), (i, j, j == i)}
    # a uniform prediction gives the same bound for both K
    torch.testing.assert_close(totals[1], totals[4])


class _LeakySchedule:
    """alpha(0) = 0.5 < 1: z_0 holds masks, so the bounds have a reconstruction term (i = 0)."""

    def alpha(self, t):
        return 0.5 * (1.0 - t)


def test_discrete_cached_bound_reconstruction_shares_one_call_per_anchor_step():
    calls: list[tuple[int, int]] = []
    x = blocks(n=2, length=6)

    def fake(z_t, t, z_a, t_a):
        calls.append((round(float(t[0]) * 6), round(float(t_a[0]) * 6)))  # step indices i and j
        return torch.full((*z_t.shape, 320), -math.log(320.0))

    totals = discrete_cached_nelbo(fake, x, 6, [1, 2, 4], _LeakySchedule(), 319, torch.Generator().manual_seed(0))
    # i = 0 uses the anchor of step 1's last refresh: j = 1 for K = 1, j = 2 for K = 2 and K = 4 (one call)
    assert sorted(c for c in calls if c[0] == 0) == [(0, 1), (0, 2)]
    torch.testing.assert_close(totals[1], totals[2])
    torch.testing.assert_close(totals[1], totals[4])


def test_bad_input_names_the_value():
    model, x = tiny_diffusion("tadm"), blocks(n=2)
    with pytest.raises(ValueError, match="cache age k must be an integer >= 0, got -1"):
        stale_anchor_nelbo(model, x, max_age=-1)
    with pytest.raises(ValueError, match="step budgets T must be integers >= 1, got 0"):
        stale_anchor_nelbo(model, x, steps=(0,))
    with pytest.raises(ValueError, match="refresh intervals K must be integers >= 1, got 0"):
        cached_process_nelbo(model, x, num_steps=4, refresh_intervals=[1, 0])
    with pytest.raises(ValueError, match="number of steps T must be an integer >= 1, got 0"):
        cached_process_nelbo(model, x, num_steps=0)
    with pytest.raises(ValueError, match="MDLM has no anchor network"):
        stale_anchor_nelbo(tiny_diffusion("mdlm"), x)
    with pytest.raises(ValueError, match="ARTransformer is not a masked diffusion model with an anchor"):
        cached_process_nelbo(tiny_ar(), x, num_steps=4)


def test_bad_block_sets_and_lists_name_the_problem():
    model, x = tiny_diffusion("tadm"), blocks(n=2)
    with pytest.raises(ValueError, match="refresh intervals K: 2 is listed twice"):
        cached_process_nelbo(model, x, num_steps=4, refresh_intervals=(1, 2, 2))
    with pytest.raises(ValueError, match="step budgets T: 8 is listed twice"):
        stale_anchor_nelbo(model, x, steps=(8, 8), max_age=1)
    with pytest.raises(ValueError, match="step budgets T must be a list of integers >= 1, got 8"):
        stale_anchor_nelbo(model, x, steps=8, max_age=1)
    with pytest.raises(ValueError, match="got a torch.float32 tensor of shape"):
        stale_anchor_nelbo(model, x.float(), steps=(8,), max_age=1)
    with pytest.raises(ValueError, match="got an iterable of list"):
        stale_anchor_nelbo(model, x.tolist(), steps=(8,), max_age=1)
    with pytest.raises(ValueError, match="blocks must be .*, got int"):
        stale_anchor_nelbo(model, 3, steps=(8,), max_age=1)
    with pytest.raises(ValueError, match="tokenizer must be a tadm TextTokenizer .*got NoneType"):
        packed_eval_blocks("brown", None, 32)
    # the same intervals, listed once each, still agree with each other
    once = cached_process_nelbo(model, x, num_steps=4, refresh_intervals=(1, 2)).bounds
    assert set(once) == {1, 2} and all(math.isfinite(v) for v in once.values())


def test_the_cached_bound_keeps_each_block_and_its_paired_differences():
    model, x = anchored("tadm"), blocks(n=5, length=10)
    result = cached_process_nelbo(model, x, num_steps=6, refresh_intervals=[1, 3], batch_size=2, seed=4)
    assert [len(v) for v in result.block_bounds.values()] == [5, 5]
    for K in (1, 3):  # every block has L tokens: the bound is the mean of the blocks'
        assert sum(result.block_bounds[K]) / 5 == pytest.approx(result.bounds[K], rel=1e-12)
    diffs = [a - b for a, b in zip(result.block_bounds[3], result.block_bounds[1])]
    mean = sum(diffs) / 5
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4 / 5)
    assert result.difference(3) == pytest.approx((mean, se), rel=1e-12)
    assert result.difference(1) == (0.0, 0.0)
    assert "block_bounds" not in result.as_dict()  # records keep their form
