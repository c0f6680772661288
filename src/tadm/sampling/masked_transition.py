"""Drawing z_s from the factorised masked / remasking posterior without building (B, L, V) tensors.

One reverse step is split in two so that a network need only compute x_theta where it is used:
:func:`draw_moves` draws the step's uniforms and decides which masked positions are decoded (and,
for ReMDM, which decoded ones are remasked) before the network runs; :func:`apply_moves` then
draws the new tokens from x_theta on the decoded rows only. :func:`masked_transition` is both in
one call on a full (B, L, V) output; the two paths consume the generator identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tadm.sampling.categorical import nucleus_filter, sample_categorical


@dataclass
class Moves:
    """The position-level decisions of one reverse step, taken before x_theta is known.

    u: (B, L) float64 uniforms, one per position, deciding both moves;
    masked: (B, L) positions masked in z_t;
    rows: (n, 2) (batch, position) pairs decoded this step (masked and u < unmask probability);
    remask: (B, L) decoded positions of z_t that are masked again, or None (MDLM).
    """

    u: Tensor
    masked: Tensor
    rows: Tensor
    remask: Tensor | None


def draw_moves(
    z_t: Tensor,
    unmask_prob: Tensor | float,
    remask_prob: Tensor | float | None,
    mask_id: int,
    generator: torch.Generator | None,
) -> Moves:
    """Which positions move at this step of Eq. (remdm-param) (Eq. (mdlm-posterior-unk) without remasking).

    ``unmask_prob``, ``remask_prob``: (B, L) move probabilities from ``remdm_move_probs``, or one
    number for every position (``remdm_move_probs_scalar``). Reading
    ``rows`` is the step's one host-device synchronisation on a GPU (the number of decoded rows).
    """
    masked = z_t == mask_id  # (B, L)
    u = torch.rand(z_t.shape, generator=generator, device=z_t.device, dtype=torch.float64)
    rows = (masked & (u < unmask_prob)).nonzero()  # (n, 2)
    # the same uniform decides both moves: a position is either masked or not, never both
    remask = None if remask_prob is None else ~masked & (u < remask_prob)
    return Moves(u=u, masked=masked, rows=rows, remask=remask)


def apply_moves(
    row_log_probs: Tensor,
    moves: Moves,
    z_t: Tensor,
    mask_id: int,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    nucleus: str = "released",
) -> tuple[Tensor, Tensor]:
    """Draw the decoded rows' tokens from x_theta and build z_s.

    Args:
        row_log_probs: (n, V) log x_theta at ``moves.rows`` (SUBS: no mass on the mask id).
        moves: the step's decisions from :func:`draw_moves`.
        top_p, nucleus: nucleus filtering of x_theta (see ``nucleus_filter``), in float64 on the n rows.

    Returns:
        (z_s (B, L), probability (n,) each new token had under the filtered x_theta).
    """
    rows = moves.rows
    probs = nucleus_filter(row_log_probs.double().exp(), top_p, nucleus)  # (n, V)
    new_tokens = sample_categorical(probs, generator)  # (n,)
    z_s = z_t.clone()
    z_s[rows[:, 0], rows[:, 1]] = new_tokens
    if moves.remask is not None:
        z_s = torch.where(moves.remask, mask_id, z_s)
    confidence = probs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # (n,)
    return z_s, confidence


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
    moves = draw_moves(z_t, unmask_prob, remask_prob, mask_id, generator)
    rows = moves.rows
    z_s, confidence = apply_moves(log_probs[rows[:, 0], rows[:, 1]], moves, z_t, mask_id, top_p, generator, nucleus)
    return z_s, rows, confidence
