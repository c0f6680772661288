"""Drawing z_s from the factorised masked / remasking posterior without building (B, L, V) tensors."""

from __future__ import annotations

import torch
from torch import Tensor

from tadm.sampling.categorical import nucleus_filter, sample_categorical


def masked_transition(
    log_probs: Tensor,
    z_t: Tensor,
    unmask_prob: Tensor,
    remask_prob: Tensor | None,
    mask_id: int,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    nucleus: str = "released",
) -> tuple[Tensor, Tensor, Tensor]:
    """One reverse step of Eq. (remdm-param) (Eq. (mdlm-posterior-unk) when ``remask_prob`` is None).

    Exact sampling of the posterior built by ``tadm.diffusion.remdm_posterior``, but only the rows
    that are unmasked in this step are turned into probabilities (nucleus-filtered, float64) and
    sampled, usually about L / T rows instead of all L x V entries.

    Args:
        log_probs: (B, L, V) log x_theta (SUBS: no mass on the mask id).
        z_t: (B, L) current canvas.
        unmask_prob, remask_prob: (B, L) move probabilities from ``remdm_move_probs``.
        mask_id: id of the mask token.
        top_p: nucleus mass applied to x_theta.
        nucleus: nucleus rule, "released" or "standard" (see ``nucleus_filter``).

    Returns:
        (z_s (B, L), indices (n, 2) of newly decoded positions, probability (n,) each new token had
        under the filtered x_theta).
    """
    masked = z_t == mask_id  # (B, L)
    u = torch.rand(z_t.shape, generator=generator, device=z_t.device, dtype=torch.float64)
    unmask = masked & (u < unmask_prob)
    rows = unmask.nonzero()  # (n, 2)
    probs = nucleus_filter(log_probs[rows[:, 0], rows[:, 1]].double().exp(), top_p, nucleus)  # (n, V)
    new_tokens = sample_categorical(probs, generator)  # (n,)
    z_s = z_t.clone()
    z_s[rows[:, 0], rows[:, 1]] = new_tokens
    if remask_prob is not None:
        # the same uniform decides both moves: a position is either masked or not, never both
        z_s = torch.where(~masked & (u < remask_prob), mask_id, z_s)
    confidence = probs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # (n,)
    return z_s, rows, confidence
