"""Per-sample unigram entropy against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from tadm.eval.entropy import mean_entropy, sample_entropies, sample_entropy


def test_hand_made_sequence():
    # counts {1: 2, 2: 1, 3: 1} over 4 tokens -> p = (1/2, 1/4, 1/4)
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert sample_entropy([1, 1, 2, 3]) == pytest.approx(expected)
    assert sample_entropy(torch.tensor([3, 1, 2, 1])) == pytest.approx(expected)  # order does not matter


def test_extremes():
    assert sample_entropy([7] * 16) == 0.0
    assert math.copysign(1.0, sample_entropy([7] * 16)) == 1.0  # 0.0, not -0.0 (which prints as "-0.000")
    assert f"{mean_entropy([[7] * 8, [3] * 8]):.3f}" == "0.000"
    assert sample_entropy(list(range(16))) == pytest.approx(math.log(16))


def test_mean_over_samples_is_per_sample_then_averaged():
    samples = torch.tensor([[1, 1, 1, 1], [1, 2, 3, 4]])
    assert sample_entropies(samples) == pytest.approx([0.0, math.log(4)])
    assert mean_entropy(samples) == pytest.approx(math.log(4) / 2)
    # not the entropy of the pooled tokens
    pooled = sample_entropy(samples.reshape(-1))
    assert mean_entropy(samples) != pytest.approx(pooled)
    assert mean_entropy([[5, 5], [1, 2, 3]]) == pytest.approx(math.log(3) / 2)  # ragged lists


def test_empty_input_is_rejected():
    with pytest.raises(ValueError, match="sample set is empty"):
        mean_entropy([])
    with pytest.raises(ValueError, match="empty sample"):
        sample_entropy([])
    with pytest.raises(ValueError, match=r"\(N, L\)"):
        mean_entropy(torch.zeros(3, 2, 2, dtype=torch.long))
