"""Measured generation throughput (tokens/s) with the exact and analytic Transformer-layer calls.

What the paper states (Table 2 and its "Inference speed-up" paragraph; the post-training
appendix): throughput is the number of generated tokens divided by the end-to-end generation time,
counting all L generated positions of every sample (those after the first end-of-text token
included), measured over 20 generations of length 1,024. How the timed generations are summarised
is tadm's choice, not the paper's: tokens/s = tokens of one generation / the MEDIAN wall time of
the timed generations (robust to a stray slow run), after ``warmup`` untimed generations (also a
tadm choice: the first call pays for kernel selection and allocation). This is neither the median
of the per-generation tokens/s (they differ for an even count) nor total tokens over total time.
The slowest and fastest generation's tokens/s come with it. On CUDA the device is synchronised
before the clock starts and before it stops. Lower precision runs under ``torch.autocast``.

To compare configurations fairly, :func:`interleaved_throughput` times many (model, T, K) cells
in rounds: every round times one generation of every cell in a freshly shuffled order, so a drift
of the machine's speed (thermal state, other load, caches) spreads over all cells instead of
favouring the ones measured first. The layer calls are read from the generation loop's counter
(:class:`~tadm.sampling.LayerCallCounter`) and set next to Eq. (anchor-cache-compute),
``layer_calls(split, T, K)``; without ``skip_unchanged`` the two are equal.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from tadm.devices import DTYPE_SPELLINGS, resolve_dtype, synchronize
from tadm.eval.compute import policy_layer_calls
from tadm.records import dataclass_record
from tadm.sampling import GenerationOutput, Sampler, generate
from tadm.sampling.anchor_cache import LayerCallCounter
from tadm.sampling.refresh import parse_refresh

__all__ = ["DTYPES", "ThroughputResult", "TimingCell", "interleaved_throughput", "measure_throughput", "resolve_dtype"]

MIN_TIMED_GENERATIONS = 5  # fewer timed generations give no meaningful median

DTYPES = DTYPE_SPELLINGS  # autocast dtypes, in tadm.devices' vocabulary


@dataclass
class ThroughputResult:
    """Tokens over the median time of the timed generations, plus the layer calls of one generation (counted and
    analytic)."""

    tokens_per_second: float  # tokens of one generation / median seconds
    seconds: list[float]  # wall time of each timed generation
    num_generations: int
    batch_size: int
    seq_len: int
    num_steps: int
    refresh_interval: int | None  # K of a fixed policy, None for other refresh policies
    dtype: str
    device: str
    layer_calls: dict[str, int] = field(default_factory=dict)  # counter of one generation
    analytic_layer_calls: int = 0  # Eq. (anchor-cache-compute); a canvas-dependent policy: the counted
    policy: str = ""  # the refresh policy's label

    @property
    def tokens_per_generation(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def tokens_per_second_min(self) -> float:
        """The slowest timed generation's tokens/s."""
        return self.tokens_per_generation / max(max(self.seconds), 1e-12)

    @property
    def tokens_per_second_max(self) -> float:
        """The fastest timed generation's tokens/s."""
        return self.tokens_per_generation / max(min(self.seconds), 1e-12)

    def as_dict(self) -> dict[str, Any]:
        return dataclass_record(self, "tokens_per_second_min", "tokens_per_second_max")


@dataclass
class TimingCell:
    """One configuration to time: a model, a way to build its sampler, (L, T) and a refresh policy (any spec)."""

    key: Hashable
    model: Any
    make_sampler: Callable[[], Sampler]
    seq_len: int
    num_steps: int
    policy: Any = 1

    def __post_init__(self) -> None:
        self.policy = parse_refresh(self.policy)


def interleaved_throughput(
    cells: Sequence[TimingCell],
    *,
    num_generations: int = MIN_TIMED_GENERATIONS,
    warmup: int = 1,
    batch_size: int = 1,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
    seed: int = 0,
    order_seed: int = 0,
    progress: bool = False,
    generate_fn: Callable[..., GenerationOutput] = generate,
    min_generations: int = MIN_TIMED_GENERATIONS,
) -> dict[Hashable, ThroughputResult]:
    """Time every cell ``num_generations`` times (after ``warmup`` untimed runs each), interleaved.

    Round r (warm-up rounds first) runs one generation of every cell, in an order shuffled by
    ``random.Random(order_seed + r)``; generation g of a cell uses a generator seeded with
    ``seed + g`` (warm-up included). Returns each cell's :class:`ThroughputResult` (tokens over the
    median generation time, with the slowest and fastest generation's tokens/s). Fewer than
    ``min_generations`` timed generations (5: no meaningful median) or no cells is a ValueError.
    """
    if num_generations < min_generations:
        raise ValueError(f"num_generations must be >= {min_generations} for a median with min and max, "
                         f"got {num_generations}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not cells:
        raise ValueError("no cells to time")
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        raise ValueError("timing cells need distinct keys")
    amp = resolve_dtype(dtype, device)
    device = torch.device(device)
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    samplers = {c.key: c.make_sampler() for c in cells}
    seconds: dict[Hashable, list[float]] = {c.key: [] for c in cells}
    counted: dict[Hashable, LayerCallCounter] = {}
    rounds = warmup + num_generations
    bar = tqdm(total=rounds * len(cells), desc="throughput (interleaved)", disable=not progress, leave=False)
    for r in range(rounds):
        order = list(cells)
        random.Random(order_seed + r).shuffle(order)
        for cell in order:
            generator = torch.Generator(device=gen_device).manual_seed(seed + r)
            synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
                out = generate_fn(cell.model, samplers[cell.key], batch_size=batch_size, seq_len=cell.seq_len,
                                  num_steps=cell.num_steps, generator=generator, device=device, policy=cell.policy)
            synchronize(device)
            if r >= warmup:
                seconds[cell.key].append(time.perf_counter() - start)
            counted[cell.key] = out.layer_calls
            bar.update(1)
    bar.close()
    return {cell.key: _result(cell, seconds[cell.key], counted[cell.key], num_generations, batch_size, dtype, device)
            for cell in cells}


def _result(cell: TimingCell, seconds: list[float], counted: LayerCallCounter, num_generations: int, batch_size: int,
            dtype: str, device: torch.device) -> ThroughputResult:
    return ThroughputResult(
        tokens_per_second=batch_size * cell.seq_len / max(statistics.median(seconds), 1e-12), seconds=seconds,
        num_generations=num_generations, batch_size=batch_size, seq_len=cell.seq_len, num_steps=cell.num_steps,
        refresh_interval=cell.policy.fixed_interval, dtype=dtype, device=str(device), layer_calls=counted.as_dict(),
        analytic_layer_calls=policy_layer_calls(cell.model.layer_split, cell.num_steps, cell.policy, counted),
        policy=cell.policy.label())


def measure_throughput(
    model: Any,
    sampler: Sampler,
    *,
    seq_len: int,
    num_steps: int,
    refresh_interval: int = 1,
    policy: Any = None,
    num_generations: int = 20,
    batch_size: int = 1,
    warmup: int = 1,
    dtype: str = "float32",
    device: torch.device | str | None = None,
    seed: int = 0,
    progress: bool = False,
    generate_fn: Callable[..., GenerationOutput] = generate,
) -> ThroughputResult:
    """Tokens/s of one configuration = batch_size * seq_len / (median wall time of the timed generations).

    ``warmup`` untimed generations run first (kernel selection, allocator warm-up); generation g
    (warm-up included) uses a generator seeded with ``seed + g``. ``dtype`` is "float32", "bfloat16"
    or "float16" (autocast; the weights stay as they are). One cell of :func:`interleaved_throughput`.
    """
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cell = TimingCell(key=0, model=model, make_sampler=lambda: sampler, seq_len=seq_len, num_steps=num_steps,
                      policy=refresh_interval if policy is None else policy)
    return interleaved_throughput([cell], num_generations=num_generations, warmup=warmup, batch_size=batch_size,
                                  dtype=dtype, device=device, seed=seed, progress=progress, generate_fn=generate_fn,
                                  min_generations=1)[0]
