"""Training objectives: masked NELBO, T-ANELBO (with the anchor term), uniform-state NELBO and KD.

Every loss returns a PER-TOKEN tensor (B, L) and leaves the reduction (sum over L, mean over the
batch, division by the number of tokens, ...) to the caller. Losses are computed in float32, or in
float64 when the inputs are float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from tadm.diffusion.forward import _column, _per_token, _rand, further_mask, mask_corrupt
from tadm.diffusion.schedules import NoiseSchedule
from tadm.diffusion.time_sampling import last_refresh_step


def _loss_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _nll_at(log_probs: Tensor, targets: Tensor, dtype: torch.dtype) -> Tensor:
    """-log p(target) per token (B, L)."""
    return -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).to(dtype)


def _masked_weighted(weight: Tensor, nll: Tensor, masked: Tensor) -> Tensor:
    """weight * nll where ``masked``, exactly 0 elsewhere (B, L).

    Both factors are zeroed first so that an infinite weight (t = 0) or an infinite nll at a
    position that does not count cannot leak inf * 0 = NaN into the value or the gradient.
    """
    zero = torch.zeros((), dtype=nll.dtype, device=nll.device)
    return torch.where(masked, weight, zero) * torch.where(masked, nll, zero)


def discrete_weight(alpha_t: Tensor | float, alpha_s: Tensor | float, sigma: Tensor | float = 0.0) -> Tensor:
    """lambda_t = ((1 - sigma) a_t - a_s) / (1 - a_t) of Theorem T-ANELBO and Eq. (remdm-nelbo) (<= 0).

    The discrete-time NELBO adds lambda_t log <x_theta, x> at every masked position. With sigma = 0
    this is the weight (a_t - a_s) / (1 - a_t) of Eq. (masked-nelbo); T * lambda_t tends to
    -loss_weight(t) as T -> infinity.

    Returns:
        A tensor broadcastable to (B, L) (0-d for scalar inputs, (B, 1) for per-example inputs).
    """
    a_t = _column(alpha_t)
    a_s = _column(alpha_s, device=a_t.device)
    sig = _column(sigma, device=a_t.device)
    den = (1.0 - a_t).clamp_min(torch.finfo(a_t.dtype).tiny)
    return ((1.0 - sig) * a_t - a_s) / den


def masked_diffusion_loss(
    log_probs: Tensor, x: Tensor, z_t: Tensor, t: Tensor | float, schedule: NoiseSchedule, mask_id: int,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Continuous-time masked NELBO integrand (MDLM), the T -> infinity limit of Eq. (masked-nelbo).

        loss^l = loss_weight(t) * (-log p_theta(x^l | z_t))   if z_t^l = m,   0 otherwise,

    with loss_weight(t) = -alpha'_t / (1 - alpha_t) (1/t for the log-linear schedule). Averaging over
    t ~ U(0, 1) and summing over L gives the NELBO in nats per sequence.

    Args:
        log_probs: (B, L, V) log x_theta.
        x: (B, L) clean ids.
        z_t: (B, L) noisy ids.
        t: diffusion time; scalar, (B,), (B, 1) or (B, L).
        schedule: the noise schedule that produced z_t.
        mask_id: id of the mask token.
        dtype: the loss's dtype (default: that of ``log_probs``, at least float32); only the
            gathered (B, L) log-probabilities are converted to it.

    Returns:
        (B, L) per-token loss.
    """
    dtype = _loss_dtype(log_probs) if dtype is None else dtype
    loss_weight = schedule.loss_weight(_column(t, dtype=dtype, device=z_t.device))
    weight = _per_token(loss_weight, z_t, dtype=dtype)  # (B, L)
    nll = _nll_at(log_probs, x, dtype)  # (B, L)
    return _masked_weighted(weight, nll, z_t == mask_id)


@dataclass
class TANELBOTerms:
    """Per-token parts of the T-ANELBO; each (B, L)."""

    total: Tensor  # (B, L)  diffusion + gamma * anchor
    diffusion: Tensor  # (B, L)
    anchor: Tensor  # (B, L)  zeros when gamma == 0 or no anchor log-probs


def t_anelbo_loss(
    log_probs: Tensor,
    x: Tensor,
    z_t: Tensor,
    t: Tensor | float,
    schedule: NoiseSchedule,
    mask_id: int,
    *,
    anchor_log_probs: Tensor | None = None,
    z_tp: Tensor | None = None,
    t_anchor: Tensor | float | None = None,
    gamma: float = 0.0,
    anchor_targets: Tensor | None = None,
) -> TANELBOTerms:
    """Theorem T-ANELBO in continuous time with sigma = 0.

    diffusion^l = loss_weight(t) * (-log <x_theta^l(z_t, z_t'), x^l>)   at positions masked in z_t,
    anchor^l    = loss_weight(t') * (-log <y_A^l(z_t'), y^l>)          at positions masked in z_t',
    total       = diffusion + gamma * anchor.

    ``log_probs`` must come from the denoiser fed the stale anchor computed from z_t' (the
    continuous-time limit of T * lambda_t is -loss_weight(t), as in Eq. (masked-nelbo)). The anchor
    targets y default to the clean tokens x, the paper's choice of anchor tokens.

    Args:
        log_probs: (B, L, V) log x_theta(z_t, z_t').
        x: (B, L) clean ids.
        z_t: (B, L) current noisy ids.
        t: current time; scalar, (B,), (B, 1) or (B, L).
        schedule: the noise schedule.
        mask_id: id of the mask token.
        anchor_log_probs: (B, L, V_A) log-probabilities of the anchor network's token mixture y_A(z_t').
        z_tp: (B, L) stale anchor state z_t'.
        t_anchor: anchor time t' >= t.
        gamma: anchor weight, >= 0; gamma > 0 requires anchor_log_probs, z_tp and t_anchor.
        anchor_targets: (B, L) anchor ids y (default: x).

    Returns:
        TANELBOTerms of (B, L) tensors.
    """
    if gamma < 0:
        raise ValueError(f"T-ANELBO gamma must be >= 0, got {gamma}")
    diffusion = masked_diffusion_loss(log_probs, x, z_t, t, schedule, mask_id)  # (B, L)
    if gamma == 0:
        anchor = torch.zeros_like(diffusion)
        return TANELBOTerms(total=diffusion, diffusion=diffusion, anchor=anchor)
    needed = (("anchor_log_probs", anchor_log_probs), ("z_tp", z_tp), ("t_anchor", t_anchor))
    missing = [name for name, value in needed if value is None]
    if missing:
        raise ValueError(f"T-ANELBO with gamma={gamma} > 0 needs {', '.join(missing)}")
    assert anchor_log_probs is not None and z_tp is not None and t_anchor is not None
    targets = x if anchor_targets is None else anchor_targets
    # the anchor term is the same masked integrand at (z_t', t'), in the diffusion term's dtype
    anchor = masked_diffusion_loss(anchor_log_probs, targets, z_tp, t_anchor, schedule, mask_id, dtype=diffusion.dtype)
    return TANELBOTerms(total=diffusion + gamma * anchor, diffusion=diffusion, anchor=anchor)


def usdm_loss(
    x_probs: Tensor, x: Tensor, z_t: Tensor, t: Tensor | float, schedule: NoiseSchedule, vocab_size: int
) -> Tensor:
    """Uniform-state continuous-time NELBO integrand at time t, Eq. (usdm-continuous-nelbo).

    With xbar = K a_t x + (1 - a_t) 1, xbar_theta = K a_t x_theta + (1 - a_t) 1 and i = z_t^l, the
    paper's bracket equals -sum_{j != i} r_j (u_j - 1 - log u_j) with r_j = xbar[j] / xbar[i] and
    u_j = (xbar_theta[j] xbar[i]) / (xbar_theta[i] xbar[j]) (using sum_j xbar[j] = K). So

        loss^l = -alpha'_t / (K alpha_t) * sum_{j != i} r_j (u_j - 1 - log u_j)  >= 0,

    evaluated from log-ratios with expm1 so that it is exactly 0 for x_theta = one_hot(x) and
    free of the cancellation between the paper's K / xbar terms.

    Args:
        x_probs: (B, L, K) x_theta (rows summing to 1).
        x: (B, L) clean ids in [0, K).
        z_t: (B, L) noisy ids in [0, K).
        t: time in (0, 1]; scalar, (B,), (B, 1) or (B, L).
        schedule: the noise schedule.
        vocab_size: K; must equal the last dimension of ``x_probs``.

    Returns:
        (B, L) per-token loss.
    """
    K = vocab_size
    if x_probs.shape[-1] != K:
        raise ValueError(f"usdm_loss: x_probs last dim {x_probs.shape[-1]} != vocab_size {K}")
    dtype = _loss_dtype(x_probs)
    t_col = _column(t, dtype=dtype, device=z_t.device)
    a = _per_token(schedule.alpha(t_col), z_t, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    da = _per_token(schedule.dalpha(t_col), z_t, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    log_xbar = torch.log(K * a * F.one_hot(x, K).to(dtype) + (1.0 - a))  # (B, L, K)
    log_xbar_theta = torch.log(K * a * x_probs.to(dtype) + (1.0 - a))  # (B, L, K)
    idx = z_t.unsqueeze(-1)  # (B, L, 1)
    log_r = log_xbar - log_xbar.gather(-1, idx)  # (B, L, K)  log(xbar[j] / xbar[i])
    log_u = (log_xbar_theta - log_xbar_theta.gather(-1, idx)) - log_r  # (B, L, K); 0 at j = i
    terms = torch.exp(log_r) * (torch.expm1(log_u) - log_u)  # (B, L, K)
    return (-da / (K * a)).squeeze(-1) * terms.sum(-1)


def kd_loss(
    teacher_logits: Tensor, student_logits: Tensor, temperature: float = 1.0, mask: Tensor | None = None
) -> Tensor:
    """Knowledge-distillation term of Eq. (anchor-sft-objective): KL(p_teacher || p_student) per token.

    Both distributions are softmax(logits / temperature); no temperature^2 factor is applied. The
    teacher (the frozen pretrained model) is a fixed target: its logits are detached.

    Args:
        teacher_logits: (B, L, V).
        student_logits: (B, L, V).
        temperature: softmax temperature, > 0.
        mask: optional (B, L) bool; the loss is 0 where it is False.

    Returns:
        (B, L) per-token KL in nats.
    """
    if temperature <= 0:
        raise ValueError(f"kd_loss temperature must be > 0, got {temperature}")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"kd_loss: teacher logits {tuple(teacher_logits.shape)} and student logits "
            f"{tuple(student_logits.shape)} differ in shape"
        )
    dtype = torch.promote_types(_loss_dtype(student_logits), teacher_logits.dtype)
    log_p = F.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)  # (B, L, V)
    log_q = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)  # (B, L, V)
    p = log_p.exp()
    # Teacher zeros contribute 0 (0 log 0 = 0), even where the student also has -inf.
    kl = torch.where(p > 0, p * (log_p - log_q), torch.zeros((), dtype=dtype, device=p.device)).sum(-1)  # (B, L)
    if mask is not None:
        kl = torch.where(mask, kl, torch.zeros((), dtype=dtype, device=kl.device))
    return kl


def discrete_masked_nelbo(
    log_probs_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    num_steps: int,
    schedule: NoiseSchedule,
    mask_id: int,
    generator: torch.Generator | None = None,
    maskable: Tensor | None = None,
) -> Tensor:
    """Monte-Carlo estimate of the discrete-time masked NELBO, Eq. (masked-nelbo), one z per step.

        sum_{i=1}^{T} (-lambda_{t(i)}) * (-log <x_theta(z_{t(i)}), x>)  at positions masked in z_{t(i)},
        + reconstruction -log p(x | z_0) at positions masked in z_0 ~ q(z_0 | x),

    with t(i) = i / T, s(i) = (i - 1) / T and lambda from ``discrete_weight`` (sigma = 0). Unmasked
    positions contribute 0 (carry-over). The prior term KL(q(z_1 | x) || p(z_1)) is left out, as
    in MDLM. Call it under ``torch.no_grad()`` for evaluation.

    Args:
        log_probs_fn: maps (z_t (B, L) ids, t (B,) times) to (B, L, V) log x_theta.
        x: (B, L) clean ids.
        num_steps: T >= 1.
        schedule: the noise schedule.
        mask_id: id of the mask token.
        generator: source of randomness for the z draws.
        maskable: optional (L,) or (B, L) bool, the positions the forward process corrupts; the others
            stay clean at every step (a context the bound is conditioned on) and add 0. The random
            draws are the same as without it.

    Returns:
        (B, L) per-token NELBO estimate in nats (sum over L for a per-sequence bound).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for i, _, z_t, weight in _discrete_steps(x, num_steps, schedule, mask_id, generator, maskable):
        lp = log_probs_fn(z_t, torch.full((x.shape[0],), i / num_steps, device=x.device))  # (B, L, V)
        total = total + _masked_weighted(weight, _nll_at(lp, x, total.dtype), z_t == mask_id)
    return total


def _discrete_steps(
    x: Tensor, num_steps: int, schedule: NoiseSchedule, mask_id: int, generator: torch.Generator | None,
    maskable: Tensor | None = None,
) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
    """The terms both discrete bounds sum, drawn lazily so a caller's own draws interleave in a fixed order.

    Yields (i, alpha_t, z_t (B, L), weight (B, L) float32): first the reconstruction at i = 0 with
    z_0 ~ q(z_0 | x) and weight 1 (only when z_0 holds a mask), then i = 1..T with
    t(i) = i / T, z_t(i) ~ q(z_t | x) and weight -lambda_t >= 0 from ``discrete_weight``. Positions
    outside ``maskable`` (when given) keep their clean token.
    """
    B, L = x.shape

    def corrupt(alpha: Tensor) -> Tensor:
        z = mask_corrupt(x, alpha, mask_id, generator)  # (B, L)
        return z if maskable is None else torch.where(maskable.to(x.device), z, x)

    alpha0 = schedule.alpha(torch.zeros((), dtype=torch.float64))
    z0 = corrupt(alpha0)  # (B, L)
    if bool((z0 == mask_id).any()):
        yield 0, alpha0, z0, torch.ones(B, L, dtype=torch.float32, device=x.device)
    for i in range(1, num_steps + 1):
        t = torch.tensor(i / num_steps, dtype=torch.float64)
        s = torch.tensor((i - 1) / num_steps, dtype=torch.float64)
        a_t, a_s = schedule.alpha(t), schedule.alpha(s)
        z_t = corrupt(a_t)  # (B, L)
        yield i, a_t, z_t, (-discrete_weight(a_t, a_s)).to(device=x.device, dtype=torch.float32).expand(B, L)


def discrete_cached_nelbo(
    log_probs_fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    x: Tensor,
    num_steps: int,
    refresh_intervals: Sequence[int],
    schedule: NoiseSchedule,
    mask_id: int,
    generator: torch.Generator | None = None,
    anchor_generator: torch.Generator | None = None,
    maskable: Tensor | None = None,
) -> dict[int, Tensor]:
    """Monte-Carlo discrete-time bound of the CACHED reverse process, Theorem T-ANELBO (sigma = gamma = 0).

    The reverse process of Eq. (joint-inf-post-TADM) denoises step i with the anchor of the most
    recent refresh, t'(i) = j / T with j = ``last_refresh_step(i, T, K)`` (Algorithm 1). Its bound is

        sum_{i=1}^{T} E_{q(z_t(i), z_t'(i) | x)} [ (-lambda_t(i)) (-log <x_theta(z_t(i), z_t'(i)), x>) ]
        + reconstruction -log p(x | z_0) at positions masked in z_0,

    with z_t(i) ~ q(z_t | x) (Eq. (fwd)), z_t'(i) ~ q(z_t' | z_t(i)) (Eq. (fwd_t_t')) and lambda from
    ``discrete_weight``; the reconstruction uses the anchor of step 1. One z_t(i) and one set of
    further-masking uniforms per step are shared by every K (common random numbers), so the bounds
    of different K differ only through the anchor ages. The z_t draws come from ``generator`` in the
    order of :func:`discrete_masked_nelbo` and the further masking from ``anchor_generator``. With a
    separate ``anchor_generator`` (as :func:`tadm.eval.likelihood.cached_process_nelbo` passes), K = 1
    (t' = t) reproduces :func:`discrete_masked_nelbo` with the same ``generator`` exactly; by default the
    further-masking draws come from ``generator`` too, between the z_t draws, which shifts them.
    A step whose anchor is fresh (j = i) passes ``z_t`` itself as the anchor state.

    Args:
        log_probs_fn: maps (z_t (B, L), t (B,), z_anchor (B, L), t_anchor (B,)) to (B, L, V) log x_theta.
        x: (B, L) clean ids.
        num_steps: T >= 1.
        refresh_intervals: the K values (each >= 1) to bound.
        schedule: the noise schedule.
        mask_id: id of the mask token.
        generator: source of the z_t draws.
        anchor_generator: source of the further-masking draws (default: ``generator``, interleaved).
        maskable: optional (L,) or (B, L) bool, the positions the forward process corrupts (as in
            :func:`discrete_masked_nelbo`); the others stay clean in z_t and in the anchor's z_t'.

    Returns:
        {K: (B, L) per-token bound in nats}.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    intervals = [int(k) for k in refresh_intervals]
    if not intervals or any(k < 1 for k in intervals):
        raise ValueError(f"refresh intervals K must be integers >= 1, got {list(refresh_intervals)}")
    anchor_generator = generator if anchor_generator is None else anchor_generator
    B, L = x.shape
    totals = {K: torch.zeros(B, L, dtype=torch.float32, device=x.device) for K in intervals}

    for i, a_t, z_t, weight in _discrete_steps(x, num_steps, schedule, mask_id, generator, maskable):
        u = _rand((B, L), anchor_generator, x.device)
        by_anchor: dict[int, Tensor] = {}  # anchor step j -> (B, L) nll; K values sharing j share a call
        for K in intervals:
            j = last_refresh_step(max(i, 1), num_steps, K)  # the reconstruction (i = 0) uses step 1's anchor
            if j not in by_anchor:
                a_tp = schedule.alpha(torch.tensor(j / num_steps, dtype=torch.float64))
                z_a = z_t if j == i else further_mask(z_t, a_t, a_tp, mask_id, uniform=u)  # (B, L)
                if maskable is not None and j != i:
                    z_a = torch.where(maskable.to(x.device), z_a, z_t)
                t = torch.full((B,), i / num_steps, device=x.device)
                lp = log_probs_fn(z_t, t, z_a, torch.full((B,), j / num_steps, device=x.device))  # (B, L, V)
                by_anchor[j] = _nll_at(lp, x, torch.float32)
            totals[K] = totals[K] + _masked_weighted(weight, by_anchor[j], z_t == mask_id)
    return totals
