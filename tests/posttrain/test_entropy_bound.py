"""Algorithm 2 (entropy-bound sampler) against hand computations and against transformers' own classes."""

import math

import pytest
import torch

from tadm.posttrain import AnchoredBackbone, DiffusionGemmaBackbone, FusionSpec, SplitSpec
from tadm.sampling import build_sampler
from tadm.sampling.entropy_bound import (
    EntropyBoundSampler,
    entropy_bound_accept,
    token_entropy,
)


def test_temperature_schedule_is_linear_in_step():
    s = EntropyBoundSampler(10, temperature_max=0.8, temperature_min=0.4, num_steps=48)
    assert s.temperature(48).item() == pytest.approx(0.8, abs=1e-7)
    assert s.temperature(24).item() == pytest.approx(0.6, abs=1e-7)
    assert s.temperature(1).item() == pytest.approx(0.4 + 0.4 / 48, abs=1e-7)
    per_row = s.temperature(torch.tensor([48, 24, 1]))
    assert per_row.shape == (3, 1, 1)
    assert torch.equal(per_row.flatten(), torch.stack([s.temperature(n) for n in (48, 24, 1)]))


def test_a_zero_minimum_temperature_is_accepted_as_diffusion_gemma_accepts_t_min_0():
    """tau_n = tau_min + (tau_max - tau_min) n / T at n >= 1: with tau_min = 0 every step is still at tau > 0."""
    s = EntropyBoundSampler(10, temperature_max=0.8, temperature_min=0.0, num_steps=4)
    assert s.temperature(1).item() == pytest.approx(0.2) and s.temperature(4).item() == pytest.approx(0.8)
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(0))
    out = s.step(logits, 1, torch.zeros(2, 3, dtype=torch.long), torch.Generator().manual_seed(1))
    assert torch.isfinite(out.scaled_logits).all() and torch.equal(out.prev_sample, logits.argmax(-1))
    for kwargs, message in ((dict(temperature_min=0.0, temperature_max=0.0), r"temperature_max must be a finite "
                             r"number in \(0, inf\), got 0.0"),
                            (dict(temperature_min=-0.1), r"temperature_min must be a finite number in \[0, inf\)"),
                            (dict(temperature_min=0.0, temperature_max=1e-45), "the temperature at the last step")):
        with pytest.raises(ValueError, match=message):
            EntropyBoundSampler(10, **kwargs)


def test_entropy_matches_direct_formula():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)) * 3
    p = logits.softmax(-1)
    torch.testing.assert_close(token_entropy(logits), -(p * p.log()).sum(-1))


def test_entropy_is_bit_identical_to_categorical_and_leaves_its_input_alone():
    """The released sampler sorts Categorical(logits).entropy(); tadm's in-place version must give the same bits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(3, 16, 301, generator=g) * scale for scale in (0.01, 1.0, 40.0, 4000.0)], dim=1)
    logits[0, 0, :5] = -math.inf  # tokens a processor removed
    logits[1, 1, 7] = 1e30  # one overwhelming token
    for x in (logits, logits / 0.37, logits.double()):
        kept = x.clone()
        assert torch.equal(token_entropy(x), torch.distributions.Categorical(logits=x).entropy())
        assert torch.equal(x, kept)
    # With gradients it is Categorical's own graph.
    leaf = logits[:, :4].clone().requires_grad_()
    token_entropy(leaf).sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad[2]).all()


def test_a_steps_probabilities_are_recomputed_bit_identically():
    """x0_probs is not kept by the step (one (B, L, V) tensor fewer); reading it gives softmax of the scaled logits."""
    logits = torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(2)) * 5
    s = EntropyBoundSampler(50, num_steps=8)
    out = s.step(logits, 5, torch.zeros(2, 6, dtype=torch.long), torch.Generator().manual_seed(0))
    assert torch.equal(out.x0_probs, torch.softmax(s.scale_logits(logits, 5), dim=-1, dtype=torch.float32))


def test_acceptance_by_hand():
    # sorted: .01 (3), .02 (1), .06 (4), .30 (0), .50 (2); C_m - M_m = 0, .01, .03, .09, .39
    entropy = torch.tensor([[0.30, 0.02, 0.50, 0.01, 0.06]])
    assert entropy_bound_accept(entropy, 0.1).tolist() == [[True, True, False, True, True]]
    assert entropy_bound_accept(entropy, 0.05).tolist() == [[False, True, False, True, True]]
    # The most confident position is always accepted, however small the bound.
    assert entropy_bound_accept(torch.tensor([[2.0, 3.0, 1.5]]), 1e-9).tolist() == [[False, False, True]]


def test_step_keeps_accepted_tokens_and_renoises_the_rest():
    V, B, L = 11, 3, 9
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, L, V, generator=g) * 4
    z = torch.randint(0, V, (B, L), generator=g)
    s = EntropyBoundSampler(V, entropy_bound=0.5, num_steps=10)
    out = s.step(logits, 7, z, torch.Generator().manual_seed(3))
    scaled = logits / s.temperature(7)
    torch.testing.assert_close(out.scaled_logits, scaled)
    assert torch.equal(out.argmax, scaled.argmax(-1))
    assert torch.equal(out.accepted, entropy_bound_accept(token_entropy(scaled), 0.5))
    # Replay the draws: one multinomial per position, then a uniform re-noising canvas.
    g2 = torch.Generator().manual_seed(3)
    drawn = torch.multinomial(scaled.softmax(-1).view(-1, V), 1, generator=g2).view(B, L)
    noise = torch.randint(0, V, (B, L), generator=g2)
    assert torch.equal(out.prev_sample, torch.where(out.accepted, drawn, noise))
    # Last step: the greedy canvas.
    last = s.step(logits, 1, z, torch.Generator().manual_seed(3))
    assert torch.equal(last.prev_sample, (logits / s.temperature(1)).argmax(-1))


def test_per_row_steps_equal_separate_calls():
    V = 13
    g = torch.Generator().manual_seed(2)
    logits, z = torch.randn(3, 4, V, generator=g), torch.randint(0, V, (3, 4), generator=g)
    s = EntropyBoundSampler(V, num_steps=8)
    steps = torch.tensor([8, 5, 1])
    together = s.step(logits, steps, z, torch.Generator().manual_seed(0))
    for row, n in enumerate(steps.tolist()):
        torch.testing.assert_close(together.scaled_logits[row], s.scale_logits(logits[row : row + 1], n)[0])
    assert torch.equal(together.prev_sample[2], together.argmax[2])  # row at n = 1 returns the greedy canvas


def test_gumbel_draws_follow_the_distribution():
    V = 4
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(1, 20000, V) * 0.8  # scaled back by tau = 0.8 at n = T
    s = EntropyBoundSampler(V, entropy_bound=1e9, num_steps=5, categorical="gumbel")  # accept everything
    out = s.step(logits, 5, torch.zeros(1, 20000, dtype=torch.long), torch.Generator().manual_seed(0))
    freq = torch.bincount(out.prev_sample.flatten(), minlength=V).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_same_seed_same_output_and_validation():
    V = 9
    logits = torch.randn(2, 6, V, generator=torch.Generator().manual_seed(0))
    z = torch.zeros(2, 6, dtype=torch.long)
    s = EntropyBoundSampler(V, num_steps=4)
    a = s.step(logits, 3, z, torch.Generator().manual_seed(5)).prev_sample
    b = s.step(logits, 3, z, torch.Generator().manual_seed(5)).prev_sample
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="1..4"):
        s.step(logits, 5, z)
    with pytest.raises(ValueError, match="valid: multinomial, gumbel"):
        EntropyBoundSampler(V, categorical="topk")
    with pytest.raises(ValueError, match="temperature_min <= temperature_max"):
        EntropyBoundSampler(V, temperature_max=0.3, temperature_min=0.4)


def test_matches_transformers_sampler_and_temperature_processor():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler as HFSampler,
        EntropyBoundSamplerConfig,
        LinearTemperatureScheduleLogitsProcessor,
    )

    V, B, L, T = 17, 2, 12, 6
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, L, V, generator=g) * 3
    z = torch.randint(0, V, (B, L), generator=g)
    ours = EntropyBoundSampler(V, num_steps=T)
    for n in (T, 3, 1):
        torch.manual_seed(11)
        hf = HFSampler(EntropyBoundSamplerConfig(entropy_bound=0.1), L, V, T)
        processed = LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, T)(None, logits, torch.tensor(n, dtype=torch.int32))
        drawn = torch.multinomial(torch.softmax(processed, -1, dtype=torch.float32).view(-1, V), 1).view(B, L)
        renoised = hf.renoise_canvas(hf.accept_canvas(z, drawn, processed, n), n)
        torch.manual_seed(11)
        out = ours.step(logits, n, z)
        assert torch.equal(out.scaled_logits, processed)
        assert torch.equal(out.accepted, hf.accepted_token_mask)
        expected = processed.argmax(-1) if n == 1 else renoised
        assert torch.equal(out.prev_sample, expected)


def test_build_sampler_fills_in_the_vocabulary_of_a_post_trained_backbone(gemma):
    model = AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), FusionSpec(rank=8, num_heads=2))
    sampler = build_sampler("entropy-bound", model, entropy_bound=0.2)
    assert isinstance(sampler, EntropyBoundSampler)
    assert (sampler.vocab_size, sampler.entropy_bound) == (model.vocab_size, 0.2) == (128, 0.2)
