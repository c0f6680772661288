"""Validation NELBO (Monte Carlo over t) and the AR's exact perplexity against direct computations."""

from __future__ import annotations

import math

import pytest
import torch

from tadm.diffusion import mask_corrupt, sample_t
from tadm.eval.likelihood import (
    ar_perplexity,
    diffusion_nelbo,
    evaluate_likelihood,
    is_autoregressive,
    packed_eval_blocks,
)
from tadm.nn import adlm_tiny
from tests.eval.test_evaluator import FIXTURE, randomize_, tiny_ar, tiny_diffusion, tiny_tokenizer

EPS = 1e-3


def blocks(n: int = 3, length: int = 12, seed: int = 5) -> torch.Tensor:
    """(n, L) ids without the mask id (319)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny_tokenizer().vocab_size - 1, (n, length), generator=g)


@torch.no_grad()
def direct_nelbo(model, x: torch.Tensor, num_t: int, seed: int) -> float:
    """One batch written out: loglinear alpha_t = 1 - (1 - eps) t, weight 1/t, fresh anchor, sum / (n B L)."""
    g = torch.Generator().manual_seed(seed)
    B, L = x.shape
    times = sample_t(B * num_t, eps=EPS, antithetic=True, generator=g)
    mask_id = model.mask_token_id
    total = 0.0
    for r in range(num_t):
        t = times[r * B : (r + 1) * B]
        z = mask_corrupt(x, 1.0 - (1.0 - EPS) * t, mask_id, g)
        log_probs = model.predict(z, model.encode(z), model.compute_anchor(model.encode(z)))  # (B, L, V)
        for b in range(B):
            for i in range(L):
                if z[b, i] == mask_id:
                    total += -float(log_probs[b, i, x[b, i]]) / float(t[b])
    return total / (num_t * B * L)


@pytest.mark.slow
@pytest.mark.parametrize("kind,num_t", [("mdlm", 1), ("tadm", 2)])
def test_nelbo_equals_direct_computation_for_one_batch(kind, num_t):
    model = tiny_diffusion(kind)
    x = blocks()
    result = diffusion_nelbo(model, x, num_t_samples=num_t, batch_size=8, seed=3)
    assert result.kind == "nelbo" and result.num_tokens == x.numel() and result.num_sequences == 3
    assert result.nll == pytest.approx(direct_nelbo(model, x, num_t, seed=3), rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(result.nll))


@pytest.mark.slow
def test_tadm_fresh_anchor_matches_the_forward_pass():
    model = tiny_diffusion("tadm")
    z = blocks()
    z[:, ::3] = model.mask_token_id
    from tadm.eval.likelihood import _fresh_anchor_log_probs

    torch.testing.assert_close(_fresh_anchor_log_probs(model, z, torch.full((3,), 0.5)), model(z).log_probs)


@pytest.mark.slow
def test_nelbo_is_deterministic_for_a_seed_and_varies_with_it():
    model = tiny_diffusion("mdlm")
    x = blocks(n=5)
    a = diffusion_nelbo(model, x, num_t_samples=2, batch_size=2, seed=0)
    b = diffusion_nelbo(model, x, num_t_samples=2, batch_size=2, seed=0)
    c = diffusion_nelbo(model, x, num_t_samples=2, batch_size=2, seed=1)
    assert a.nll == b.nll
    assert a.nll != c.nll
    assert a.num_tokens == x.numel() and a.num_t_samples == 2


@pytest.mark.slow
def test_more_t_samples_reduce_the_spread_of_the_estimate():
    model = tiny_diffusion("mdlm")
    x = blocks(n=4)
    one = [diffusion_nelbo(model, x, num_t_samples=1, seed=s).nll for s in range(6)]
    many = [diffusion_nelbo(model, x, num_t_samples=8, seed=s).nll for s in range(6)]
    spread = lambda v: max(v) - min(v)  # noqa: E731
    assert spread(many) < spread(one)


@pytest.mark.slow
def test_adlm_and_discrete_time_bound_run():
    model = randomize_(adlm_tiny(vocab_size=tiny_tokenizer().vocab_size), seed=2)
    x = blocks()
    continuous = diffusion_nelbo(model, x, seed=0)
    discrete = diffusion_nelbo(model, x, discrete_steps=4, seed=0)
    assert math.isfinite(continuous.nll) and continuous.nll > 0
    assert discrete.discrete_steps == 4 and discrete.num_tokens == x.numel()
    assert discrete.nll == diffusion_nelbo(model, x, discrete_steps=4, seed=0).nll


@pytest.mark.slow
@torch.no_grad()
def test_ar_perplexity_equals_direct_computation():
    model = tiny_ar()
    x = blocks(n=3, length=10)
    result = ar_perplexity(model, x, batch_size=2)
    total, count = 0.0, 0
    for row in x:
        for i in range(1, len(row)):
            logits = model(row[:i].unsqueeze(0))[0, -1]  # the prefix alone: a truly causal prediction
            total -= float(torch.log_softmax(logits.double(), -1)[row[i]])
            count += 1
    assert result.kind == "exact" and result.num_tokens == count
    assert result.nll == pytest.approx(total / count, rel=1e-5)
    assert is_autoregressive(model) and not is_autoregressive(tiny_diffusion("mdlm"))
    assert evaluate_likelihood(model, x, num_t_samples=4, seed=1).nll == pytest.approx(result.nll)


def test_packed_text_source(tmp_path):
    tok = tiny_tokenizer()
    packed = packed_eval_blocks(FIXTURE, tok, 32, cache_dir=tmp_path, split="all")
    assert packed.seq_len == 32 and len(packed) > 10
    model = tiny_diffusion("mdlm")
    result = evaluate_likelihood(model, packed, max_blocks=4, batch_size=2, seed=0)
    assert result.num_sequences == 4 and result.num_tokens == 4 * 32
    val = packed_eval_blocks(FIXTURE, tok, 32, cache_dir=tmp_path, split="val", val_fraction=0.1)
    assert 0 < len(val) < len(packed)
    with pytest.raises(ValueError, match="split must be"):
        packed_eval_blocks(FIXTURE, tok, 32, cache_dir=tmp_path, split="test")


def test_mismatched_tokenizer_is_a_clear_error():
    model = tiny_diffusion("mdlm")
    with pytest.raises(ValueError, match="mismatched tokenizer.*id 400"):
        diffusion_nelbo(model, torch.tensor([[1, 2, 400]]))
    with pytest.raises(ValueError, match="mask id 319"):
        diffusion_nelbo(model, torch.tensor([[1, 2, 319]]))
    with pytest.raises(ValueError, match="mismatched tokenizer"):
        ar_perplexity(tiny_ar(), torch.tensor([[1, 2, 319]]))  # the AR vocabulary has no mask id
    with pytest.raises(ValueError, match="block set is empty"):
        diffusion_nelbo(model, torch.zeros((0, 4), dtype=torch.long))
    with pytest.raises(ValueError, match="not a masked diffusion model"):
        diffusion_nelbo(tiny_ar(), blocks())
