"""Reverse posteriors q(z_s | z_t, x) with x replaced by a predicted distribution x_theta.

* ``reverse_posterior``: the general Eq. (rev-posterior) for any prior pi (a reference).
* ``masked_posterior``: absorbing prior, Eq. (mdlm-posterior-unk) (MDLM).
* ``remdm_posterior``: absorbing prior with remasking, Eq. (remdm-param) / (inf-post-TADM) (ReMDM,
  TADM), with the remasking probabilities of ``remdm_sigma``.
* ``usdm_posterior``: uniform prior, Eq. (usdm-rev-posterior-unk).

All return probabilities (B, L, V) in the dtype of ``x_probs``, rows summing to 1. Times are
given through alpha_t and alpha_s (s < t, so alpha_s >= alpha_t); each may be a Python number, a
0-d tensor, (B,), (B, 1) or (B, L).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from tadm.diffusion.forward import _column, _per_token


REMDM_STRATEGIES = ("cap", "rescale", "conf", "loop")


def _safe_den(den: Tensor) -> Tensor:
    """Keep 1 - alpha_t (or alpha_s) away from 0 so t = 0 rows give 0 coefficients, not NaN."""
    return den.clamp_min(torch.finfo(den.dtype).tiny)


def reverse_posterior(
    x_probs: Tensor, z_t_onehot: Tensor, alpha_t: Tensor | float, alpha_s: Tensor | float, prior: Tensor
) -> Tensor:
    """General reverse posterior of Eq. (rev-posterior) with x replaced by a distribution.

        q(z_s | z_t, x) = [a_{t|s} z_t + (1 - a_{t|s}) 1 pi^T z_t] * [a_s x + (1 - a_s) pi]
                          / (a_t z_t^T x + (1 - a_t) z_t^T pi),    a_{t|s} = a_t / a_s.

    The numerator sums to the denominator for any distribution x, so rows sum to 1. Rows where z_t
    is impossible under x (denominator 0) are NaN: this is a reference for tests, not a sampler.

    Args:
        x_probs: (B, L, V) clean-token distribution.
        z_t_onehot: (B, L, V) one-hot current state.
        alpha_t, alpha_s: schedule values at t and s < t.
        prior: (V,) limiting distribution pi.

    Returns:
        (B, L, V) probabilities of z_s.
    """
    dtype = x_probs.dtype
    a_t = _per_token(alpha_t, x_probs, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    a_s = _per_token(alpha_s, x_probs, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    z = z_t_onehot.to(dtype)  # (B, L, V)
    pi = prior.to(dtype=dtype, device=x_probs.device)  # (V,)
    a_ts = a_t / _safe_den(a_s)
    pi_z = (z * pi).sum(-1, keepdim=True)  # (B, L, 1) = pi^T z_t
    num = (a_ts * z + (1.0 - a_ts) * pi_z) * (a_s * x_probs + (1.0 - a_s) * pi)  # (B, L, V)
    den = a_t * (z * x_probs).sum(-1, keepdim=True) + (1.0 - a_t) * pi_z  # (B, L, 1)
    return num / den


def masked_posterior(
    x_probs: Tensor, z_t: Tensor, alpha_t: Tensor | float, alpha_s: Tensor | float, mask_id: int
) -> Tensor:
    """MDLM reverse step p_theta(z_s | z_t), Eq. (mdlm-posterior-unk).

    Unmasked positions are carried over (one-hot of z_t); a masked position becomes
    (a_s - a_t) / (1 - a_t) x_theta + (1 - a_s) / (1 - a_t) m. x_theta is expected to put no mass
    on the mask id (zero-masking); any mass it does put there adds to staying masked.

    Args:
        x_probs: (B, L, V) predicted clean-token distribution x_theta(z_t).
        z_t: (B, L) current token ids.
        alpha_t, alpha_s: schedule values at t and s < t.
        mask_id: id of the mask token (inside V).

    Returns:
        (B, L, V) probabilities of z_s.
    """
    dtype = x_probs.dtype
    V = x_probs.shape[-1]
    a_t = _per_token(alpha_t, z_t, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    a_s = _per_token(alpha_s, z_t, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    one_minus_at = _safe_den(1.0 - a_t)
    # Rounding can put alpha_s a hair below alpha_t; a negative weight would not be a probability.
    coef_x = ((a_s - a_t) / one_minus_at).clamp_min(0.0)  # (B, L, 1)
    coef_m = ((1.0 - a_s) / one_minus_at).clamp_min(0.0)  # (B, L, 1)
    masked_row = coef_x * x_probs  # (B, L, V)
    masked_row[..., mask_id] += coef_m.squeeze(-1)
    keep_row = F.one_hot(z_t, V).to(dtype)  # (B, L, V)
    return torch.where((z_t == mask_id).unsqueeze(-1), masked_row, keep_row)


def remdm_sigma_max(alpha_t: Tensor | float, alpha_s: Tensor | float) -> Tensor:
    """Largest valid remasking probability sigma_t^max = clamp((1 - alpha_s) / alpha_t, 0, 1) (ReMDM).

    Beyond it the mask coefficient (1 - a_s - sigma a_t) / (1 - a_t) of Eq. (remdm-param) would be negative.

    Returns:
        A tensor broadcastable to (B, L): 0-d for scalar inputs, (B, 1) for per-example inputs.
    """
    a_t = _column(alpha_t)
    a_s = _column(alpha_s, device=a_t.device)
    # alpha_t = 0 gives +inf (or NaN when alpha_s = 1, an impossible pair): both clamp to 1.
    ratio = (1.0 - a_s) / a_t
    return torch.nan_to_num(ratio, nan=1.0).clamp(0.0, 1.0)


def remdm_sigma(
    strategy: str,
    alpha_t: Tensor | float,
    alpha_s: Tensor | float,
    eta: float,
    confidence: Tensor | None = None,
) -> Tensor:
    """Remasking probability sigma_t for the ReMDM strategies, used in Eq. (remdm-param) / (inf-post-TADM).

    * ``"cap"``: min(eta, sigma_max).
    * ``"rescale"``: eta * sigma_max.
    * ``"conf"``: per token, softmax over decoded positions of (-confidence), times sigma_max, so
      tokens decoded with low confidence are the likeliest to be remasked. ``confidence`` (B, L)
      holds the probability each decoded token had when it was decoded; positions whose
      confidence is not finite (-inf or NaN: the convention for positions still masked) get
      sigma 0, and so does every position of a row with nothing decoded. ``eta`` is unused.
    * ``"loop"``: the constant eta (the loop sampler calls this only inside its [t_off, t_on] window).

    Args:
        strategy: one of ``REMDM_STRATEGIES``.
        alpha_t, alpha_s: schedule values at t and s < t.
        eta: remasking strength, >= 0.
        confidence: (B, L), required for "conf".

    Returns:
        sigma, broadcastable to (B, L) ((B, L) for "conf").

    Raises:
        ValueError: unknown strategy, eta < 0, or "conf" without a (B, L) confidence.
    """
    if strategy not in REMDM_STRATEGIES:
        raise ValueError(f"unknown ReMDM strategy {strategy!r}; valid: {', '.join(REMDM_STRATEGIES)}")
    if eta < 0:
        raise ValueError(f"ReMDM eta must be >= 0, got {eta}")
    sigma_max = remdm_sigma_max(alpha_t, alpha_s)
    if strategy == "cap":
        return sigma_max.clamp_max(eta)
    if strategy == "rescale":
        return eta * sigma_max
    if strategy == "loop":
        return torch.full_like(sigma_max, eta)
    if confidence is None or confidence.dim() != 2:
        shape = None if confidence is None else tuple(confidence.shape)
        raise ValueError(f"ReMDM strategy 'conf' needs a (B, L) confidence tensor, got {shape}")
    conf = confidence if confidence.is_floating_point() else confidence.to(torch.get_default_dtype())
    decoded = torch.isfinite(conf)  # (B, L)
    scores = torch.where(decoded, -conf, float("-inf"))  # (B, L)
    # A row with nothing decoded softmaxes to NaN; the where below turns it into zeros.
    eta_conf = torch.where(decoded, torch.softmax(scores, dim=-1), 0.0)  # (B, L)
    return eta_conf * sigma_max.to(device=conf.device, dtype=conf.dtype)


def remdm_move_probs(
    z_t: Tensor, alpha_t: Tensor | float, alpha_s: Tensor | float, sigma: Tensor | float = 0.0
) -> tuple[Tensor, Tensor]:
    """Per-token move probabilities of the remasking posterior, Eq. (remdm-param) / (inf-post-TADM).

    The reverse step factorises: a masked token is unmasked, to a draw of x_theta, with probability
    (a_s - (1 - sigma) a_t) / (1 - a_t) and otherwise stays masked; a decoded token is remasked with
    probability sigma and otherwise kept. sigma = 0 gives MDLM, Eq. (mdlm-posterior-unk). Weights made
    slightly negative by rounding (or by a sigma above sigma_max) are clamped at 0 and renormalised.

    Args:
        z_t: (B, L) current token ids (only its shape and device are used).
        alpha_t, alpha_s: schedule values at t and s < t.
        sigma: remasking probability; scalar, (B,), (B, 1) or (B, L).

    Returns:
        (unmask_prob, remask_prob), each (B, L) in float64.
    """
    a_t = _per_token(alpha_t, z_t, dtype=torch.float64)  # (B, L)
    a_s = _per_token(alpha_s, z_t, dtype=torch.float64)  # (B, L)
    sig = _per_token(sigma, z_t, dtype=torch.float64)  # (B, L)
    one_minus_at = _safe_den(1.0 - a_t)
    coef_x = ((a_s - (1.0 - sig) * a_t) / one_minus_at).clamp_min(0.0)
    coef_m = ((1.0 - a_s - sig * a_t) / one_minus_at).clamp_min(0.0)
    return coef_x / _safe_den(coef_x + coef_m), sig


def remdm_move_probs_scalar(alpha_t: float, alpha_s: float, sigma: float = 0.0) -> tuple[float, float]:
    """:func:`remdm_move_probs` for scalar alpha_t, alpha_s and sigma, in Python floats (IEEE doubles).

    The same operations in the same order, so the values equal the float64 tensor version's bit for
    bit; a sampler compares its uniforms with them without creating a device tensor from a host
    number (which would synchronise a GPU).
    """
    tiny = sys.float_info.min  # == torch.finfo(torch.float64).tiny
    one_minus_at = max(1.0 - alpha_t, tiny)
    coef_x = max((alpha_s - (1.0 - sigma) * alpha_t) / one_minus_at, 0.0)
    coef_m = max((1.0 - alpha_s - sigma * alpha_t) / one_minus_at, 0.0)
    return coef_x / max(coef_x + coef_m, tiny), sigma


def remdm_posterior(
    x_probs: Tensor,
    z_t: Tensor,
    alpha_t: Tensor | float,
    alpha_s: Tensor | float,
    sigma: Tensor | float,
    mask_id: int,
) -> Tensor:
    """ReMDM / TADM reverse step, Eq. (remdm-param) and (inf-post-TADM), as (B, L, V) probabilities.

    Unmasked: (1 - sigma) one_hot(z_t) + sigma m  (carry-over: x_theta = z_t there).
    Masked:   (a_s - (1 - sigma) a_t) / (1 - a_t) x_theta + (1 - a_s - sigma a_t) / (1 - a_t) m.

    With sigma = 0 this is ``masked_posterior``. With x_theta = one_hot(x) it keeps the marginals of
    Eq. (fwd): a sample of q(z_t | x) stepped through it is masked with probability 1 - a_s.
    The weights come from ``remdm_move_probs`` (clamped and renormalised), so rows always sum to 1.

    Args:
        x_probs: (B, L, V) predicted clean-token distribution.
        z_t: (B, L) current token ids.
        alpha_t, alpha_s: schedule values at t and s < t.
        sigma: remasking probability; scalar, (B,), (B, 1) or (B, L).
        mask_id: id of the mask token (inside V).

    Returns:
        (B, L, V) probabilities of z_s.
    """
    dtype = x_probs.dtype
    V = x_probs.shape[-1]
    unmask, remask = remdm_move_probs(z_t, alpha_t, alpha_s, sigma)
    unmask = unmask.to(dtype).unsqueeze(-1)  # (B, L, 1)
    sig = remask.to(dtype).unsqueeze(-1)  # (B, L, 1)
    masked_row = unmask * x_probs  # (B, L, V)
    masked_row[..., mask_id] += (1.0 - unmask).squeeze(-1)
    keep_row = (1.0 - sig) * F.one_hot(z_t, V).to(dtype)  # (B, L, V)
    keep_row[..., mask_id] += sig.squeeze(-1)
    return torch.where((z_t == mask_id).unsqueeze(-1), masked_row, keep_row)


def usdm_posterior(
    x_probs: Tensor, z_t: Tensor, alpha_t: Tensor | float, alpha_s: Tensor | float, vocab_size: int
) -> Tensor:
    """Uniform-state reverse step p_theta(z_s | z_t), Eq. (usdm-rev-posterior-unk).

        [K a_t z_t * x + (a_{t|s} - a_t) z_t + (a_s - a_t) x + (a_s - a_t)(1 - a_s) / (K a_s) 1]
        / (K a_t <z_t, x> + 1 - a_t),

    with K = ``vocab_size`` (the number of ids the noise is uniform over) and a_{t|s} = a_t / a_s.

    Args:
        x_probs: (B, L, K) predicted clean-token distribution.
        z_t: (B, L) current token ids in [0, K).
        alpha_t, alpha_s: schedule values at t and s < t.
        vocab_size: K; must equal the last dimension of ``x_probs``.

    Returns:
        (B, L, K) probabilities of z_s.
    """
    K = vocab_size
    if x_probs.shape[-1] != K:
        raise ValueError(f"usdm_posterior: x_probs last dim {x_probs.shape[-1]} != vocab_size {K}")
    dtype = x_probs.dtype
    a_t = _per_token(alpha_t, z_t, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    a_s = _per_token(alpha_s, z_t, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    a_s_safe = _safe_den(a_s)
    z = F.one_hot(z_t, K).to(dtype)  # (B, L, K)
    x_at_z = x_probs.gather(-1, z_t.unsqueeze(-1))  # (B, L, 1) = <z_t, x>
    num = (
        K * a_t * z * x_at_z
        + (a_t / a_s_safe - a_t) * z
        + (a_s - a_t) * x_probs
        + (a_s - a_t) * (1.0 - a_s) / (K * a_s_safe)
    )  # (B, L, K)
    den = K * a_t * x_at_z + 1.0 - a_t  # (B, L, 1)
    return num / den
