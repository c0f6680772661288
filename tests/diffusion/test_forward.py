import pytest
import torch

from tadm.diffusion import forward_marginal, further_mask, mask_corrupt, uniform_corrupt

MASK = 9  # vocabulary of 10 ids, the last one is the mask


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _within_binomial(rate: torch.Tensor, p: torch.Tensor, n: int, k: float = 5.0) -> bool:
    std = torch.sqrt(p * (1 - p) / n)
    return bool(((rate - p).abs() <= k * std + 1e-12).all())


def test_mask_rate_matches_one_minus_alpha_per_example():
    B, L = 4, 20_000
    x = torch.randint(0, MASK, (B, L), generator=_gen(0))
    alpha = torch.tensor([0.1, 0.4, 0.7, 0.95])
    z = mask_corrupt(x, alpha, MASK, generator=_gen(1))
    is_mask = z == MASK
    assert _within_binomial(is_mask.double().mean(1), 1 - alpha.double(), L)
    # kept tokens are the clean tokens
    assert torch.equal(z[~is_mask], x[~is_mask])


@pytest.mark.parametrize("alpha", [0.3, torch.tensor(0.3), torch.tensor([0.3, 0.3]), torch.tensor([[0.3], [0.3]])])
def test_alpha_shapes_are_accepted(alpha):
    x = torch.randint(0, MASK, (2, 5000), generator=_gen(2))
    z = mask_corrupt(x, alpha, MASK, generator=_gen(3))
    assert _within_binomial((z == MASK).double().mean(1), torch.full((2,), 0.7, dtype=torch.float64), 5000)


def test_same_seed_same_draw_across_alpha_shapes():
    x = torch.randint(0, MASK, (2, 50), generator=_gen(2))
    ref = mask_corrupt(x, 0.3, MASK, generator=_gen(3))
    for alpha in (torch.tensor(0.3), torch.tensor([0.3, 0.3]), torch.full((2, 50), 0.3)):
        assert torch.equal(mask_corrupt(x, alpha, MASK, generator=_gen(3)), ref)


def test_per_token_alpha_zero_and_one_are_deterministic():
    x = torch.randint(0, MASK, (3, 8), generator=_gen(4))
    alpha = torch.zeros(3, 8)
    alpha[:, ::2] = 1.0
    z = mask_corrupt(x, alpha, MASK, generator=_gen(5))
    assert torch.equal(z[:, ::2], x[:, ::2])
    assert (z[:, 1::2] == MASK).all()


def test_bad_alpha_shape_and_bad_tokens_raise():
    x = torch.randint(0, MASK, (2, 8))
    with pytest.raises(ValueError, match="broadcast"):
        mask_corrupt(x, torch.rand(3, 8), MASK)
    with pytest.raises(ValueError, match="LongTensor"):
        mask_corrupt(x.float(), 0.5, MASK)


def test_further_mask_masks_are_a_superset_and_unmasked_tokens_unchanged():
    x = torch.randint(0, MASK, (4, 3000), generator=_gen(6))
    z_t = mask_corrupt(x, 0.8, MASK, generator=_gen(7))
    z_tp = further_mask(z_t, 0.8, 0.3, MASK, generator=_gen(8))
    assert ((z_t == MASK) <= (z_tp == MASK)).all()
    keep = z_tp != MASK
    assert torch.equal(z_tp[keep], z_t[keep])
    # a strict superset in practice: something new was masked
    assert (z_tp == MASK).sum() > (z_t == MASK).sum()


def test_further_mask_survival_rate_is_alpha_ratio():
    L = 40_000
    z_t = torch.randint(0, MASK, (2, L), generator=_gen(9))  # alpha_t = 1 state
    a_t = torch.tensor([0.9, 0.5])
    a_tp = torch.tensor([0.45, 0.1])
    z_tp = further_mask(z_t, a_t, a_tp, MASK, generator=_gen(10))
    survive = (z_tp != MASK).double().mean(1)
    assert _within_binomial(survive, (a_tp / a_t).double(), L)


def test_composition_is_distributed_as_q_ztp_given_x():
    """mask_corrupt(alpha_t) then further_mask(alpha_t -> alpha_t') has mask rate 1 - alpha_t', Eq. (fwd_t_t')."""
    B, L = 3, 30_000
    x = torch.randint(0, MASK, (B, L), generator=_gen(11))
    a_t = torch.tensor([0.95, 0.6, 0.3])
    a_tp = torch.tensor([0.5, 0.6, 0.05])
    z_t = mask_corrupt(x, a_t, MASK, generator=_gen(12))
    z_tp = further_mask(z_t, a_t, a_tp, MASK, generator=_gen(13))
    assert _within_binomial((z_tp == MASK).double().mean(1), 1 - a_tp.double(), L)
    # per-position independence: the joint rate of two fixed columns factorises
    m = (z_tp == MASK).double()
    both = (m[:, : L // 2] * m[:, L // 2 :]).mean(1)
    assert _within_binomial(both, ((1 - a_tp.double()) ** 2), L // 2)


def test_further_mask_equal_alphas_is_identity_and_zero_alpha_masks_all():
    z_t = mask_corrupt(torch.randint(0, MASK, (2, 100), generator=_gen(14)), 0.5, MASK, generator=_gen(15))
    assert torch.equal(further_mask(z_t, 0.5, 0.5, MASK, generator=_gen(16)), z_t)
    assert (further_mask(z_t, 0.5, 0.0, MASK, generator=_gen(16)) == MASK).all()
    all_mask = torch.full((2, 10), MASK)
    assert torch.equal(further_mask(all_mask, 0.0, 0.0, MASK), all_mask)


def test_further_mask_rejects_alpha_tp_above_alpha_t():
    z_t = torch.randint(0, MASK, (2, 10))
    with pytest.raises(ValueError, match="alpha_tp"):
        further_mask(z_t, torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.6]), MASK)
    # a few ulps of float32 slack are tolerated
    further_mask(z_t, torch.tensor(0.5), torch.tensor(0.5) + 1e-7, MASK)


def test_uniform_corrupt_histogram_matches_forward_marginal():
    V, n = 5, 200_000
    alpha = 0.3
    x = torch.full((1, n), 2, dtype=torch.long)
    z = uniform_corrupt(x, alpha, V, generator=_gen(17))
    hist = torch.bincount(z.flatten(), minlength=V).double() / n  # (V,)
    expected = forward_marginal(x[:, :1], torch.tensor(alpha, dtype=torch.float64), "uniform", V)[0, 0]
    torch.testing.assert_close(expected, torch.tensor([0.14, 0.14, 0.44, 0.14, 0.14], dtype=torch.float64))
    assert _within_binomial(hist, expected, n)


def test_uniform_corrupt_keeps_original_with_alpha_plus_noise_share():
    V, L = 7, 50_000
    x = torch.randint(0, V, (2, L), generator=_gen(18))
    alpha = torch.tensor([0.0, 0.6])
    z = uniform_corrupt(x, alpha, V, generator=_gen(19))
    same = (z == x).double().mean(1)
    assert _within_binomial(same, alpha.double() + (1 - alpha.double()) / V, L)
    assert z.min() >= 0 and z.max() < V


def test_forward_marginal_hand_values():
    x = torch.tensor([[0, 2]])
    a = torch.tensor([0.25], dtype=torch.float64)
    m = forward_marginal(x, a, "mask", 4, mask_id=3)
    expected = torch.tensor([[[0.25, 0.0, 0.0, 0.75], [0.0, 0.0, 0.25, 0.75]]], dtype=torch.float64)
    torch.testing.assert_close(m, expected)
    u = forward_marginal(x, a, "uniform", 4)
    expected_u = torch.tensor(
        [[[0.4375, 0.1875, 0.1875, 0.1875], [0.1875, 0.1875, 0.4375, 0.1875]]], dtype=torch.float64
    )
    torch.testing.assert_close(u, expected_u)
    torch.testing.assert_close(u.sum(-1), torch.ones(1, 2, dtype=torch.float64))


def test_forward_marginal_errors():
    x = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="absorbing"):
        forward_marginal(x, 0.5, "absorbing", 4, 3)
    with pytest.raises(ValueError, match="mask_id"):
        forward_marginal(x, 0.5, "mask", 4)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, g: mask_corrupt(x, 0.5, MASK, generator=g),
        lambda x, g: uniform_corrupt(x, 0.5, MASK, generator=g),
        lambda x, g: further_mask(x, 0.9, 0.4, MASK, generator=g),
    ],
    ids=["mask", "uniform", "further"],
)
def test_seeds_reproduce(fn):
    x = torch.randint(0, MASK, (3, 64), generator=_gen(20))
    a = fn(x, _gen(123))
    b = fn(x, _gen(123))
    c = fn(x, _gen(124))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_binomial_helper_rejects_a_wrong_rate():
    # guards the tolerance used above: a 2-point shift at n = 20000 is about 6 std
    assert not _within_binomial(torch.tensor([0.32]), torch.tensor([0.30]), 20_000)
    assert _within_binomial(torch.tensor([0.305]), torch.tensor([0.30]), 20_000)
