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
