"""Measured generation throughput (tokens/s) with the exact and analytic Transformer-layer calls.

Convention of the paper (Table 2, "Inference speed-up"): throughput counts all L generated
positions of every sample, including those after the first end-of-text token, and is measured over
a number of generations (20 in the paper, batch size 1) after warm-up. On CUDA the device is
synchronised before the clock starts and before it stops. Lower precision runs under
``torch.autocast``. The layer calls are read from the generation loop's counter
(:class:`~tadm.sampling.LayerCallCounter`) and set next to Eq. (anchor-cache-compute),
``layer_calls(split, T, K)``; without ``skip_unchanged`` the two are equal.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from tadm.eval.compute import layer_calls
from tadm.sampling import GenerationOutput, Sampler, generate

__all__ = ["DTYPES", "ThroughputResult", "measure_throughput", "resolve_dtype"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """Autocast dtype by name: "float32", "bfloat16" or "float16"."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}") from None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ThroughputResult:
    """Tokens/s over timed generations plus the layer calls of one generation (counted and analytic)."""

    tokens_per_second: float
    seconds: list[float]  # wall time of each timed generation
    num_generations: int
    batch_size: int
    seq_len: int
    num_steps: int
    refresh_interval: int
    dtype: str
    device: str
    layer_calls: dict[str, int] = field(default_factory=dict)  # counter of one generation
    analytic_layer_calls: int = 0  # Eq. (anchor-cache-compute)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "num_generations": self.num_generations,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_steps": self.num_steps,
            "refresh_interval": self.refresh_interval,
            "dtype": self.dtype,
            "device": self.device,
            "layer_calls": self.layer_calls,
            "analytic_layer_calls": self.analytic_layer_calls,
        }


def measure_throughput(
    model: Any,
    sampler: Sampler,
    *,
    seq_len: int,
    num_steps: int,
    refresh_interval: int = 1,
    num_generations: int = 20,
    batch_size: int = 1,
    warmup: int = 1,
    dtype: str = "float32",
    device: torch.device | str | None = None,
    seed: int = 0,
    time_conditioned: bool = False,
    progress: bool = False,
    generate_fn: Callable[..., GenerationOutput] = generate,
) -> ThroughputResult:
    """Tokens/s = num_generations * batch_size * seq_len / (summed wall time of the timed generations).

    ``warmup`` untimed generations run first (kernel selection, allocator warm-up). Generation g
    (warm-up included) uses a generator seeded with ``seed + g``. ``dtype`` is "float32",
    "bfloat16" or "float16" (autocast; the weights stay as they are).
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    amp = resolve_dtype(dtype)
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = torch.device(device)
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    seconds: list[float] = []
    counted: dict[str, int] = {}
    runs = range(warmup + num_generations)
    for g in tqdm(runs, desc=f"throughput T={num_steps} K={refresh_interval}", disable=not progress, leave=False):
        generator = torch.Generator(device=gen_device).manual_seed(seed + g)
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
            out = generate_fn(
                model,
                sampler,
                batch_size=batch_size,
                seq_len=seq_len,
                num_steps=num_steps,
                refresh_interval=refresh_interval,
                generator=generator,
                device=device,
                time_conditioned=time_conditioned,
            )
        _sync(device)
        elapsed = time.perf_counter() - start
        if g >= warmup:
            seconds.append(elapsed)
        counted = out.layer_calls.as_dict()
    total = sum(seconds)
    return ThroughputResult(
        tokens_per_second=num_generations * batch_size * seq_len / max(total, 1e-12),
        seconds=seconds,
        num_generations=num_generations,
        batch_size=batch_size,
        seq_len=seq_len,
        num_steps=num_steps,
        refresh_interval=refresh_interval,
        dtype=dtype,
        device=str(device),
        layer_calls=counted,
        analytic_layer_calls=layer_calls(model.layer_split, num_steps, refresh_interval),
    )
