"""Learning-rate schedules: linear warmup, then constant or cosine decay, as a ``LambdaLR``.

The multiplier of the base learning rate after ``step`` optimizer steps is

* warmup, ``step < warmup_steps``: ``(step + 1) / warmup_steps`` (the first update already moves);
* ``"constant"``: 1 afterwards (the paper's setting, appendix "TADM:Pretrain");
* ``"cosine"``: ``r + (1 - r) * (1 + cos(pi * p)) / 2`` with ``p`` the fraction of the
  post-warmup steps done and ``r = min_lr_ratio``, reaching ``r`` at ``max_steps`` and staying there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["LR_SCHEDULES", "WarmupLR", "WarmupSchedule", "build_lr_scheduler"]

LR_SCHEDULES = ("constant", "cosine")


@dataclass
class WarmupSchedule:
    """Callable multiplier ``step -> factor`` (a plain object so ``LambdaLR`` can save its fields)."""

    warmup_steps: int
    max_steps: int
    schedule: str = "constant"
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0 or self.max_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and max_steps >= 1, got {self.warmup_steps}, {self.max_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        decay_steps = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupLR(LambdaLR):
    """``LambdaLR`` over a :class:`WarmupSchedule` whose settings come from the code, not the checkpoint.

    Loading a state restores the step count only; the schedule keeps the ``max_steps`` it was
    built with (a resumed run may extend training), and the optimizer's learning rates are set to
    the schedule's value at the restored step. Load the optimizer's state first.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)  # keep this object's schedule
        super().load_state_dict(state)
        lrs = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def build_lr_scheduler(
    optimizer: Optimizer,
    *,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "constant",
    min_lr_ratio: float = 0.1,
) -> LambdaLR:
    """:class:`WarmupLR` over :class:`WarmupSchedule`; call ``.step()`` once after every optimizer step."""
    return WarmupLR(optimizer, WarmupSchedule(warmup_steps, max_steps, schedule, min_lr_ratio))
