"""MDLM ancestral sampler: the masked reverse posterior of Eq. (mdlm-posterior-unk)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tadm.diffusion import get_schedule, remdm_move_probs_scalar
from tadm.sampling.base import MaskedSampler, check_number, check_step_rows, check_time_grid, grid_time
from tadm.sampling.categorical import check_nucleus
from tadm.sampling.masked_transition import Moves, draw_moves


@dataclass(frozen=True)
class MDLMSamplerConfig:
    """Settings of :class:`MDLMSampler` (validated on construction).

    schedule: noise schedule name ("loglinear", "linear", "cosine"), used on the "paper" grid.
    top_p: nucleus mass applied to x_theta before the posterior, a finite number in (0, 1].
    nucleus: nucleus rule, "released" (the released MDLM/ReMDM code) or "standard".
    time_grid: "paper" (t = i / T) or "released" (t = linspace(1, 1e-5, T + 1), final argmax call).
    """

    schedule: str = "loglinear"
    top_p: float = 1.0
    nucleus: str = "released"
    time_grid: str = "paper"

    def __post_init__(self) -> None:
        check_number("MDLM sampler", "top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_nucleus(self.top_p, self.nucleus)
        check_time_grid(self.time_grid)
        get_schedule(self.schedule)


class MDLMSampler(MaskedSampler):
    """Ancestral sampling for absorbing-state diffusion (MDLM).

    At step i a masked position is unmasked to a draw from x_theta with probability
    (alpha_s - alpha_t) / (1 - alpha_t); unmasked positions are carried over. The step index may be
    a (B,) tensor, one step per row (post-training rollouts): each row then moves with its own
    probability, computed with the same float64 operations as the scalar step.

    Args:
        mask_id: id of the mask token.
        schedule, top_p, nucleus, time_grid: see :class:`MDLMSamplerConfig`.
    """

    per_row_steps = True  # step() and plan_moves() take a (B,) tensor of step indices

    def __init__(
        self,
        mask_id: int,
        schedule: str = "loglinear",
        top_p: float = 1.0,
        nucleus: str = "released",
        time_grid: str = "paper",
    ) -> None:
        self._set_masked(mask_id, MDLMSamplerConfig(schedule, top_p, nucleus, time_grid))

    def move_probs(self, step_index: int, z_t: Tensor) -> tuple[float, None]:
        """Unmask probability (alpha_s - alpha_t) / (1 - alpha_t) of every masked position; no remasking."""
        alpha_t, alpha_s = self.alphas(step_index)
        return remdm_move_probs_scalar(alpha_t, alpha_s)[0], None

    def plan_moves(self, step_index: int | Tensor, z_t: Tensor, generator: torch.Generator | None = None) -> Moves:
        """Which positions are decoded at step i, one i per row when ``step_index`` is a (B,) tensor."""
        if not isinstance(step_index, Tensor):
            return super().plan_moves(step_index, z_t, generator)
        check_step_rows(step_index, self.num_steps, z_t.shape[0])
        i = step_index.to(z_t.device).double()  # (B,)
        t, s = grid_time(self.time_grid, i, self.num_steps), grid_time(self.time_grid, i - 1, self.num_steps)
        if self.time_grid == "released":
            alpha_t, alpha_s = 1.0 - t, 1.0 - s
        else:
            alpha_t, alpha_s = self.schedule.alpha(t), self.schedule.alpha(s)  # (B,) each
        tiny = torch.finfo(torch.float64).tiny  # remdm_move_probs_scalar's operations, elementwise
        one_minus_at = (1.0 - alpha_t).clamp_min(tiny)
        coef_x = ((alpha_s - alpha_t) / one_minus_at).clamp_min(0.0)
        coef_m = ((1.0 - alpha_s) / one_minus_at).clamp_min(0.0)
        unmask = coef_x / (coef_x + coef_m).clamp_min(tiny)  # (B,)
        return draw_moves(z_t, unmask[:, None], None, self.mask_id, generator)
