"""Noise schedules alpha_t of the forward process, Eq. (fwd), and their continuous-time loss weights.

Every schedule is monotonically decreasing on [0, 1] with alpha_0 = 1 (up to a tiny offset for
"linear") and alpha_1 close to 0. The continuous-time masked NELBO (the T -> infinity limit of
Eq. (masked-nelbo)) weights the cross-entropy at time t by -alpha'_t / (1 - alpha_t), which each
schedule evaluates in a closed, cancellation-free form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class NoiseSchedule(Protocol):
    """What the rest of the library needs from a noise schedule (all maps are elementwise in t)."""

    name: str

    def alpha(self, t: Tensor) -> Tensor:
        """alpha_t in [0, 1], decreasing in t, alpha_0 ~ 1, alpha_1 ~ 0."""
        ...

    def dalpha(self, t: Tensor) -> Tensor:
        """d alpha_t / d t (<= 0)."""
        ...

    def loss_weight(self, t: Tensor) -> Tensor:
        """Continuous-time masked-NELBO weight -alpha'_t / (1 - alpha_t) (>= 0)."""
        ...


def _as_float(t: Tensor | float) -> Tensor:
    """Accept Python numbers and integer tensors; keep the dtype of floating tensors."""
    t = torch.as_tensor(t)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


@dataclass(frozen=True)
class LogLinearSchedule:
    """MDLM's log-linear schedule alpha_t = 1 - (1 - eps) t.

    The total noise sigma(t) = -log alpha_t is log-linear in (1 - t); the loss weight
    -alpha'_t / (1 - alpha_t) = (1 - eps) / ((1 - eps) t) equals 1/t exactly.

    Args:
        eps: alpha_1 = eps keeps the final state from being exactly all-noise (MDLM: 1e-3).
    """

    eps: float = 1e-3
    name: str = field(default="loglinear", init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"LogLinearSchedule eps must be in [0, 1), got {self.eps}")

    def alpha(self, t: Tensor) -> Tensor:
        t = _as_float(t)
        return 1.0 - (1.0 - self.eps) * t

    def dalpha(self, t: Tensor) -> Tensor:
        t = _as_float(t)
        return torch.full_like(t, -(1.0 - self.eps))

    def loss_weight(self, t: Tensor) -> Tensor:
        t = _as_float(t)
        return 1.0 / t


@dataclass(frozen=True)
class LinearSchedule:
    """MDLM's "linear" schedule: sigma(t) = sigma_min + t (sigma_max - sigma_min), alpha_t = exp(-sigma(t)).

    The loss weight is (sigma_max - sigma_min) alpha_t / (1 - alpha_t) = (sigma_max - sigma_min) / expm1(sigma(t)).

    Args:
        sigma_min: total noise at t = 0 (alpha_0 = exp(-sigma_min) ~ 1).
        sigma_max: total noise at t = 1 (alpha_1 = exp(-sigma_max) ~ 0).
    """

    sigma_min: float = 1e-4
    sigma_max: float = 20.0
    name: str = field(default="linear", init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.sigma_min < self.sigma_max:
            raise ValueError(
                f"LinearSchedule needs 0 <= sigma_min < sigma_max, got sigma_min={self.sigma_min}, "
                f"sigma_max={self.sigma_max}"
            )

    def sigma(self, t: Tensor) -> Tensor:
        """Total noise sigma(t) = -log alpha_t."""
        t = _as_float(t)
        return self.sigma_min + t * (self.sigma_max - self.sigma_min)

    def alpha(self, t: Tensor) -> Tensor:
        return torch.exp(-self.sigma(t))

    def dalpha(self, t: Tensor) -> Tensor:
        return -(self.sigma_max - self.sigma_min) * self.alpha(t)

    def loss_weight(self, t: Tensor) -> Tensor:
        return (self.sigma_max - self.sigma_min) / torch.expm1(self.sigma(t))


@dataclass(frozen=True)
class CosineSchedule:
    """Cosine schedule alpha_t = eps + (1 - eps) cos(pi t / 2).

    With 1 - cos(x) = 2 sin^2(x / 2), the loss weight is (pi / 2) sin(pi t / 2) / (2 sin^2(pi t / 4)),
    which stays accurate for small t.

    Args:
        eps: alpha_1 = eps.
    """

    eps: float = 1e-3
    name: str = field(default="cosine", init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"CosineSchedule eps must be in [0, 1), got {self.eps}")

    def alpha(self, t: Tensor) -> Tensor:
        t = _as_float(t)
        return self.eps + (1.0 - self.eps) * torch.cos(0.5 * math.pi * t)

    def dalpha(self, t: Tensor) -> Tensor:
        t = _as_float(t)
        return -(1.0 - self.eps) * 0.5 * math.pi * torch.sin(0.5 * math.pi * t)

    def loss_weight(self, t: Tensor) -> Tensor:
        t = _as_float(t)
        # 1 - alpha_t = (1 - eps) (1 - cos(pi t / 2)); the (1 - eps) factors cancel.
        return 0.5 * math.pi * torch.sin(0.5 * math.pi * t) / (2.0 * torch.sin(0.25 * math.pi * t) ** 2)


DEFAULT_SCHEDULE = "loglinear"  # the paper's (and MDLM's) schedule; every sampler's and objective's default
SCHEDULES: dict[str, type] = {
    "loglinear": LogLinearSchedule,
    "linear": LinearSchedule,
    "cosine": CosineSchedule,
}


def get_schedule(name: str, **kwargs: float) -> NoiseSchedule:
    """Build a schedule by name ("loglinear", "linear", "cosine"); kwargs go to its constructor.

    Raises:
        ValueError: for an unknown name (the message lists the valid names) or bad parameters.
    """
    try:
        cls = SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown noise schedule {name!r}; valid names: {', '.join(sorted(SCHEDULES))}") from None
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"bad arguments {kwargs} for noise schedule {name!r}: {err}") from None
