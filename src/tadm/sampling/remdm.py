"""ReMDM remasking sampler: Eq. (remdm-param) / (inf-post-TADM) with cap, rescale, conf and loop schedules."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tadm.diffusion import (REMDM_STRATEGIES, get_schedule, remdm_move_probs, remdm_move_probs_scalar, remdm_sigma,
                            remdm_sigma_max)
from tadm.sampling.base import MaskedSampler, check_number, check_time_grid
from tadm.sampling.categorical import check_nucleus


@dataclass(frozen=True)
class ReMDMSamplerConfig:
    """Settings of :class:`ReMDMSampler` (validated on construction; see the sampler for their meaning).

    Every number must be finite. ``eta`` is a probability scale in [0, 1]: sigma never exceeds
    sigma_max <= 1, so a larger eta would only be clamped (``conf`` does not use eta).
    """

    strategy: str = "cap"
    eta: float = 0.04
    schedule: str = "loglinear"
    top_p: float = 0.9
    t_on: float = 0.55
    t_off: float = 0.05
    alpha_on: float = 0.9
    window: bool = False
    nucleus: str = "released"
    time_grid: str = "paper"

    def __post_init__(self) -> None:
        owner = f"ReMDM-{self.strategy} sampler"
        if self.strategy not in REMDM_STRATEGIES:
            raise ValueError(f"unknown ReMDM strategy {self.strategy!r}; valid: {', '.join(REMDM_STRATEGIES)}")
        check_number(owner, "eta", self.eta, low=0.0, high=1.0)
        check_number(owner, "top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_nucleus(self.top_p, self.nucleus)
        for name in ("t_on", "t_off", "alpha_on"):
            check_number(owner, name, getattr(self, name), low=0.0, high=1.0)
        if not 0.0 <= self.t_off < self.t_on <= 1.0:
            raise ValueError(f"{owner}: need 0 <= t_off < t_on <= 1, got t_off={self.t_off}, t_on={self.t_on}")
        if not 0.0 < self.alpha_on < 1.0:
            raise ValueError(f"{owner}: alpha_on must be in (0, 1), got {self.alpha_on}")
        if not isinstance(self.window, bool):
            raise ValueError(f"{owner}: window must be true or false, got {self.window!r}")
        check_time_grid(self.time_grid)
        get_schedule(self.schedule)


class ReMDMSampler(MaskedSampler):
    """Masked-diffusion sampler that may remask decoded tokens with probability sigma_t.

    Strategies (ReMDM):
      * ``cap``: sigma_t = min(eta, sigma_max), ``rescale``: sigma_t = eta * sigma_max,
        ``conf``: per-token sigma from the confidence each token had when it was decoded;
        these remask at every step whose time lies in the window ``[t_off, t_on]``
        (default: the whole trajectory).
      * ``loop``: t in (t_on, 1]: unmask until a fraction ``alpha_on`` is decoded (sigma = 0);
        t in [t_off, t_on]: alpha is held at ``alpha_on`` and sigma = eta (the remasking loop, whose
        posterior keeps the mask rate fixed); t in [0, t_off): unmask the rest (sigma = 0).
        alpha moves linearly in t inside the first and last phases.

    With ``eta = 0`` every strategy reduces to the MDLM ancestral sampler.

    Fidelity to the released ReMDM sampler (which the paper follows):

    * nucleus filtering uses the released rule by default (``nucleus="released"``: the sorted ids
      whose cumulative mass is <= top_p, plus the top-1), so samples match the paper's setting;
      ``nucleus="standard"`` also keeps the id that crosses top_p;
    * the time grid is the paper's by default (``time_grid="paper"``: t(i) = i / T with alpha from
      ``schedule``, no extra network call, so the layer calls are exactly Eq. (anchor-cache-compute)
      and the steps match the T-step grid the model was trained on); ``time_grid="released"`` is the
      released code's grid, t = linspace(1, 1e-5, T + 1) with alpha = 1 - t, followed by a final
      argmax network call on the last canvas when masks remain (``final_denoise``).

    Args:
        mask_id: id of the mask token.
        strategy: one of ``REMDM_STRATEGIES``.
        eta: remasking strength (paper: 0.04 for cap at T < L, 0.02 for loop at T >= L).
        schedule: noise schedule name for non-loop strategies.
        top_p: nucleus mass for x_theta, in (0, 1] (paper: 0.9).
        t_on, t_off, alpha_on: loop / window parameters (paper: 0.55, 0.05, 0.9).
        window: restrict cap/rescale/conf remasking to [t_off, t_on] (loop always uses it).
        nucleus: "released" (default) or "standard" nucleus rule.
        time_grid: "paper" (default) or "released".
    """

    def __init__(
        self,
        mask_id: int,
        strategy: str = "cap",
        eta: float = 0.04,
        schedule: str = "loglinear",
        top_p: float = 0.9,
        t_on: float = 0.55,
        t_off: float = 0.05,
        alpha_on: float = 0.9,
        window: bool = False,
        nucleus: str = "released",
        time_grid: str = "paper",
    ) -> None:
        self._set_masked(mask_id, ReMDMSamplerConfig(strategy, eta, schedule, top_p, t_on, t_off, alpha_on, window,
                                                     nucleus, time_grid))
        self.strategy, self.eta = strategy, eta
        self.t_on, self.t_off, self.alpha_on = t_on, t_off, alpha_on
        self.window = window or strategy == "loop"
        self._confidence: Tensor | None = None  # (B, L) prob of each decoded token when decoded

    def set_timesteps(self, num_steps: int) -> None:
        super().set_timesteps(num_steps)
        self._confidence = None

    def _alpha(self, t: float) -> float:
        if self.strategy != "loop":
            return super()._alpha(t)
        if t > self.t_on:  # phase 1: 0 -> alpha_on
            return self.alpha_on * (1.0 - t) / (1.0 - self.t_on)
        if t >= self.t_off:  # phase 2: hold
            return self.alpha_on
        return self.alpha_on + (1.0 - self.alpha_on) * (self.t_off - t) / self.t_off  # phase 3

    def _sigma(self, step_index: int, alpha_t: float, alpha_s: float, z_t: Tensor) -> Tensor | float:
        t = self.time(step_index)
        in_window = self.t_off <= t <= self.t_on
        if self.window and not in_window:
            return 0.0
        if self.strategy == "loop" and alpha_s != alpha_t:
            return 0.0  # the boundary step entering/leaving the hold phase only unmasks
        confidence = None
        if self.strategy == "conf":
            if self._confidence is None:
                self._confidence = torch.full(z_t.shape, float("-inf"), dtype=torch.float64, device=z_t.device)
            confidence = torch.where(z_t == self.mask_id, float("-inf"), self._confidence)
        sigma = remdm_sigma(self.strategy, alpha_t, alpha_s, self.eta, confidence=confidence)
        # sigma above sigma_max would give the masked branch a negative mask probability
        return torch.minimum(torch.as_tensor(sigma, dtype=torch.float64), remdm_sigma_max(alpha_t, alpha_s))

    def move_probs(self, step_index: int, z_t: Tensor) -> tuple[Tensor | float, Tensor | float]:
        """(unmask, remask) probabilities of Eq. (remdm-param) at reverse step i: Python floats when
        sigma is one number for every position (no device tensor made from host numbers), else (B, L)."""
        alpha_t, alpha_s = self.alphas(step_index)
        sigma = self._sigma(step_index, alpha_t, alpha_s, z_t)
        if not isinstance(sigma, Tensor) or sigma.dim() == 0:
            return remdm_move_probs_scalar(alpha_t, alpha_s, float(sigma))  # a CPU number: no synchronisation
        return remdm_move_probs(z_t, alpha_t, alpha_s, sigma)

    def decoded(self, rows: Tensor, confidence: Tensor, z_s: Tensor) -> None:
        """``conf`` remembers each decoded token's probability (its remasking score)."""
        if self.strategy == "conf":
            assert self._confidence is not None
            self._confidence[rows[:, 0], rows[:, 1]] = confidence
            self._confidence = torch.where(z_s == self.mask_id, float("-inf"), self._confidence)
