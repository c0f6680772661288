"""LLaDA's and Dream's samplers on their own: configs, the transfer schedule, the draws."""

from __future__ import annotations

import pytest
import torch

from tadm.cli.common import masked_samplers
from tadm.sampling import SAMPLERS, DreamSampler, LLaDASampler, get_sampler, sampler_config
from tadm.sampling.dream import sample_tokens, top_k_logits, top_p_logits
from tadm.sampling.llada import gumbel_perturbed, transfer_quota


def test_registry_names_and_options():
    assert {"llada", "dream-origin", "dream-maskgit-plus", "dream-topk-margin", "dream-entropy"} <= set(SAMPLERS)
    assert sampler_config("dream-entropy", temperature=0.2).alg == "entropy"
    with pytest.raises(ValueError, match="has no option.*alg"):
        sampler_config("dream-entropy", alg="origin")  # the name fixes the algorithm
    sampler = get_sampler("llada", mask_id=7, block_length=4, remasking="random", temperature=0.5)
    assert isinstance(sampler, LLaDASampler) and sampler.consumes == "logits" and sampler.mask_id == 7
    assert isinstance(get_sampler("dream-origin", mask_id=7), DreamSampler)


@pytest.mark.parametrize("options, message", [
    (dict(remasking="lowest"), "unknown remasking 'lowest'; valid: low_confidence, random"),
    (dict(temperature=-1.0), "temperature must be a finite number in \\[0, inf\\)"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(block_length=0), "block_length must be an integer >= 1"),
])
def test_llada_config_errors_name_the_value(options, message):
    with pytest.raises(ValueError, match=message):
        sampler_config("llada", **options)


@pytest.mark.parametrize("name, options, message", [
    ("dream-origin", dict(top_p=0.0), "top_p must be a finite number in \\(0, 1\\]"),
    ("dream-origin", dict(top_k=0), "top_k must be an integer >= 1"),
    ("dream-origin", dict(alg_temp=0.5), "alg_temp applies to maskgit_plus, topk_margin and entropy, not origin"),
    ("dream-entropy", dict(alg_temp=-1.0), "alg_temp must be a finite number in \\[0, inf\\)"),
    ("dream-entropy", dict(eps=1.0), "eps must be < 1"),
    ("dream-entropy", dict(eps=0.0), "eps must be a finite number in \\(0, 1\\]"),
])
def test_dream_config_errors_name_the_value(name, options, message):
    with pytest.raises(ValueError, match=message):
        sampler_config(name, **options)


def test_transfer_quota_spreads_the_masks_evenly_front_loaded():
    masks = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert transfer_quota(masks, 3).tolist() == [[2, 2, 1], [1, 1, 0]]


def test_gumbel_perturbation_is_the_identity_at_zero_temperature_and_float64_otherwise():
    logits = torch.randn(2, 3, 5)
    assert gumbel_perturbed(logits, 0.0, None) is logits
    noisy = gumbel_perturbed(logits, 1.0, torch.Generator().manual_seed(0))
    assert noisy.dtype == torch.float64 and noisy.shape == logits.shape


def test_gumbel_argmax_draws_from_the_tempered_softmax():
    logits = torch.tensor([[[0.0, 1.0, 2.0]]]).expand(1, 20000, 3)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(gumbel_perturbed(logits, 1.0, g).argmax(-1).view(-1), minlength=3).double() / 20000
    assert torch.allclose(counts, torch.softmax(torch.tensor([0.0, 1.0, 2.0]), -1).double(), atol=0.02)


def test_top_p_and_top_k_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    low = torch.finfo(logits.dtype).min
    assert (top_p_logits(logits, 0.7) == low).tolist() == [[False, False, True, True]]  # the crossing id is kept
    assert (top_k_logits(logits, 1) == low).tolist() == [[False, True, True, True]]


def test_sample_tokens_confidences():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    confidence, x0 = sample_tokens(logits)
    assert x0.tolist() == [0] and torch.allclose(confidence, torch.tensor([0.6]))
    margin, _ = sample_tokens(logits, margin_confidence=True)
    assert torch.allclose(margin, torch.tensor([0.3]))
    negative_entropy, _ = sample_tokens(logits, neg_entropy=True)
    p = torch.tensor([0.6, 0.3, 0.1])
    assert torch.allclose(negative_entropy, (p * p.log()).sum().view(1), atol=1e-6)
    nan = torch.full((1, 3), float("nan"))
    _, drawn = sample_tokens(nan, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert drawn.shape == (1,)  # no probability vector: the argmax, as the public code falls back to


@pytest.mark.parametrize("sampler", [LLaDASampler(3), DreamSampler(3, alg="maskgit_plus")])
def test_steps_are_checked(sampler):
    sampler.set_timesteps(2)
    z = torch.full((1, 4), 3)
    with pytest.raises(ValueError, match="per-row step indices are not supported"):
        sampler.step(torch.zeros(1, 4, 5), torch.tensor([2]), z)
    with pytest.raises(ValueError, match="step index must be in 1..2"):
        sampler.step(torch.zeros(1, 4, 5), 3, z)
    with pytest.raises(ValueError, match=r"logits \(1, 3, 5\) must be \(B, L, V\)"):
        sampler.step(torch.zeros(1, 3, 5), 2, z)


def test_llada_reads_the_generation_region_at_the_first_step():
    sampler = LLaDASampler(3, block_length=2)
    sampler.set_timesteps(2)
    with pytest.raises(ValueError, match="starts at step i = T = 2"):
        sampler.step(torch.zeros(1, 4, 5), 1, torch.full((1, 4), 3))
    with pytest.raises(ValueError, match="ends in no masked positions"):
        sampler.step(torch.zeros(1, 4, 5), 2, torch.tensor([[0, 3, 1, 2]]))


@pytest.mark.parametrize("sampler", [LLaDASampler(3, block_length=2), DreamSampler(3, alg="entropy"),
                                     DreamSampler(3, alg="origin", temperature=1.0)])
def test_a_run_decodes_every_mask_and_keeps_the_prompt(sampler):
    g = torch.Generator().manual_seed(0)
    z = torch.tensor([[1, 2, 3, 3, 3, 3], [4, 0, 3, 3, 3, 3]])
    sampler.set_timesteps(4)
    for i in range(4, 0, -1):
        logits = torch.randn(2, 6, 5, generator=g)
        logits[..., 3] = -1e4  # a trained model does not predict the mask (the raw logits can, and are obeyed)
        z_new = sampler.step(logits, i, z, g).prev_sample
        assert torch.equal(z_new[z != 3], z[z != 3])
        z = z_new
    assert (z != 3).all() and z[:, :2].tolist() == [[1, 2], [4, 0]]


def test_tadm_sample_offers_only_the_samplers_tadm_models_can_serve():
    assert "mdlm" in masked_samplers() and not {"llada", "dream-entropy"} & set(masked_samplers())
