"""Log-likelihood of a continuation: the Monte-Carlo bounds against their exact values on a tiny model.

The exact values are computed by enumerating every set S of masked continuation positions (2^n - 1 of
them, n = 5): for a network without time input x_theta depends on z_S only, so

* the continuous-time NELBO (alpha_t = 1 - t) is sum_S (1/|S|) / C(n, |S|) * loss(S), since the weight
  1/t integrated against t^k (1 - t)^(n - k) C(n, k) gives 1/k for each of the C(n, k) sets of size k;
* the discrete T-step bound is sum_i w_i sum_S m_i^|S| (1 - m_i)^(n - |S|) loss(S), with m_i = 1 - alpha_t(i)
  the masking probability and w_i = -lambda_t(i) of Eq. (masked-nelbo),

where loss(S) = sum_{i in S} -log x_theta(z_S)_i.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tadm.diffusion import get_schedule
from tadm.diffusion.losses import discrete_weight
from tadm.eval.continuation import continuation_cached_bound, continuation_elbo, stratified_mask_counts
from tadm.eval.likelihood import anchored_log_probs
from tadm.nn import mdlm_tiny, tadm_tiny

CONTEXT = torch.tensor([3, 17, 9, 40])
CONTINUATION = torch.tensor([5, 22, 61, 8, 30])


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module.eval()


@pytest.fixture(scope="module")
def model():
    return randomize(mdlm_tiny())


@pytest.fixture(scope="module")
def set_losses(model):
    """(sizes |S|, loss(S)) for every non-empty set S of masked continuation positions."""
    n, P = len(CONTINUATION), len(CONTEXT)
    subsets = [S for r in range(1, n + 1) for S in itertools.combinations(range(n), r)]
    z = torch.cat([CONTEXT, CONTINUATION]).repeat(len(subsets), 1)
    for row, S in enumerate(subsets):
        z[row, [P + i for i in S]] = model.mask_token_id
    with torch.no_grad():
        t = torch.zeros(len(subsets))
        lp = anchored_log_probs(model, z, t, z, t)[:, P:]
    nll = -lp.gather(-1, CONTINUATION.expand(len(subsets), n).unsqueeze(-1)).squeeze(-1).double()
    losses = torch.stack([nll[row, list(S)].sum() for row, S in enumerate(subsets)])
    return torch.tensor([len(S) for S in subsets]), losses


def exact_elbo(set_losses) -> float:
    sizes, losses = set_losses
    n = len(CONTINUATION)
    weights = torch.tensor([1.0 / (k * math.comb(n, k)) for k in sizes.tolist()], dtype=torch.float64)
    return float((weights * losses).sum())


def exact_discrete(set_losses, T: int) -> float:
    sizes, losses = set_losses
    n, schedule, total = len(CONTINUATION), get_schedule("loglinear"), 0.0
    for i in range(1, T + 1):
        a_t = schedule.alpha(torch.tensor(i / T, dtype=torch.float64))
        a_s = schedule.alpha(torch.tensor((i - 1) / T, dtype=torch.float64))
        m = 1.0 - float(a_t)
        probs = torch.tensor([m**k * (1 - m) ** (n - k) for k in sizes.tolist()], dtype=torch.float64)
        total += float(-discrete_weight(a_t, a_s)) * float((probs * losses).sum())
    return total


def test_stratified_mask_counts_cover_the_range_evenly():
    g = torch.Generator().manual_seed(0)
    assert all(sorted(stratified_mask_counts(5, 5, g).tolist()) == [1, 2, 3, 4, 5] for _ in range(10))
    assert all(set(stratified_mask_counts(5, 10, g).tolist()) == {1, 2, 3, 4, 5} for _ in range(10))
    assert all(1 <= v <= 7 for v in stratified_mask_counts(7, 3, g).tolist())


def test_the_k1_estimate_converges_to_the_exact_nelbo(model, set_losses):
    exact = exact_elbo(set_losses)
    errors, stderrs = [], []
    for n in (16, 256, 4096):
        bound = continuation_elbo(model, CONTEXT, CONTINUATION, num_samples=n, generator=torch.Generator().manual_seed(0),
                                  batch_size=64)
        assert bound.samples == n and bound.kind == "elbo"
        assert abs(bound.nll - exact) <= 4 * bound.stderr  # an unbiased estimate
        errors.append(abs(bound.nll - exact))
        stderrs.append(bound.stderr)
    assert stderrs[0] > 4 * stderrs[1] > 16 * stderrs[2] * 0.8  # shrinks like 1 / sqrt(samples)
    assert errors[-1] < 0.01 * exact  # 4096 draws: within 1 % of the exact bound
    again = continuation_elbo(model, CONTEXT, CONTINUATION, num_samples=16, generator=torch.Generator().manual_seed(0),
                              batch_size=64)
    assert again.nll == continuation_elbo(model, CONTEXT, CONTINUATION, num_samples=16,
                                          generator=torch.Generator().manual_seed(0), batch_size=64).nll


def test_the_discrete_bound_converges_to_its_exact_value(model, set_losses):
    T = 8
    exact = exact_discrete(set_losses, T)
    bound = continuation_cached_bound(model, CONTEXT, CONTINUATION, num_steps=T, refresh_interval=1, num_samples=1024,
                                      generator=torch.Generator().manual_seed(0),
                                      anchor_generator=torch.Generator().manual_seed(1), batch_size=256)
    assert abs(bound.nll - exact) <= 4 * bound.stderr and abs(bound.nll - exact) < 0.03 * exact
    assert bound.layer_calls.denoiser_calls == 4 * T  # 4 batches of 256 sweeps, T passes each
    # as T grows the discrete bound tends to the continuous one (the schedule's eps = 1e-3 apart)
    gaps = [abs(exact_discrete(set_losses, steps) - exact_elbo(set_losses)) for steps in (1, 16, 1024)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 0.005 * exact


def test_the_context_is_never_masked_and_caching_cannot_change_an_mdlm(model):
    seen = []
    original = model.predict

    def spy(z_t, *args, **kwargs):
        seen.append(z_t[:, : len(CONTEXT)].clone())
        return original(z_t, *args, **kwargs)

    model.predict = spy
    try:
        run = lambda K: continuation_cached_bound(model, CONTEXT, CONTINUATION, num_steps=6, refresh_interval=K,
                                                  num_samples=4, generator=torch.Generator().manual_seed(2),
                                                  anchor_generator=torch.Generator().manual_seed(3), batch_size=4)
        assert run(1).nll == run(4).nll  # MDLM has no anchor network: the K = 4 bound is the K = 1 bound
    finally:
        del model.predict
    assert seen and all(torch.equal(z, CONTEXT.expand_as(z)) for z in seen)


def test_an_anchored_model_is_scored_with_a_stale_anchor_at_k_greater_than_one():
    model = randomize(tadm_tiny(), seed=3)
    run = lambda K: continuation_cached_bound(model, CONTEXT, CONTINUATION, num_steps=6, refresh_interval=K,
                                              num_samples=8, generator=torch.Generator().manual_seed(2),
                                              anchor_generator=torch.Generator().manual_seed(3), batch_size=8)
    fresh, stale = run(1), run(3)
    assert fresh.nll != stale.nll and stale.refresh_interval == 3 and stale.num_steps == 6
    layers = model.layer_split
    assert stale.layer_calls.anchor == stale.layer_calls.anchor_refreshes * layers.anchor > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=0), "num_samples must be an integer >= 1"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
])
def test_bad_arguments_are_one_line(model, kwargs, match):
    options = {**dict(num_samples=2, batch_size=2, generator=torch.Generator()), **kwargs}
    with pytest.raises(ValueError, match=match):
        continuation_elbo(model, CONTEXT, CONTINUATION, **options)
    with pytest.raises(ValueError, match="exceed the model's max_seq_len"):
        continuation_elbo(model, torch.zeros(70, dtype=torch.long), CONTINUATION, num_samples=1,
                          generator=torch.Generator())
