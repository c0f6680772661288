import pytest
import torch

from tadm.diffusion import masked_posterior, remdm_posterior
from tadm.sampling import MDLMSampler, ReMDMSampler, get_sampler

V = 6
MASK = V - 1


def _log_probs(B=2, L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g)
    logits[..., MASK] = -float("inf")
    return torch.log_softmax(logits, -1)


def test_remdm_sigma_zero_equals_mdlm_step_distribution():
    z = torch.tensor([[MASK, 1, MASK, 3, MASK]] * 2)
    lp = _log_probs()
    mdlm, remdm = MDLMSampler(MASK), ReMDMSampler(MASK, "cap", eta=0.0, top_p=1.0)
    for s in (mdlm, remdm):
        s.set_timesteps(10)
    a_t, a_s = mdlm.alphas(7)
    assert (a_t, a_s) == remdm.alphas(7)
    p1 = masked_posterior(lp.double().exp(), z, a_t, a_s, MASK)
    p2 = remdm_posterior(lp.double().exp(), z, a_t, a_s, 0.0, MASK)
    torch.testing.assert_close(p1, p2)
    out1 = mdlm.step(lp, 7, z, torch.Generator().manual_seed(0)).prev_sample
    out2 = remdm.step(lp, 7, z, torch.Generator().manual_seed(0)).prev_sample
    assert torch.equal(out1, out2)


def test_mdlm_step_carries_over_and_unmask_rate():
    s = MDLMSampler(MASK)
    s.set_timesteps(4)
    B, L = 4000, 8
    z = torch.full((B, L), MASK)
    z[:, 0] = 2
    lp = _log_probs(B, L)
    out = s.step(lp, 3, z, torch.Generator().manual_seed(0)).prev_sample
    assert torch.all(out[:, 0] == 2)
    a_t, a_s = s.alphas(3)
    rate = (out[:, 1:] != MASK).double().mean().item()
    expected = (a_s - a_t) / (1 - a_t)
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / (B * (L - 1))) ** 0.5


def test_remdm_loop_alpha_path():
    s = ReMDMSampler(MASK, "loop", eta=0.02)
    s.set_timesteps(100)
    assert s.alphas(100)[0] == 0.0
    assert s.alphas(1)[1] == pytest.approx(1.0)
    assert s.alphas(50) == (0.9, 0.9)  # t = 0.5 lies in [t_off, t_on]: alpha held at alpha_on
    alphas = [s.alphas(i)[0] for i in range(100, 0, -1)]
    assert all(b >= a for a, b in zip(alphas, alphas[1:]))


def test_remdm_loop_holds_mask_rate_and_remasks():
    s = ReMDMSampler(MASK, "loop", eta=0.05, top_p=1.0)
    s.set_timesteps(100)
    B, L = 2000, 10
    g = torch.Generator().manual_seed(0)
    z = torch.where(torch.rand(B, L, generator=g) < 0.9, torch.randint(0, MASK, (B, L), generator=g), MASK)
    out = s.step(_log_probs(B, L), 50, z, g).prev_sample
    assert abs((out == MASK).double().mean().item() - 0.1) < 0.01  # stationary at 1 - alpha_on
    assert ((z != MASK) & (out == MASK)).any()  # decoded tokens were remasked


def test_remdm_conf_records_confidence_and_remasks_least_confident_more():
    s = ReMDMSampler(MASK, "conf", eta=1.0, top_p=1.0)
    s.set_timesteps(10)
    z = torch.full((1, 3), MASK)
    x0 = torch.tensor([[[0.9, 0.1, 0, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2, 0], [0.5, 0.5, 0, 0, 0, 0]]])
    lp = x0.clamp_min(1e-30).log()
    out = s.step(lp, 1, z, torch.Generator().manual_seed(0)).prev_sample  # last step decodes everything
    assert torch.all(out != MASK)
    expected_conf = x0[0, torch.arange(3), out[0]].double()
    torch.testing.assert_close(s._confidence[0], expected_conf)
    s.set_timesteps(10)
    s._confidence = expected_conf.unsqueeze(0).clone()
    a_t, a_s = s.alphas(5)
    sigma = s._sigma(5, a_t, a_s, out)
    sigma_max = min(1.0, (1 - a_s) / a_t)
    torch.testing.assert_close(sigma[0], torch.softmax(-expected_conf, 0) * sigma_max)


@pytest.mark.parametrize("name", ["mdlm", "remdm-cap", "remdm-rescale", "remdm-conf", "remdm-loop"])
def test_registry_builds_every_sampler(name):
    sampler = get_sampler(name, MASK)
    expected = {"mdlm": (MDLMSampler, None), "remdm-cap": (ReMDMSampler, "cap"),
                "remdm-rescale": (ReMDMSampler, "rescale"), "remdm-conf": (ReMDMSampler, "conf"),
                "remdm-loop": (ReMDMSampler, "loop")}[name]
    assert type(sampler) is expected[0] and getattr(sampler, "strategy", None) == expected[1]
    assert sampler.mask_id == MASK
    # the last step of a fully masked canvas under a one-hot x0 decodes exactly that x0
    sampler.set_timesteps(4)
    z = torch.full((1, 3), MASK)
    log_probs = torch.full((1, 3, MASK + 1), -1e4)
    log_probs[0, torch.arange(3), torch.tensor([2, 0, 1])] = 0.0
    out = sampler.step(log_probs, 1, z, torch.Generator().manual_seed(0)).prev_sample
    assert out.tolist() == [[2, 0, 1]]


def test_unknown_sampler_and_bad_parameters():
    with pytest.raises(ValueError, match="unknown sampler 'ddpm'.*mdlm"):
        get_sampler("ddpm", MASK)
    with pytest.raises(ValueError, match="top_p"):
        get_sampler("remdm-cap", MASK, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        MDLMSampler(MASK, top_p=1.2)
    with pytest.raises(ValueError, match="unknown .*schedule|schedule"):
        MDLMSampler(MASK, schedule="sqrt")
    with pytest.raises(ValueError, match="strategy"):
        ReMDMSampler(MASK, "sometimes")


@pytest.mark.slow
@pytest.mark.parametrize("sigma", [0.0, 0.05])
def test_factorised_transition_samples_the_remdm_posterior(sigma):
    from tadm.diffusion import remdm_move_probs
    from tadm.sampling.masked_transition import masked_transition

    N = 60_000
    x0 = torch.tensor([0.6, 0.3, 0.1, 0.0, 0.0, 0.0])  # SUBS: no mass on the mask id (5)
    z = torch.tensor([[MASK, 2]]).expand(N, 2).contiguous()
    a_t, a_s = 0.4, 0.55
    lp = x0.clamp_min(1e-30).log().expand(N, 2, V).contiguous()
    unmask, remask = remdm_move_probs(z, a_t, a_s, sigma)
    z_s, _, _ = masked_transition(lp, z, unmask, remask, MASK, 1.0, torch.Generator().manual_seed(0))
    expected = remdm_posterior(x0.double().expand(1, 2, V), z[:1], a_t, a_s, sigma, MASK)[0]  # (2, V)
    for pos in range(2):
        freq = torch.bincount(z_s[:, pos], minlength=V).double() / N
        std = (expected[pos] * (1 - expected[pos]) / N).sqrt()
        assert torch.all((freq - expected[pos]).abs() <= 5 * std + 1e-9), (pos, freq, expected[pos])


def test_paper_samplers_default_to_the_released_nucleus_rule():
    for name in ("mdlm", "remdm-cap", "remdm-loop"):
        sampler = get_sampler(name, MASK, top_p=0.9)
        assert sampler.nucleus == "released" and sampler.time_grid == "paper" and not sampler.final_denoise
    assert get_sampler("remdm-cap", MASK, nucleus="standard").nucleus == "standard"
    with pytest.raises(ValueError, match="unknown time grid 'cosine'; valid: paper, released"):
        get_sampler("mdlm", MASK, time_grid="cosine")


def test_released_time_grid_is_linspace_to_1e5_with_alpha_one_minus_t():
    for sampler in (MDLMSampler(MASK, time_grid="released"), ReMDMSampler(MASK, "cap", time_grid="released")):
        sampler.set_timesteps(4)
        grid = torch.linspace(1, 1e-5, 5, dtype=torch.float64)  # the released code's timesteps
        for i in range(4, -1, -1):
            assert sampler.time(i) == pytest.approx(float(grid[4 - i]), abs=1e-12)
        a_t, a_s = sampler.alphas(2)
        assert (a_t, a_s) == pytest.approx((1 - float(grid[2]), 1 - float(grid[3])))
        assert sampler.final_denoise
    paper = MDLMSampler(MASK)
    paper.set_timesteps(4)
    assert paper.time(2) == 0.5 and paper.alphas(1)[1] == pytest.approx(1.0)
