"""What every sampler returns, and the checks all samplers share.

A sampler never calls a network. The generation loop gives it the network's log-probabilities
of the clean sequence and the current canvas; the sampler returns the next canvas
(diffusers-style ``set_timesteps`` then ``step``). Reverse steps are indexed like the paper:
``i = T, ..., 1`` with ``t(i) = i / T`` and ``s(i) = (i - 1) / T``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from tadm.diffusion import get_schedule
from tadm.sampling.masked_transition import Moves, apply_moves, draw_moves


@dataclass
class SamplerOutput:
    """One reverse step's result.

    prev_sample: the next canvas z_s, token ids (B, L).
    """

    prev_sample: Tensor


class Sampler(Protocol):
    """What the loop needs from a sampler: the prior, one reverse step, and the final step.

    ``consumes`` says what :meth:`step` takes: ``"log_probs"`` (log x_theta, the masked samplers) or
    ``"logits"`` (raw logits, the entropy-bound sampler). After step i = 1 the loop calls
    :meth:`finish` on the last canvas and output; a sampler with ``final_denoise`` asks for one more
    network pass at i = 0 first (the released ReMDM grid) when :meth:`unfinished` says so.
    """

    num_steps: int
    consumes: str
    final_denoise: bool

    def set_timesteps(self, num_steps: int) -> None:
        """Prepare a run of ``num_steps`` reverse steps and reset any per-run state."""
        ...

    def time(self, step_index: int) -> float:
        """Diffusion time t(i) fed to time-conditioned networks at reverse step ``step_index``."""
        ...

    def initial_canvas(
        self, batch_size: int, seq_len: int, generator: torch.Generator | None, device: torch.device
    ) -> Tensor:
        """A draw from the prior p(z_1): token ids (B, L)."""
        ...

    def step(
        self, log_probs: Tensor, step_index: int, z_t: Tensor, generator: torch.Generator | None = None
    ) -> SamplerOutput:
        """Draw z_{s(i)} given the network's log x_theta (B, L, V) and the canvas z_{t(i)} (B, L)."""
        ...

    def unfinished(self, z: Tensor) -> bool:
        """Whether the last canvas still holds something the final step must fill (masks)."""
        ...

    def finish(self, z: Tensor, last_output: Tensor) -> Tensor:
        """The final canvas from the last canvas (B, L) and the last output (B, L, V)."""
        ...


class ConfiguredSampler:
    """Base of the samplers whose settings are one config dataclass (the registry builds them from it).

    A subclass's ``__init__`` takes what it needs from the model (a mask id or a vocabulary size)
    followed by the fields of its config, and keeps the validated config as ``self.config``. The
    defaults of :class:`Sampler` live here: log-probabilities in, nothing left to finish.
    """

    config: Any
    consumes = "log_probs"
    final_denoise = False

    @classmethod
    def from_config(cls, model_value: int, config: Any) -> Any:
        """The sampler of ``config`` for a model's mask id (masked samplers) or vocabulary size (uniform)."""
        return cls(model_value, **dataclasses.asdict(config))

    def set_timesteps(self, num_steps: int) -> None:
        """Use ``num_steps`` reverse steps (a subclass also resets its per-run state here)."""
        self.num_steps = check_num_steps(num_steps)

    def unfinished(self, z: Tensor) -> bool:
        return False

    def finish(self, z: Tensor, last_output: Tensor) -> Tensor:
        return z


class MaskedSampler(ConfiguredSampler):
    """What the absorbing-state samplers (MDLM, ReMDM) share: the mask id, the time grid and the prior.

    ``config`` has ``schedule``, ``top_p``, ``nucleus`` and ``time_grid`` fields.
    """

    def _set_masked(self, mask_id: int, config: Any) -> None:
        self.config = config
        if isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0:
            raise ValueError(f"mask_id must be an integer >= 0 (the model's mask token id), got {mask_id!r}")
        self.mask_id = mask_id
        self.schedule = get_schedule(config.schedule)
        self.top_p, self.nucleus, self.time_grid = config.top_p, config.nucleus, config.time_grid
        self.final_denoise = config.time_grid == "released"
        self.num_steps = 0

    def time(self, step_index: int) -> float:
        """t(i) on the sampler's time grid (see :func:`grid_time`)."""
        return grid_time(self.time_grid, step_index, self.num_steps)

    def _alpha(self, t: float) -> float:
        if self.time_grid == "released":
            return 1.0 - t  # the released code's move chance is t itself
        return float(self.schedule.alpha(torch.tensor([t], dtype=torch.float64)))

    def alphas(self, step_index: int) -> tuple[float, float]:
        """(alpha_t, alpha_s) at reverse step i on the sampler's time grid."""
        return self._alpha(self.time(step_index)), self._alpha(self.time(step_index - 1))

    def initial_canvas(
        self, batch_size: int, seq_len: int, generator: torch.Generator | None, device: torch.device
    ) -> Tensor:
        """The absorbing prior: all mask tokens (B, L)."""
        return torch.full((batch_size, seq_len), self.mask_id, dtype=torch.long, device=device)

    # A step in two halves, so that the network computes x_theta only on the rows decoded this step:
    # ``plan_moves`` before the network pass, ``step_moves`` with the (n, V) rows after it.
    def move_probs(self, step_index: int, z_t: Tensor) -> tuple[Tensor | float, Tensor | float | None]:
        """(unmask, remask) probabilities of reverse step i, (B, L) or one number for every position;
        remask None when nothing is remasked."""
        raise NotImplementedError

    def plan_moves(self, step_index: int, z_t: Tensor, generator: torch.Generator | None = None) -> Moves:
        """Draw which positions move at step i: the decoded rows and the remasked positions."""
        if isinstance(step_index, Tensor):
            raise ValueError(f"{type(self).__name__} runs every row at the same step; per-row step indices are not "
                             "supported (the MDLM, LLaDA and Dream samplers take them)")
        check_step_index(step_index, self.num_steps)
        unmask_prob, remask_prob = self.move_probs(step_index, z_t)
        return draw_moves(z_t, unmask_prob, remask_prob, self.mask_id, generator)

    def step_moves(
        self, row_log_probs: Tensor, moves: Moves, step_index: int, z_t: Tensor, generator: torch.Generator | None = None
    ) -> SamplerOutput:
        """Finish step i: draw the tokens of ``moves.rows`` from their log x_theta (n, V)."""
        z_s, confidence = apply_moves(row_log_probs, moves, z_t, self.mask_id, self.top_p, generator, self.nucleus)
        self.decoded(moves.rows, confidence, z_s)
        return SamplerOutput(prev_sample=z_s)

    def unfinished(self, z: Tensor) -> bool:
        """Masks left after the last step (a schedule with alpha_0 slightly below 1 may leave some)."""
        return bool((z == self.mask_id).any())

    def finish(self, z: Tensor, last_output: Tensor) -> Tensor:
        """Every mask left takes the argmax of the last prediction (B, L, V)."""
        return torch.where(z == self.mask_id, last_output.argmax(-1), z)

    def decoded(self, rows: Tensor, confidence: Tensor, z_s: Tensor) -> None:
        """Hook after a step: the decoded ``rows`` (n, 2) and each new token's probability (n,)."""

    def step(
        self, log_probs: Tensor, step_index: int, z_t: Tensor, generator: torch.Generator | None = None
    ) -> SamplerOutput:
        """Draw z_s given the full log x_theta (B, L, V): ``plan_moves`` then ``step_moves`` on its rows."""
        moves = self.plan_moves(step_index, z_t, generator)
        rows = moves.rows
        return self.step_moves(log_probs[rows[:, 0], rows[:, 1]], moves, step_index, z_t, generator)


def check_integer(name: str, value: object, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum`` (a bool is not), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_num_steps(num_steps: int) -> int:
    """Validate a number of reverse steps T (an integer >= 1)."""
    return check_integer("number of steps T", num_steps)


def check_number(
    owner: str,
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    """A finite real number within [low, high] (``(low, high]`` with ``low_open``), else a ValueError.

    The message names the owner, the parameter, the value and the valid range, so a NaN, an
    infinity or an out-of-range value never reaches a sampler silently.
    """
    lower = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
    upper = "" if high is None else f"{high:g}]"
    valid = f"{lower or '(-inf'}, {upper or 'inf)'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}: {name} must be a number in {valid}, got {value!r}")
    number = float(value)
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and number > high
    if not math.isfinite(number) or below or above:
        raise ValueError(f"{owner}: {name} must be a finite number in {valid}, got {value!r}")
    return number


def check_step_index(step_index: int, num_steps: int) -> None:
    if not 1 <= step_index <= num_steps:
        raise ValueError(f"step index must be in 1..{num_steps} (reverse steps run T..1), got {step_index}")


def check_step_rows(step_index: Tensor, num_steps: int, batch_size: int) -> None:
    """Per-row step indices: an integer (B,) tensor with every entry in 1..T, else a one-line ValueError."""
    if step_index.dim() != 1 or step_index.shape[0] != batch_size or step_index.is_floating_point():
        raise ValueError(f"per-row step indices must be an integer tensor of shape ({batch_size},), got "
                         f"{step_index.dtype} of shape {tuple(step_index.shape)}")
    if step_index.numel() and (int(step_index.min()) < 1 or int(step_index.max()) > num_steps):
        raise ValueError(f"step indices must be in 1..{num_steps} (reverse steps run T..1), got values in "
                         f"[{int(step_index.min())}, {int(step_index.max())}]")


TIME_GRIDS = ("paper", "released")
RELEASED_T_MIN = 1e-5  # the released ReMDM / MDLM samplers stop at t = 1e-5


def check_time_grid(name: str) -> str:
    if name not in TIME_GRIDS:
        raise ValueError(f"unknown time grid {name!r}; valid: {', '.join(TIME_GRIDS)}")
    return name


def grid_time(grid: str, step_index: int, num_steps: int) -> float:
    """Diffusion time t(i) of reverse step i (i = T .. 1; i = 0 is the end of the trajectory).

    * ``"paper"``: t(i) = i / T, the grid of the paper's Eq. (discrete-nelbo), t(0) = 0;
    * ``"released"``: the released ReMDM code's ``linspace(1, 1e-5, T + 1)``,
      t(i) = 1 - (T - i) (1 - 1e-5) / T, so t(0) = 1e-5 and masks may remain for a final argmax.
    """
    if grid == "paper":
        return step_index / num_steps
    return 1.0 - (num_steps - step_index) * (1.0 - RELEASED_T_MIN) / num_steps
