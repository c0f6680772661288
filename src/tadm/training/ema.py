"""Exponential moving average of a model's weights, kept as a frozen copy of the model.

After every optimizer step ``ema_p <- decay * ema_p + (1 - decay) * p`` for each parameter (the
paper uses decay 0.9999, appendix "TADM:Pretrain"); buffers are copied as they are. The copy is
what validation runs on and what ``save_pretrained`` writes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["EMA"]


class EMA:
    """A frozen, eval-mode copy of ``model`` whose parameters track an exponential moving average.

    Args:
        model: the trained module (unwrapped, not the DDP wrapper); copied at construction.
        decay: in [0, 1); 0 makes the copy follow the raw weights exactly.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.num_updates = 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step towards ``model``'s current weights (same architecture as the copy)."""
        ema_params = list(self.model.parameters())
        params = [p.detach() for p in model.parameters()]
        if len(ema_params) != len(params):
            raise ValueError("EMA.update got a model with a different number of parameters")
        torch._foreach_lerp_(ema_params, params, 1.0 - self.decay)
        for ema_b, b in zip(self.model.buffers(), model.buffers()):
            ema_b.copy_(b)
        self.num_updates += 1

    def state_dict(self) -> dict[str, Any]:
        """Tensors and numbers only (loadable with ``torch.load(weights_only=True)``)."""
        return {"decay": self.decay, "num_updates": self.num_updates, "weights": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if float(state["decay"]) != self.decay:
            raise ValueError(f"EMA state has decay {state['decay']}, this EMA uses {self.decay}")
        self.model.load_state_dict(state["weights"])
        self.num_updates = int(state["num_updates"])
