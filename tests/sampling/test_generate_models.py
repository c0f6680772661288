"""Algorithm 1 on the real networks: exactness of K = 1, layer counts against executed blocks."""

import pytest
import torch

from tadm.nn import DiTBlock, adlm_tiny, mdlm_tiny, tadm_tiny
from tadm.sampling import build_sampler, generate, get_sampler


def _randomize(model, scale=0.3):
    # Zero-initialised heads, adaLN gates and fusion would make every prediction uniform and every
    # comparison trivially equal; give every parameter random values instead.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def _uncached_generate(model, sampler, B, L, T, seed, time_conditioned=False):
    """The reference: a full fresh forward pass model(z_t) at every step, no cache object at all."""
    g = torch.Generator().manual_seed(seed)
    sampler.set_timesteps(T)
    z = sampler.initial_canvas(B, L, g, torch.device("cpu"))
    for i in range(T, 0, -1):
        t = torch.full((B,), sampler.time(i)) if time_conditioned else None
        with torch.no_grad():
            log_probs = model(z, t=t).log_probs
        z = sampler.step(log_probs, i, z, g).prev_sample
    return z


@pytest.mark.slow
@pytest.mark.parametrize("sampler_name", ["mdlm", "remdm-cap", "remdm-loop"])
@pytest.mark.parametrize("time_conditioning", [False, True])
def test_cache_with_K1_is_token_identical_to_uncached(sampler_name, time_conditioning):
    torch.manual_seed(0)
    model = _randomize(tadm_tiny(time_conditioning=time_conditioning)).eval()
    B, L, T = 3, 24, 20
    ref = _uncached_generate(model, get_sampler(sampler_name, model.mask_token_id), B, L, T, 7, time_conditioning)
    out = generate(model, get_sampler(sampler_name, model.mask_token_id), batch_size=B, seq_len=L, num_steps=T,
                   refresh_interval=1, generator=torch.Generator().manual_seed(7), time_conditioned=time_conditioning)
    assert torch.equal(out.tokens, ref)
    assert not torch.any(out.tokens == model.mask_token_id)


@pytest.mark.slow
def test_stale_anchor_prediction_differs_from_fresh_and_fusion_uses_current_canvas():
    torch.manual_seed(0)
    model = _randomize(tadm_tiny()).eval()
    mask = model.mask_token_id
    z_old = torch.full((2, 16), mask)
    z_new = z_old.clone()
    z_new[:, :8] = torch.arange(8)
    with torch.no_grad():
        stale = model.compute_anchor(model.encode(z_old))
        with_stale = model.predict(z_new, model.encode(z_new), stale)
        fresh = model(z_new).log_probs
        without_current = model.denoise(model.fuse(model.encode(z_old), stale), z_new)
    assert not torch.allclose(with_stale[:, 8:], fresh[:, 8:], atol=1e-4)
    # the fused prediction sees the current canvas through c_t even with the stale anchor
    assert not torch.allclose(with_stale[:, 8:], without_current[:, 8:], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("builder", [tadm_tiny, mdlm_tiny, adlm_tiny])
@pytest.mark.parametrize("T,K", [(10, 3), (12, 4), (5, 1)])
def test_counter_equals_executed_transformer_blocks(builder, T, K):
    model = _randomize(builder()).eval()
    executed = []
    for block in model.modules():
        if isinstance(block, DiTBlock):
            block.register_forward_hook(lambda *_: executed.append(1))
    out = generate(model, get_sampler("remdm-cap", model.mask_token_id), batch_size=2, seq_len=8, num_steps=T,
                   refresh_interval=K, generator=torch.Generator().manual_seed(0))
    assert out.layer_calls.total == len(executed)
    split = model.layer_split
    assert out.layer_calls.anchor == split.anchor * -(-T // K)
    assert out.layer_calls.denoiser == split.denoiser * T


@pytest.mark.slow
def test_adlm_naive_reuse_uses_the_stale_anchor():
    torch.manual_seed(0)
    model = _randomize(adlm_tiny()).eval()
    z_old = torch.full((1, 8), model.mask_token_id)
    z_new = z_old.clone()
    z_new[0, :4] = torch.arange(4)
    with torch.no_grad():
        stale = model.compute_anchor(model.encode(z_old))
        lp_stale = model.predict(z_new, model.encode(z_new), stale)
        lp_fresh = model(z_new)[0]
    # naive reuse: the prediction for still-masked positions ignores what changed since the refresh
    assert not torch.allclose(lp_stale[0, 4:], lp_fresh[0, 4:])


@pytest.mark.parametrize("name", ["mdlm", "remdm-cap", "remdm-loop"])
def test_a_sampler_name_builds_the_registry_sampler_for_the_model(name):
    """generate(model, "mdlm") is generate(model, build_sampler("mdlm", model)): the same tokens and calls."""
    model = tadm_tiny().eval()
    by_name = generate(model, name, batch_size=2, seq_len=16, num_steps=8, refresh_interval=2,
                       generator=torch.Generator().manual_seed(3))
    built = generate(model, build_sampler(name, model), batch_size=2, seq_len=16, num_steps=8, refresh_interval=2,
                     generator=torch.Generator().manual_seed(3))
    assert torch.equal(by_name.tokens, built.tokens)
    assert by_name.layer_calls.as_dict() == built.layer_calls.as_dict()


@pytest.mark.parametrize("sampler, error, match", [
    (None, TypeError, "sampler NoneType lacks set_timesteps"),
    ("ddim", ValueError, "unknown sampler 'ddim'"),
])
def test_a_sampler_that_is_not_one_is_refused_before_it_is_used(sampler, error, match):
    with pytest.raises(error, match=match):
        generate(tadm_tiny().eval(), sampler, batch_size=1, seq_len=8, num_steps=4)
    with pytest.raises(TypeError, match="model must be a CacheableDenoiser"):
        generate(None, "mdlm", batch_size=1, seq_len=8, num_steps=4)


def test_a_model_in_training_mode_samples_without_dropout_and_keeps_its_mode():
    torch.manual_seed(0)
    model = _randomize(tadm_tiny(dropout=0.5))  # training mode, as built
    assert model.training

    def sample() -> torch.Tensor:
        return generate(model, "mdlm", batch_size=2, seq_len=16, num_steps=8, refresh_interval=2,
                        generator=torch.Generator().manual_seed(3)).tokens

    first, second = sample(), sample()
    assert model.training  # put back as it was
    assert torch.equal(first, second)  # dropout on would draw other masks on each call
    assert torch.equal(first, generate(model.eval(), "mdlm", batch_size=2, seq_len=16, num_steps=8,
                                       refresh_interval=2, generator=torch.Generator().manual_seed(3)).tokens)
