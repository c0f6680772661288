import pytest
import torch

from tadm.sampling.categorical import nucleus_filter, sample_categorical


def test_gumbel_sampling_matches_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 200_000
    draws = sample_categorical(probs.expand(n, 5), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).double() / n
    std = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert torch.all((freq - probs.double()).abs() <= 5 * std + 1e-12)
    assert freq[4] == 0  # zero-probability ids are never drawn


def test_gumbel_sampling_is_reproducible_and_float64_by_default():
    probs = torch.softmax(torch.randn(4, 7, 11), -1)
    a = sample_categorical(probs, torch.Generator().manual_seed(3))
    b = sample_categorical(probs, torch.Generator().manual_seed(3))
    c = sample_categorical(probs, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # float64 noise draws a different stream from float32 noise
    d = sample_categorical(probs, torch.Generator().manual_seed(3), dtype=torch.float32)
    assert a.shape == d.shape == (4, 7)


def test_nucleus_filter_hand_values():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    torch.testing.assert_close(nucleus_filter(probs, 0.8), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(nucleus_filter(probs, 0.5), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(nucleus_filter(probs, 0.81), torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    assert nucleus_filter(probs, 1.0) is probs


def test_nucleus_filter_keeps_order_under_permutation():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    torch.testing.assert_close(nucleus_filter(probs, 0.8), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5])
def test_nucleus_filter_rejects_bad_p(p):
    with pytest.raises(ValueError, match="top_p"):
        nucleus_filter(torch.ones(1, 3) / 3, p)


def test_released_nucleus_rule_drops_the_token_crossing_p_but_keeps_the_top_one():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    # p = 0.7: the standard rule keeps 0.3 (mass before it 0.5 < 0.7); the released rule drops it (0.8 > 0.7)
    torch.testing.assert_close(nucleus_filter(probs, 0.7, "standard"), torch.tensor([[0.625, 0.375, 0.0, 0.0]],
                                                                                   dtype=torch.float64))
    torch.testing.assert_close(nucleus_filter(probs, 0.7, "released"), torch.tensor([[1.0, 0.0, 0.0, 0.0]],
                                                                                   dtype=torch.float64))
    # cumulative mass exactly p is kept by both
    torch.testing.assert_close(nucleus_filter(probs, 0.8, "released"), nucleus_filter(probs, 0.8, "standard"))
    # a top-1 above p is kept alone
    top = torch.tensor([[0.05, 0.95]], dtype=torch.float64)
    torch.testing.assert_close(nucleus_filter(top, 0.9, "released"), torch.tensor([[0.0, 1.0]], dtype=torch.float64))
    assert nucleus_filter(probs, 1.0, "released") is probs
    with pytest.raises(ValueError, match="unknown nucleus rule 'top'; valid: released, standard"):
        nucleus_filter(probs, 0.9, "top")
    with pytest.raises(ValueError, match="nucleus top_p must be a number in \\(0, 1\\], got nan"):
        nucleus_filter(probs, float("nan"))
