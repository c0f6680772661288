import math

import pytest
import torch
import torch.nn.functional as F

from tadm.diffusion import (
    CosineSchedule,
    LinearSchedule,
    LogLinearSchedule,
    TANELBOTerms,
    discrete_cached_nelbo,
    discrete_masked_nelbo,
    discrete_weight,
    kd_loss,
    mask_corrupt,
    masked_diffusion_loss,
    remdm_posterior,
    reverse_posterior,
    sample_t,
    t_anelbo_loss,
    usdm_loss,
    usdm_posterior,
)

D = torch.float64
MASK = 3  # V = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tiny_example():
    probs = torch.tensor(
        [[[0.7, 0.2, 0.1, 0.0], [0.1, 0.8, 0.1, 0.0], [0.25, 0.25, 0.5, 0.0]]], dtype=torch.float32
    )  # (1, 3, 4)
    log_probs = probs.clamp_min(1e-30).log()
    x = torch.tensor([[0, 1, 2]])
    z_t = torch.tensor([[MASK, 1, MASK]])
    return probs, log_probs, x, z_t


# ---------------------------------------------------------------- masked NELBO


def test_masked_diffusion_loss_hand_computation():
    _, log_probs, x, z_t = _tiny_example()
    loss = masked_diffusion_loss(log_probs, x, z_t, torch.tensor([0.25]), LogLinearSchedule(), MASK)
    expected = torch.tensor([[4 * -math.log(0.7), 0.0, 4 * -math.log(0.5)]])
    assert loss.shape == (1, 3) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)


def test_masked_diffusion_loss_per_example_time_and_schedule():
    _, log_probs, x, z_t = _tiny_example()
    log_probs, x, z_t = log_probs.expand(2, -1, -1), x.expand(2, -1), z_t.expand(2, -1)
    t = torch.tensor([0.25, 0.5])
    sched = CosineSchedule()
    loss = masked_diffusion_loss(log_probs, x, z_t, t, sched, MASK)
    w = sched.loss_weight(t)
    torch.testing.assert_close(loss[:, 0], -w * math.log(0.7))
    torch.testing.assert_close(loss[:, 2], -w * math.log(0.5))
    assert (loss[:, 1] == 0).all()


def test_masked_diffusion_loss_in_a_given_dtype():
    _, log_probs, x, z_t = _tiny_example()
    t = torch.tensor([0.3])
    loss = masked_diffusion_loss(log_probs.to(torch.bfloat16), x, z_t, t, CosineSchedule(), MASK, dtype=torch.float64)
    expected = masked_diffusion_loss(log_probs.to(torch.bfloat16).double(), x, z_t, t.double(), CosineSchedule(), MASK)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_masked_diffusion_loss_zero_time_gives_finite_gradients():
    logits = torch.randn(1, 3, 4, requires_grad=True)
    x = torch.tensor([[0, 1, 2]])
    loss = masked_diffusion_loss(F.log_softmax(logits, -1), x, x, 0.0, LogLinearSchedule(), MASK)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros(1, 3))
    assert torch.isfinite(logits.grad).all()


def test_masked_diffusion_loss_bf16_inputs_return_float32():
    _, log_probs, x, z_t = _tiny_example()
    loss = masked_diffusion_loss(log_probs.bfloat16(), x, z_t, 0.5, LogLinearSchedule(), MASK)
    assert loss.dtype == torch.float32


# ---------------------------------------------------------------- T-ANELBO


def test_t_anelbo_gamma_zero_with_fresh_anchor_equals_masked_loss():
    _, log_probs, x, z_t = _tiny_example()
    t = torch.tensor([0.3])
    terms = t_anelbo_loss(log_probs, x, z_t, t, LogLinearSchedule(), MASK, z_tp=z_t, t_anchor=t)
    assert isinstance(terms, TANELBOTerms)
    ref = masked_diffusion_loss(log_probs, x, z_t, t, LogLinearSchedule(), MASK)
    torch.testing.assert_close(terms.diffusion, ref)
    torch.testing.assert_close(terms.total, ref)
    assert torch.equal(terms.anchor, torch.zeros(1, 3))


def test_t_anelbo_anchor_term_hand_computation():
    _, log_probs, x, z_t = _tiny_example()
    anchor_probs = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.2, 0.6, 0.2, 0.0], [0.1, 0.1, 0.8, 0.0]]])
    z_tp = torch.tensor([[MASK, MASK, MASK]])  # superset of z_t's masks
    t, t_anchor, gamma = torch.tensor([0.25]), torch.tensor([0.5]), 0.5
    terms = t_anelbo_loss(
        log_probs, x, z_t, t, LogLinearSchedule(), MASK,
        anchor_log_probs=anchor_probs.clamp_min(1e-30).log(), z_tp=z_tp, t_anchor=t_anchor, gamma=gamma,
    )
    # anchor weight 1 / t' = 2 at every position masked in z_t'
    expected_anchor = torch.tensor([[2 * -math.log(0.5), 2 * -math.log(0.6), 2 * -math.log(0.8)]])
    expected_diff = torch.tensor([[4 * -math.log(0.7), 0.0, 4 * -math.log(0.5)]])
    torch.testing.assert_close(terms.anchor, expected_anchor)
    torch.testing.assert_close(terms.diffusion, expected_diff)
    torch.testing.assert_close(terms.total, expected_diff + gamma * expected_anchor)


def test_t_anelbo_custom_anchor_targets_and_unmasked_anchor_positions():
    _, log_probs, x, z_t = _tiny_example()
    anchor_probs = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.2, 0.6, 0.2, 0.0], [0.1, 0.3, 0.6, 0.0]]])
    z_tp = torch.tensor([[MASK, 1, MASK]])
    targets = torch.tensor([[1, 1, 1]])
    terms = t_anelbo_loss(
        log_probs, x, z_t, 0.25, LogLinearSchedule(), MASK,
        anchor_log_probs=anchor_probs.log(), z_tp=z_tp, t_anchor=0.8, gamma=1.0, anchor_targets=targets,
    )
    expected_anchor = torch.tensor([[1.25 * -math.log(0.5), 0.0, 1.25 * -math.log(0.3)]])
    torch.testing.assert_close(terms.anchor, expected_anchor)


def test_t_anelbo_argument_errors():
    _, log_probs, x, z_t = _tiny_example()
    with pytest.raises(ValueError, match="anchor_log_probs.*z_tp.*t_anchor"):
        t_anelbo_loss(log_probs, x, z_t, 0.5, LogLinearSchedule(), MASK, gamma=0.1)
    with pytest.raises(ValueError, match="t_anchor"):
        t_anelbo_loss(
            log_probs, x, z_t, 0.5, LogLinearSchedule(), MASK, gamma=0.1, anchor_log_probs=log_probs, z_tp=z_t
        )
    with pytest.raises(ValueError, match="gamma"):
        t_anelbo_loss(log_probs, x, z_t, 0.5, LogLinearSchedule(), MASK, gamma=-1.0)


# ---------------------------------------------------------------- discrete weights


def test_discrete_weight_hand_values_and_remdm_consistency():
    torch.testing.assert_close(discrete_weight(0.4, 0.7), torch.tensor(-0.5, dtype=D))
    torch.testing.assert_close(discrete_weight(0.4, 0.7, 0.2), torch.tensor((0.32 - 0.7) / 0.6, dtype=D))
    # -lambda is the weight the ReMDM posterior puts on x_theta at a masked position
    x_probs = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]], dtype=D)
    post = remdm_posterior(x_probs, torch.tensor([[MASK]]), 0.4, 0.7, 0.2, MASK)
    torch.testing.assert_close(post[0, 0, 0], -discrete_weight(0.4, 0.7, 0.2))
    out = discrete_weight(torch.tensor([0.4, 0.5]), torch.tensor([0.7, 0.5]))
    assert out.shape == (2, 1)
    torch.testing.assert_close(out, torch.tensor([[-0.5], [0.0]]))


@pytest.mark.parametrize("sched", [LogLinearSchedule(), LinearSchedule(), CosineSchedule()], ids=lambda s: s.name)
def test_discrete_weight_continuous_limit(sched):
    """T * lambda(alpha(t), alpha(t - 1/T)) -> -loss_weight(t) as T -> infinity."""
    t = torch.tensor([0.2, 0.5, 0.8], dtype=D)
    errs = []
    for T in (10.0, 1e3, 1e5):
        approx = T * discrete_weight(sched.alpha(t), sched.alpha(t - 1.0 / T)).squeeze(-1)
        errs.append(((approx + sched.loss_weight(t)) / sched.loss_weight(t)).abs().max().item())
    if isinstance(sched, LogLinearSchedule):
        # alpha is linear in t, so the finite difference is exact at every T
        assert max(errs) < 1e-10
    else:
        assert errs[-1] < 1e-3
        assert errs[0] > errs[1] > errs[2]  # it converges, not merely agrees at one T
        assert errs[1] / errs[2] > 50  # first order in 1/T


# ---------------------------------------------------------------- uniform-state NELBO


def _usdm_paper(x_probs, x, z_t, t, sched, K):
    """Literal float64 transcription of Eq. (usdm-continuous-nelbo)'s integrand, loops and all."""
    B, L = x.shape
    out = torch.zeros(B, L, dtype=D)
    for b in range(B):
        tb = torch.tensor(float(t[b]), dtype=D)
        a, da = float(sched.alpha(tb)), float(sched.dalpha(tb))
        for l in range(L):
            xbar = [K * a * (1.0 if j == x[b, l] else 0.0) + (1 - a) for j in range(K)]
            xbt = [K * a * float(x_probs[b, l, j]) + (1 - a) for j in range(K)]
            i = int(z_t[b, l])
            bracket = K / xbar[i] - K / xbt[i]
            for j in range(K):
                if j == i:
                    continue
                bracket -= xbar[j] / xbar[i] * math.log(xbt[i] * xbar[j] / (xbt[j] * xbar[i]))
            out[b, l] = da / (K * a) * bracket
    return out


@pytest.mark.parametrize("sched", [LogLinearSchedule(), CosineSchedule()], ids=lambda s: s.name)
def test_usdm_loss_matches_paper_formula(sched):
    B, L, K = 3, 4, 5
    x = torch.randint(0, K, (B, L), generator=_gen(0))
    z_t = torch.randint(0, K, (B, L), generator=_gen(1))
    z_t[:, 0] = x[:, 0]  # both the z_t = x and z_t != x cases
    x_probs = torch.softmax(torch.randn(B, L, K, generator=_gen(2), dtype=D), -1)
    t = torch.tensor([0.1, 0.5, 0.95], dtype=D)
    out = usdm_loss(x_probs, x, z_t, t, sched, K)
    assert out.dtype == D
    torch.testing.assert_close(out, _usdm_paper(x_probs, x, z_t, t, sched, K), rtol=1e-9, atol=1e-12)
    assert (out > 0).all()


def test_usdm_loss_zero_iff_perfect_prediction():
    B, L, K = 2, 6, 5
    x = torch.randint(0, K, (B, L), generator=_gen(3))
    z_t = torch.randint(0, K, (B, L), generator=_gen(4))
    t = torch.tensor([0.3, 0.7])
    perfect = usdm_loss(F.one_hot(x, K).float(), x, z_t, t, LogLinearSchedule(), K)
    assert perfect.dtype == torch.float32
    assert torch.equal(perfect, torch.zeros(B, L))
    near = 0.99 * F.one_hot(x, K).float() + 0.01 / K
    assert (usdm_loss(near, x, z_t, t, LogLinearSchedule(), K) > 0).all()


def test_usdm_loss_is_the_limit_of_scaled_discrete_kl():
    """T * KL(q(z_s | z_t, x) || p_theta(z_s | z_t)) -> the continuous integrand, per position."""
    B, L, K = 2, 5, 5
    sched = LogLinearSchedule()
    x = torch.randint(0, K, (B, L), generator=_gen(5))
    z_t = torch.randint(0, K, (B, L), generator=_gen(6))
    x_probs = torch.softmax(torch.randn(B, L, K, generator=_gen(7), dtype=D), -1)
    t = torch.tensor([0.4, 0.8], dtype=D)
    T = 1e5
    a_t, a_s = sched.alpha(t), sched.alpha(t - 1 / T)
    q = reverse_posterior(F.one_hot(x, K).to(D), F.one_hot(z_t, K), a_t, a_s, torch.full((K,), 1 / K, dtype=D))
    p = usdm_posterior(x_probs, z_t, a_t, a_s, K)
    kl = (q * (q.log() - p.log())).sum(-1)
    torch.testing.assert_close(T * kl, usdm_loss(x_probs, x, z_t, t, sched, K), rtol=1e-3, atol=0)


# ---------------------------------------------------------------- KD


def test_kd_loss_matches_kl_div_reference():
    teacher = torch.randn(2, 5, 7, generator=_gen(8))
    student = torch.randn(2, 5, 7, generator=_gen(9))
    for temp in (1.0, 2.0):
        ref = F.kl_div(
            F.log_softmax(student / temp, -1), F.log_softmax(teacher / temp, -1), log_target=True, reduction="none"
        ).sum(-1)
        torch.testing.assert_close(kd_loss(teacher, student, temperature=temp), ref)
    assert not torch.allclose(kd_loss(teacher, student, 1.0), kd_loss(teacher, student, 2.0))


def test_kd_loss_zero_for_identical_logits_and_mask():
    logits = torch.randn(2, 5, 7, generator=_gen(10))
    torch.testing.assert_close(kd_loss(logits, logits.clone()), torch.zeros(2, 5), atol=1e-6, rtol=0)
    student = torch.randn(2, 5, 7, generator=_gen(11))
    mask = torch.tensor([[True, False, True, False, True]] * 2)
    out = kd_loss(logits, student, mask=mask)
    assert (out[~mask] == 0).all() and (out[mask] > 0).all()


def test_kd_loss_gradients_reach_only_the_student_and_tolerate_teacher_zeros():
    teacher = torch.randn(1, 3, 6, generator=_gen(12))
    teacher[..., 0] = float("-inf")  # zero teacher probability
    teacher.requires_grad_(True)
    student = torch.randn(1, 3, 6, generator=_gen(13), requires_grad=True)
    loss = kd_loss(teacher, student)
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert teacher.grad is None
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0


def test_kd_loss_errors():
    with pytest.raises(ValueError, match="temperature"):
        kd_loss(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), temperature=0.0)
    with pytest.raises(ValueError, match="shape"):
        kd_loss(torch.zeros(1, 1, 2), torch.zeros(1, 1, 3))


# ---------------------------------------------------------------- Monte-Carlo discrete NELBO


def _uniform_predictor(V: int):
    def fn(z_t, t):
        lp = torch.full((*z_t.shape, V), -math.log(V - 1))
        lp[..., MASK] = float("-inf")
        return lp

    return fn


def _oracle(x, V):
    def fn(z_t, t):
        return F.one_hot(x, V).float().clamp_min(1e-30).log()

    return fn


def test_discrete_nelbo_is_zero_for_an_oracle():
    x = torch.randint(0, MASK, (2, 16), generator=_gen(14))
    out = discrete_masked_nelbo(_oracle(x, 4), x, 20, LogLinearSchedule(), MASK, generator=_gen(15))
    assert out.shape == (2, 16)
    torch.testing.assert_close(out, torch.zeros(2, 16), atol=1e-6, rtol=0)


def test_discrete_nelbo_includes_the_reconstruction_term():
    """alpha_0 < 1: steps give (alpha_0 - alpha_1) log(V - 1) and z_0 adds (1 - alpha_0) log(V - 1)."""
    V, B, L = 4, 8, 4000
    sched = LinearSchedule(sigma_min=0.5, sigma_max=20.0)  # alpha_0 = exp(-0.5) ~ 0.61
    x = torch.randint(0, MASK, (B, L), generator=_gen(19))
    out = discrete_masked_nelbo(_uniform_predictor(V), x, 16, sched, MASK, generator=_gen(20))
    expected = (1 - math.exp(-20.0)) * math.log(V - 1)
    without_reconstruction = (math.exp(-0.5) - math.exp(-20.0)) * math.log(V - 1)
    assert abs(out.mean().item() - expected) < 0.02
    assert abs(out.mean().item() - without_reconstruction) > 0.3


def test_cached_bound_at_k1_with_its_own_anchor_stream_is_the_discrete_nelbo():
    """K = 1 (t' = t) is the uncached bound draw for draw when the further masking has its own generator."""
    V, B, L, T = 4, 3, 12, 9
    x = torch.randint(0, MASK, (B, L), generator=_gen(21))
    w = torch.randn(V, V, generator=_gen(22))

    def log_probs(z_t, t):  # depends on the canvas and the time, so another z_t draw gives another value
        lp = (w[z_t] + t[:, None, None]).log_softmax(-1)
        return lp.masked_fill(F.one_hot(torch.tensor(MASK), V).bool(), float("-inf")).log_softmax(-1)

    def cached(z_t, t, z_a, t_a):
        assert torch.equal(z_a, z_t) and torch.equal(t_a, t)  # K = 1: every anchor is fresh
        return log_probs(z_t, t)

    sched = LogLinearSchedule()
    reference = discrete_masked_nelbo(log_probs, x, T, sched, MASK, generator=_gen(23))
    own = discrete_cached_nelbo(cached, x, T, [1], sched, MASK, generator=_gen(23), anchor_generator=_gen(24))[1]
    torch.testing.assert_close(own, reference, rtol=0, atol=0)
    shared = discrete_cached_nelbo(cached, x, T, [1], sched, MASK, generator=_gen(23))[1]  # interleaved draws
    assert not torch.equal(shared, reference)


def test_discrete_and_continuous_nelbo_agree_for_a_uniform_predictor():
    """Uniform over the V - 1 real tokens: both NELBOs equal (alpha_0 - alpha_1) log(V - 1) per token."""
    V, B, L = 4, 8, 4000
    sched = LogLinearSchedule()
    expected = (1 - sched.eps) * math.log(V - 1)
    x = torch.randint(0, MASK, (B, L), generator=_gen(16))
    disc = discrete_masked_nelbo(_uniform_predictor(V), x, 16, sched, MASK, generator=_gen(17))
    # per-token terms are bounded by sum_i |lambda_i| log 3; 32000 tokens give a standard error well below 0.02
    assert abs(disc.mean().item() - expected) < 0.02
    # continuous time: average masked_diffusion_loss over t ~ U(0, 1)
    g = _gen(18)
    vals = []
    for _ in range(20):
        t = sample_t(B, eps=1e-3, generator=g)
        z_t = mask_corrupt(x, sched.alpha(t), MASK, generator=g)
        vals.append(masked_diffusion_loss(_uniform_predictor(V)(z_t, t), x, z_t, t, sched, MASK).mean())
    assert abs(torch.stack(vals).mean().item() - expected) < 0.03
