import pytest
import torch

from tadm.diffusion import StaleAnchorTimes, sample_stale_anchor_times, sample_t


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("B", [1, 7, 64])
def test_antithetic_times_put_one_sample_in_each_bin(seed, B):
    eps = 1e-3
    t = sample_t(B, eps=eps, generator=_gen(seed))
    assert t.shape == (B,) and t.dtype == torch.float32
    assert (t >= eps).all() and (t < 1).all()
    u = (t.double() - eps) / (1 - eps)
    bins = torch.floor(u * B).long().clamp(0, B - 1)
    assert torch.equal(torch.sort(bins).values, torch.arange(B))
    # evenly spaced: consecutive sorted gaps are 1 / B (in u)
    if B > 1:
        gaps = torch.diff(torch.sort(u).values)
        torch.testing.assert_close(gaps, torch.full_like(gaps, 1.0 / B), atol=1e-6, rtol=0)


def test_iid_times_are_not_stratified_but_in_range():
    t = sample_t(64, eps=0.1, antithetic=False, generator=_gen(0))
    assert (t >= 0.1).all() and (t < 1).all()
    u = (t.double() - 0.1) / 0.9
    bins = torch.floor(u * 64).long()
    assert len(torch.unique(bins)) < 64  # i.i.d. draws collide (probability of no collision ~ 1e-27)


def test_sample_t_seeds_reproduce():
    for antithetic in (True, False):
        a = sample_t(16, generator=_gen(1), antithetic=antithetic)
        b = sample_t(16, generator=_gen(1), antithetic=antithetic)
        c = sample_t(16, generator=_gen(2), antithetic=antithetic)
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_sample_t_validation():
    with pytest.raises(ValueError, match="batch_size.*0"):
        sample_t(0)
    with pytest.raises(ValueError, match="eps.*1.5"):
        sample_t(4, eps=1.5)


def test_stale_anchor_times_invariants():
    B = 4096
    t = sample_t(B, generator=_gen(3)).double()
    out = sample_stale_anchor_times(t, generator=_gen(4))
    assert isinstance(out, StaleAnchorTimes)
    for field in (out.t, out.t_anchor, out.cache_age, out.refresh_interval, out.num_steps):
        assert field.shape == (B,)
    assert out.cache_age.dtype == out.refresh_interval.dtype == out.num_steps.dtype == torch.long
    assert torch.equal(out.t, t)
    assert (out.t_anchor >= t).all() and (out.t_anchor <= 1).all()
    assert set(out.refresh_interval.tolist()) == {1, 2, 4, 8}
    assert set(out.num_steps.tolist()) == {128, 256, 512, 1024, 2048, 4096}
    assert (out.cache_age >= 0).all() and (out.cache_age < out.refresh_interval).all()
    assert (out.cache_age[out.refresh_interval == 1] == 0).all()
    # every age below K appears for K = 8
    assert set(out.cache_age[out.refresh_interval == 8].tolist()) == set(range(8))
    offset = out.cache_age.double() / out.num_steps.double()
    unclipped = t + offset <= 1
    torch.testing.assert_close(out.t_anchor[unclipped] - t[unclipped], offset[unclipped], atol=1e-12, rtol=0)
    assert (out.t_anchor[~unclipped] == 1).all()
    assert (out.t_anchor > t).any()  # stale anchors do occur


def test_cache_age_is_uniform_given_K():
    B = 40_000
    t = torch.full((B,), 0.5)
    out = sample_stale_anchor_times(t, refresh_intervals=(4,), step_budgets=(100,), generator=_gen(5))
    counts = torch.bincount(out.cache_age, minlength=4).double() / B
    std = (0.25 * 0.75 / B) ** 0.5
    assert ((counts - 0.25).abs() < 5 * std).all()
    torch.testing.assert_close(out.t_anchor, 0.5 + out.cache_age.float() / 100)


def test_clipping_at_one():
    t = torch.full((64,), 0.999, dtype=torch.float64)
    out = sample_stale_anchor_times(t, refresh_intervals=(8,), step_budgets=(128,), generator=_gen(6))
    fresh = out.cache_age == 0
    assert (out.t_anchor[~fresh] == 1.0).all()
    assert (out.t_anchor[fresh] == 0.999).all()


def test_fresh_anchors_when_K_is_one():
    t = sample_t(32, generator=_gen(7))
    out = sample_stale_anchor_times(t, refresh_intervals=(1,), generator=_gen(8))
    assert (out.cache_age == 0).all()
    assert torch.equal(out.t_anchor, t)


def test_stale_anchor_seeds_reproduce():
    t = sample_t(32, generator=_gen(9))
    a = sample_stale_anchor_times(t, generator=_gen(10))
    b = sample_stale_anchor_times(t, generator=_gen(10))
    c = sample_stale_anchor_times(t, generator=_gen(11))
    for name in ("t_anchor", "cache_age", "refresh_interval", "num_steps"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.refresh_interval, c.refresh_interval)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"refresh_intervals": ()}, "refresh_intervals"),
        ({"step_budgets": ()}, "step_budgets"),
        ({"refresh_intervals": (1, 0)}, "0"),
        ({"step_budgets": (128, -4)}, "-4"),
        ({"refresh_intervals": (1.5,)}, "1.5"),
    ],
)
def test_stale_anchor_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        sample_stale_anchor_times(torch.rand(4), **kwargs)


def test_stale_anchor_rejects_bad_t():
    with pytest.raises(ValueError, match="shape"):
        sample_stale_anchor_times(torch.rand(4, 1))
