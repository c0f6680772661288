"""Mixed precision shared by pretraining and post-training: ``train.precision`` -> an autocast context.

``precision`` is one of :data:`PRECISIONS`:

* ``"auto"``: bf16 autocast on CUDA, plain fp32 elsewhere;
* ``"fp32"``: no autocast;
* ``"bf16"``: bf16 autocast on any device (CPU included).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["PRECISIONS", "autocast_context", "uses_bf16"]

PRECISIONS = ("auto", "fp32", "bf16")


def uses_bf16(device: torch.device | str, precision: str) -> bool:
    """Whether ``precision`` means bf16 autocast on ``device``; ValueError for an unknown precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown; valid: {', '.join(PRECISIONS)}")
    return precision == "bf16" or (precision == "auto" and torch.device(device).type == "cuda")


def autocast_context(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast(device type, bfloat16)`` when :func:`uses_bf16`, else a no-op context."""
    if uses_bf16(device, precision):
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
