"""Devices and dtypes by name, the same on the command line, in YAML and in Python.

* a **device** is ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``;
* a **dtype** is ``auto`` (bf16 on CUDA, fp32 on CPU), ``fp32``, ``bf16`` or ``fp16`` (the long
  names ``float32``, ``bfloat16``, ``float16`` are accepted as aliases).
"""

from __future__ import annotations

import torch

__all__ = ["DEVICE_NAMES", "DTYPE_NAMES", "DTYPE_SPELLINGS", "resolve_device", "resolve_dtype", "synchronize"]

DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_NAMES = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
DTYPE_SPELLINGS = ("auto", *_DTYPES)  # every accepted spelling, for validating stored configs


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """A torch device from ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; CUDA must be available when named."""
    if isinstance(spec, torch.device):
        return spec
    name = str(spec).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} requested but CUDA is not available on this machine; use cpu or auto")
        index = int(name[5:]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device(name)
    raise ValueError(f"unknown device {spec!r}; valid: {', '.join(DEVICE_NAMES)}")


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work before a timer reads (CUDA runs asynchronously; a CPU never waits)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_dtype(name: str | torch.dtype | None = "auto", device: torch.device | str = "cpu") -> torch.dtype:
    """A torch dtype from a name of :data:`DTYPE_NAMES` (or a long alias); ``auto`` depends on ``device``."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPE_NAMES)}") from None
