"""MAUVE through mauve-text's compute_mauve(p_features=, q_features=) on evaluator features."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from tadm.eval.mauve import (_without_faiss_size_warning, mauve_from_features, mauve_sample_problem, mauve_score,
                             text_features)
from tests.eval.test_evaluator import fixture_docs, tiny_ar, tiny_ar_evaluator

FAST = dict(kmeans_num_redo=1, kmeans_max_iter=50, min_samples=2)  # small sets on purpose: not a quality claim


def sentences(n: int) -> list[str]:
    out = [s.strip() + "." for d in fixture_docs() for s in d.split(".") if len(s.strip()) > 40]
    return out[:n]


def gibberish(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("qxzjkvw0123456789#@!") for _ in range(60)) for _ in range(n)]


@pytest.mark.slow
def test_features_are_the_last_token_hidden_state():
    ev = tiny_ar_evaluator()
    texts = ["The jury said Friday.", "An investigation of Atlanta's recent primary election produced no evidence."]
    feats = text_features(texts, ev, batch_size=2)
    model = tiny_ar()
    for n, text in enumerate(texts):
        ids = torch.tensor([ev.encode([text])[0]])
        hidden = ev.forward(ids, torch.ones_like(ids), hidden=True).hidden
        np.testing.assert_allclose(feats[n], hidden[0, -1].numpy(), rtol=1e-5, atol=1e-5)
        # the hidden state feeds the output layer: its logits are the model's
        logits = model.head(hidden, torch.nn.functional.silu(model.time_embed(torch.zeros(1))))
        torch.testing.assert_close(logits, model(ids))
    np.testing.assert_allclose(text_features(texts, ev, batch_size=1), feats, rtol=1e-5, atol=1e-5)
    # truncation to the first max_tokens tokens
    short = text_features([texts[1]], ev, max_tokens=3)
    ids = torch.tensor([ev.encode([texts[1]])[0][:3]])
    np.testing.assert_allclose(short[0], ev.forward(ids, torch.ones_like(ids), hidden=True).hidden[0, -1].numpy(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_identical_feature_sets_score_one_and_separated_sets_score_low():
    rng = np.random.default_rng(0)
    p = rng.normal(size=(40, 8)).astype(np.float32)
    same = mauve_from_features(p, p.copy(), num_buckets=4, **FAST)
    near = mauve_from_features(p, rng.normal(size=(40, 8)).astype(np.float32), num_buckets=4, **FAST)
    far = mauve_from_features(p, rng.normal(loc=3.0, size=(40, 8)).astype(np.float32), num_buckets=4, **FAST)
    assert same.mauve == pytest.approx(1.0)
    assert far.mauve < 0.2 < near.mauve < same.mauve + 1e-9
    assert same.num_buckets == 4 and same.num_reference == same.num_samples == 40


@pytest.mark.slow
def test_identical_text_sets_score_higher_than_unrelated_ones():
    ev = tiny_ar_evaluator()
    reference = sentences(20)
    identical = mauve_score(reference, reference, ev, num_buckets=2, **FAST)
    unrelated = mauve_score(gibberish(20), reference, ev, num_buckets=2, **FAST)
    assert identical.mauve == pytest.approx(1.0)
    assert unrelated.mauve < identical.mauve - 0.02


def test_bad_input():
    ev = tiny_ar_evaluator()
    with pytest.raises(ValueError, match="sample set is empty"):
        mauve_score([], ["reference text"], ev)
    with pytest.raises(ValueError, match="reference set is empty"):
        mauve_score(["a sample"], [], ev)
    with pytest.raises(ValueError, match="one width"):
        mauve_from_features(np.zeros((4, 3)), np.zeros((4, 5)))
    with pytest.raises(ValueError, match="num_buckets=9 exceeds"):
        mauve_from_features(np.zeros((2, 3)), np.zeros((2, 3)), num_buckets=9, min_samples=2)


def test_too_few_samples_are_refused_with_the_minimum_named():
    rng = np.random.default_rng(0)
    p, q = rng.normal(size=(60, 8)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="at least 50 samples and 50 reference texts, got 16 samples"):
        mauve_from_features(p, q)
    assert mauve_sample_problem(16, 60) is not None and mauve_sample_problem(50, 50) is None
    assert "40 reference texts" in mauve_sample_problem(60, 40)
    result = mauve_from_features(p, rng.normal(size=(50, 8)).astype(np.float32), kmeans_num_redo=1)
    assert result.num_buckets == 5 and result.num_samples == 50  # "auto": round(50 / 10) clusters


def test_faiss_too_few_points_line_is_dropped_and_other_stderr_kept(capfd):
    rng = np.random.default_rng(0)
    p = rng.normal(size=(50, 8)).astype(np.float32)
    result = mauve_from_features(p, rng.normal(size=(50, 8)).astype(np.float32), **FAST)
    assert result.num_buckets == 5 and 0 < result.mauve <= 1
    with _without_faiss_size_warning():
        os.write(2, b"WARNING clustering 100 points to 5 centroids: please provide at least 195 training points\n")
        os.write(2, b"something else\n")
    assert capfd.readouterr().err == "something else\n"
