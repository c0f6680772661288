import itertools

import pytest
import torch
import torch.nn.functional as F

from tadm.diffusion import (
    mask_corrupt,
    masked_posterior,
    remdm_posterior,
    remdm_sigma,
    remdm_sigma_max,
    reverse_posterior,
    usdm_posterior,
)

D = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_probs(B: int, L: int, V: int, seed: int, zero_id: int | None = None) -> torch.Tensor:
    logits = torch.randn(B, L, V, generator=_gen(seed), dtype=D)
    if zero_id is not None:
        logits[..., zero_id] = float("-inf")
    return torch.softmax(logits, -1)


def _half_masked(B: int, L: int, mask: int, seed: int) -> torch.Tensor:
    tokens = torch.randint(0, mask, (B, L), generator=_gen(seed + 100))
    return torch.where(torch.rand(B, L, generator=_gen(seed)) < 0.5, mask, tokens)


def _sample(probs: torch.Tensor, seed: int) -> torch.Tensor:
    B, L, V = probs.shape
    return torch.multinomial(probs.reshape(-1, V), 1, generator=_gen(seed)).reshape(B, L)


# ---------------------------------------------------------------- masked (MDLM)


def test_masked_posterior_hand_values():
    # V = 4, mask id 3, alpha_t = 0.4, alpha_s = 0.7: (a_s - a_t)/(1 - a_t) = 0.5, (1 - a_s)/(1 - a_t) = 0.5
    x_probs = torch.tensor([[[0.2, 0.3, 0.5, 0.0], [0.2, 0.3, 0.5, 0.0]]], dtype=D)
    z_t = torch.tensor([[3, 1]])
    out = masked_posterior(x_probs, z_t, 0.4, 0.7, mask_id=3)
    expected = torch.tensor([[[0.1, 0.15, 0.25, 0.5], [0.0, 1.0, 0.0, 0.0]]], dtype=D)
    torch.testing.assert_close(out, expected)
    assert out.dtype == D


def test_masked_posterior_equals_general_posterior_with_mask_prior():
    V, mask = 4, 3
    prior = F.one_hot(torch.tensor(mask), V).to(D)
    # every consistent (x, z_t) pair: z_t = x or z_t = m
    pairs = [(x, z) for x in range(3) for z in (x, mask)]
    x = torch.tensor([[p[0] for p in pairs]])
    z_t = torch.tensor([[p[1] for p in pairs]])
    x_onehot = F.one_hot(x, V).to(D)
    for a_t, a_s in [(0.4, 0.7), (0.05, 0.06), (0.01, 0.3), (0.9, 1.0)]:
        ref = reverse_posterior(x_onehot, F.one_hot(z_t, V), a_t, a_s, prior)
        torch.testing.assert_close(masked_posterior(x_onehot, z_t, a_t, a_s, mask), ref)


def test_masked_posterior_rows_sum_to_one_with_per_example_alphas():
    B, L, V, mask = 3, 7, 6, 5
    x_probs = _random_probs(B, L, V, 0, zero_id=mask)
    z_t = _half_masked(B, L, mask, 1)
    a_t = torch.tensor([0.1, 0.5, 0.9], dtype=D)
    a_s = torch.tensor([0.2, 0.5, 0.95], dtype=D)
    out = masked_posterior(x_probs, z_t, a_t, a_s, mask)
    torch.testing.assert_close(out.sum(-1), torch.ones(B, L, dtype=D))
    assert (out >= 0).all()
    # alpha_s = alpha_t (row 1): masked positions stay masked
    assert (out[1][z_t[1] == mask][:, mask] == 1).all()


# ---------------------------------------------------------------- ReMDM


def test_remdm_sigma_zero_equals_masked_posterior():
    B, L, V, mask = 2, 9, 6, 5
    x_probs = _random_probs(B, L, V, 3, zero_id=mask)
    z_t = _half_masked(B, L, mask, 4)
    a_t, a_s = torch.tensor([0.3, 0.6], dtype=D), torch.tensor([0.45, 0.61], dtype=D)
    ref = masked_posterior(x_probs, z_t, a_t, a_s, mask)
    torch.testing.assert_close(remdm_posterior(x_probs, z_t, a_t, a_s, 0.0, mask), ref)


def test_remdm_posterior_hand_values():
    # V = 4, mask 3, a_t = 0.4, a_s = 0.7, sigma = 0.2
    # masked:   (0.7 - 0.8 * 0.4) / 0.6 = 0.38 / 0.6,  (1 - 0.7 - 0.2 * 0.4) / 0.6 = 0.22 / 0.6
    # unmasked: 0.8 one_hot(z) + 0.2 m
    x_probs = torch.tensor([[[0.5, 0.25, 0.25, 0.0], [0.5, 0.25, 0.25, 0.0]]], dtype=D)
    z_t = torch.tensor([[3, 1]])
    out = remdm_posterior(x_probs, z_t, 0.4, 0.7, 0.2, mask_id=3)
    cx, cm = 0.38 / 0.6, 0.22 / 0.6
    expected = torch.tensor([[[0.5 * cx, 0.25 * cx, 0.25 * cx, cm], [0.0, 0.8, 0.0, 0.2]]], dtype=D)
    torch.testing.assert_close(out, expected)


def test_remdm_posterior_per_token_sigma_and_rows_sum_to_one():
    B, L, V, mask = 2, 8, 5, 4
    x_probs = _random_probs(B, L, V, 6, zero_id=mask)
    z_t = _half_masked(B, L, mask, 7)
    a_t, a_s = 0.5, 0.6
    sigma = torch.rand(B, L, generator=_gen(9), dtype=D) * remdm_sigma_max(a_t, a_s)
    out = remdm_posterior(x_probs, z_t, a_t, a_s, sigma, mask)
    torch.testing.assert_close(out.sum(-1), torch.ones(B, L, dtype=D))
    assert (out >= 0).all()
    unmasked = z_t != mask
    torch.testing.assert_close(out[..., mask][unmasked], sigma[unmasked])
    masked = ~unmasked
    torch.testing.assert_close(out[..., mask][masked], ((1 - a_s - sigma * a_t) / (1 - a_t))[masked])


def test_remdm_posterior_clamps_sigma_above_sigma_max():
    # sigma_max = (1 - 0.95) / 0.9 ~ 0.056; sigma = 0.5 would make the mask weight negative
    x_probs = torch.tensor([[[0.5, 0.5, 0.0]]], dtype=D)
    out = remdm_posterior(x_probs, torch.tensor([[2]]), 0.9, 0.95, 0.5, mask_id=2)
    assert (out >= 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(1, 1, dtype=D))


@pytest.mark.slow
@pytest.mark.parametrize("sigma_kind", ["scalar", "per_token"])
def test_remdm_posterior_preserves_forward_marginals(sigma_kind):
    """With x known, z_t ~ q(z_t | x) stepped through Eq. (remdm-posterior) is masked w.p. 1 - alpha_s."""
    L, V, mask = 60_000, 6, 5
    a_t, a_s = 0.4, 0.7
    x = torch.randint(0, mask, (1, L), generator=_gen(10))
    z_t = mask_corrupt(x, a_t, mask, generator=_gen(11))
    smax = float(remdm_sigma_max(a_t, a_s))  # 0.75
    if sigma_kind == "scalar":
        sigma = 0.6
    else:
        sigma = torch.rand(1, L, generator=_gen(12), dtype=D) * smax
    probs = remdm_posterior(F.one_hot(x, V).to(D), z_t, a_t, a_s, sigma, mask)
    z_s = _sample(probs, 13)
    rate = (z_s == mask).double().mean()
    std = (a_s * (1 - a_s) / L) ** 0.5
    assert abs(rate - (1 - a_s)) < 5 * std
    # remasking actually happened: some tokens unmasked at t are masked at s
    assert ((z_t != mask) & (z_s == mask)).any()
    keep = z_s != mask
    assert torch.equal(z_s[keep], x[keep])


def test_remdm_sigma_max_values():
    torch.testing.assert_close(remdm_sigma_max(0.4, 0.7), torch.tensor(0.75, dtype=D))
    torch.testing.assert_close(remdm_sigma_max(0.1, 0.2), torch.tensor(1.0, dtype=D))  # 8 -> clamped
    torch.testing.assert_close(remdm_sigma_max(0.0, 0.2), torch.tensor(1.0, dtype=D))  # alpha_t = 0
    out = remdm_sigma_max(torch.tensor([0.4, 0.5]), torch.tensor([0.7, 0.9]))
    assert out.shape == (2, 1)
    torch.testing.assert_close(out, torch.tensor([[0.75], [0.2]]))


def test_remdm_sigma_strategies_hand_values():
    a_t, a_s = 0.4, 0.7  # sigma_max = 0.75
    torch.testing.assert_close(remdm_sigma("cap", a_t, a_s, 0.04), torch.tensor(0.04, dtype=D))
    torch.testing.assert_close(remdm_sigma("cap", a_t, a_s, 0.9), torch.tensor(0.75, dtype=D))
    torch.testing.assert_close(remdm_sigma("rescale", a_t, a_s, 0.5), torch.tensor(0.375, dtype=D))
    torch.testing.assert_close(remdm_sigma("loop", a_t, a_s, 0.02), torch.tensor(0.02, dtype=D))
    per_ex = remdm_sigma("rescale", torch.tensor([0.4, 0.5]), torch.tensor([0.7, 0.9]), 0.5)
    assert per_ex.shape == (2, 1)
    torch.testing.assert_close(per_ex, torch.tensor([[0.375], [0.1]]))


def test_remdm_sigma_conf_softmax_over_decoded_positions():
    inf = float("inf")
    conf = torch.tensor([[0.9, 0.2, -inf, 0.5], [-inf, -inf, -inf, -inf], [0.3, float("nan"), -inf, -inf]], dtype=D)
    out = remdm_sigma("conf", 0.4, 0.7, eta=0.123, confidence=conf)
    assert out.shape == (3, 4)
    e = torch.exp(-torch.tensor([0.9, 0.2, 0.5], dtype=D))
    row0 = 0.75 * e / e.sum()
    torch.testing.assert_close(out[0], torch.tensor([row0[0], row0[1], 0.0, row0[2]], dtype=D))
    torch.testing.assert_close(out[1], torch.zeros(4, dtype=D))  # nothing decoded: no NaN
    torch.testing.assert_close(out[2], torch.tensor([0.75, 0.0, 0.0, 0.0], dtype=D))
    # least confident token is the likeliest to be remasked
    assert out[0, 1] > out[0, 3] > out[0, 0]


def test_remdm_sigma_errors():
    with pytest.raises(ValueError) as err:
        remdm_sigma("capped", 0.4, 0.7, 0.1)
    for name in ("cap", "rescale", "conf", "loop"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="confidence"):
        remdm_sigma("conf", 0.4, 0.7, 0.1)
    with pytest.raises(ValueError, match="eta"):
        remdm_sigma("cap", 0.4, 0.7, -0.1)


# ---------------------------------------------------------------- uniform state


def test_usdm_posterior_hand_values():
    # K = 4, a_t = 0.5, a_s = 0.8, x = 0, z_t = 1; direct evaluation of Eq. (rev-posterior) with pi = 1/4:
    # [0.625 z + 0.375/4] * [0.8 x + 0.05] / (0.5 * 0.25) = [0.6375, 0.2875, 0.0375, 0.0375];
    # for z_t = x = 0 the denominator is 0.5 + 0.5 * 0.25 and the result [0.9775, 0.0075, 0.0075, 0.0075]
    x_probs = F.one_hot(torch.tensor([[0, 0]]), 4).to(D)
    out = usdm_posterior(x_probs, torch.tensor([[1, 0]]), 0.5, 0.8, 4)
    expected = torch.tensor([[[0.6375, 0.2875, 0.0375, 0.0375], [0.9775, 0.0075, 0.0075, 0.0075]]], dtype=D)
    torch.testing.assert_close(out, expected)


def test_usdm_posterior_equals_general_posterior_with_uniform_prior():
    B, L, K = 2, 6, 5
    prior = torch.full((K,), 1.0 / K, dtype=D)
    z_t = torch.randint(0, K, (B, L), generator=_gen(14))
    a_t = torch.tensor([0.2, 0.7], dtype=D)
    a_s = torch.tensor([0.25, 0.9], dtype=D)
    # both one-hot and soft predictions: the posterior is linear in x over numerator and denominator
    for x_probs in (F.one_hot(torch.randint(0, K, (B, L), generator=_gen(15)), K).to(D), _random_probs(B, L, K, 16)):
        out = usdm_posterior(x_probs, z_t, a_t, a_s, K)
        ref = reverse_posterior(x_probs, F.one_hot(z_t, K), a_t, a_s, prior)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(out.sum(-1), torch.ones(B, L, dtype=D))
        assert (out >= 0).all()


def test_usdm_posterior_vocab_mismatch_raises():
    with pytest.raises(ValueError, match="vocab_size"):
        usdm_posterior(torch.rand(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), 0.5, 0.6, 6)


# ---------------------------------------------------------------- general


def test_reverse_posterior_is_bayes_rule():
    """Eq. (rev-posterior) equals q(z_t | z_s) q(z_s | x) / q(z_t | x) computed from transition matrices."""
    V = 4
    pi = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=D)
    a_t, a_s = 0.3, 0.6
    a_ts = a_t / a_s
    Q_ts = a_ts * torch.eye(V, dtype=D) + (1 - a_ts) * pi  # row: z_s, column: z_t
    for x, z in itertools.product(range(V), range(V)):
        q_s = a_s * F.one_hot(torch.tensor(x), V).to(D) + (1 - a_s) * pi  # (V,) over z_s
        joint = Q_ts[:, z] * q_s
        bayes = joint / joint.sum()
        out = reverse_posterior(
            F.one_hot(torch.tensor([[x]]), V).to(D), F.one_hot(torch.tensor([[z]]), V), a_t, a_s, pi
        )[0, 0]
        torch.testing.assert_close(out, bayes)


def test_float32_inputs_keep_dtype():
    x_probs = _random_probs(1, 3, 4, 17, zero_id=3).float()
    z_t = torch.tensor([[3, 0, 3]])
    for out in (
        masked_posterior(x_probs, z_t, 0.3, 0.5, 3),
        remdm_posterior(x_probs, z_t, 0.3, 0.5, 0.1, 3),
        usdm_posterior(x_probs, z_t, 0.3, 0.5, 4),
    ):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.sum(-1), torch.ones(1, 3))


def test_scalar_move_probs_equal_the_tensor_version_bit_for_bit():
    """remdm_move_probs_scalar (host floats, no device tensor) = remdm_move_probs (float64 tensors)."""
    from tadm.diffusion import remdm_move_probs, remdm_move_probs_scalar, remdm_sigma_max

    g = torch.Generator().manual_seed(0)
    z = torch.zeros(1, 1, dtype=torch.long)
    pairs = [(1.0, 1.0), (0.0, 0.0), (0.0, 1e-3), (0.5, 0.5), (1.0 - 1e-12, 1.0)]
    pairs += [tuple(sorted(torch.rand(2, generator=g, dtype=torch.float64).tolist())) for _ in range(200)]
    for alpha_t, alpha_s in pairs:
        sigma_max = float(remdm_sigma_max(alpha_t, alpha_s))
        for sigma in (0.0, 0.02, sigma_max, min(1.0, 1.5 * sigma_max)):
            unmask, remask = remdm_move_probs(z, alpha_t, alpha_s, sigma)
            scalar = remdm_move_probs_scalar(alpha_t, alpha_s, sigma)
            assert scalar == (unmask.item(), remask.item()), (alpha_t, alpha_s, sigma)
