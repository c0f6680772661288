"""stale_fresh_divergence: KL(fresh || stale) and greedy agreement of fused and naive stale predictions."""

import pytest
import torch

from tadm.posttrain import AnchoredBackbone, DiffusionGemmaBackbone, FusionSpec, SplitSpec, StackContext
from tadm.posttrain.data import CanvasBatch
from tadm.posttrain.diagnostics import stale_fresh_divergence
from tadm.sampling.entropy_bound import EntropyBoundSampler

from .conftest import randomize

V, L, B, P = 128, 8, 2, 4


def _model(gemma, fusion_seed=None):
    model = AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), FusionSpec(rank=8, num_heads=2))
    if fusion_seed is not None:
        randomize(model.fusion, seed=fusion_seed, std=0.2)
    return model


def _batches(n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        batch = CanvasBatch(torch.randint(3, V, (B, P), generator=g), torch.ones(B, P, dtype=torch.bool),
                            torch.randint(3, V, (B, L), generator=g), torch.ones(B, L, dtype=torch.bool))
        out.append((batch, torch.Generator().manual_seed(100 + k)))
    return out


def test_two_steps_match_a_hand_computation(gemma):
    """T = 2, K = 2: only step i = 1 is stale (age 1), served from the anchor computed at i = 2."""
    model, sampler = _model(gemma, fusion_seed=3), EntropyBoundSampler(V, num_steps=2)
    batch, generator = _batches()[0]
    result = stale_fresh_divergence(model, [(batch, generator)], sampler, intervals=(2,))[2]

    g = torch.Generator().manual_seed(100)
    with torch.no_grad():
        prompt = model.backbone.prefill(batch.context_ids, batch.context_mask)
        z2 = sampler.initial_canvas(B, L, g, batch.targets.device)
        prepared2 = model.prepare(z2, StackContext(prompt=prompt))
        c2 = model.encode(z2, prepared=prepared2)
        anchor2 = model.compute_anchor(c2, prepared=prepared2)
        out = sampler.step(model.predict_logits(z2, c2, anchor2, prepared=prepared2), 2, z2, g)
        z1 = out.prev_sample
        prepared1 = model.prepare(z1, StackContext(prompt=prompt, self_conditioning_logits=out.scaled_logits))
        c1 = model.encode(z1, prepared=prepared1)
        fresh = model.fresh_logits(c1, prepared1).log_softmax(-1)
        expected = {}
        for key, mode in (("fused", "paired"), ("naive", "naive")):
            model.fusion_mode = mode
            stale = model.predict_logits(z1, c1, anchor2, prepared=prepared1).log_softmax(-1)
            expected[f"kl_{key}"] = float((fresh.exp() * (fresh - stale)).sum()) / (B * L)
            expected[f"agreement_{key}"] = float((stale.argmax(-1) == fresh.argmax(-1)).float().mean())
        model.fusion_mode = "paired"
    assert result["stale_tokens"] == B * L
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    assert result["kl_fused"] != pytest.approx(result["kl_naive"])


def test_stale_steps_are_counted_per_interval_and_the_fusion_mode_is_restored(gemma):
    model, sampler = _model(gemma, fusion_seed=4), EntropyBoundSampler(V, num_steps=4)
    model.fusion_mode = "naive"
    result = stale_fresh_divergence(model, _batches(2), sampler, intervals=(1, 2, 3))
    assert model.fusion_mode == "naive"
    # T = 4: age (T - i) mod K > 0 at i = 3, 1 for K = 2 and at i = 3, 2 for K = 3; never for K = 1
    assert [result[K]["stale_tokens"] for K in (1, 2, 3)] == [0, 2 * 2 * B * L, 2 * 2 * B * L]
    assert result[1]["kl_naive"] == result[1]["kl_fused"] == 0.0
    for K in (2, 3):
        assert result[K]["kl_naive"] > 0 and result[K]["kl_fused"] > 0
        assert 0.0 <= result[K]["agreement_naive"] <= 1.0 and 0.0 <= result[K]["agreement_fused"] <= 1.0


def test_a_zero_initialised_fusion_equals_naive_reuse(gemma):
    """Before post-training the fusion's output projection is zero: fused and naive stale predictions agree."""
    result = stale_fresh_divergence(_model(gemma), _batches(), EntropyBoundSampler(V, num_steps=4), intervals=(2,))[2]
    assert result["kl_fused"] == pytest.approx(result["kl_naive"], rel=1e-6)
    assert result["agreement_fused"] == result["agreement_naive"]
