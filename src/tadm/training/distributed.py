"""Data-parallel training under ``torchrun``: process group, batch split, DDP wrapping, rank-0-first and reductions.

A run is distributed when ``WORLD_SIZE`` > 1 in the environment (set by ``torchrun``): the process
group is opened with NCCL on CUDA and gloo on CPU, each process drives one device
(``cuda:LOCAL_RANK``), and only rank 0 logs and writes files. Without ``WORLD_SIZE`` every helper
here degrades to a no-op on a single process. The global batch is split over ranks by
:func:`split_global_batch` (as accelerate-based trainers do, when no micro-batch size is given).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from tadm.config import ConfigError
from tadm.devices import resolve_device as resolve_named_device

__all__ = ["DistInfo", "all_gather_objects", "all_reduce_mean", "all_reduce_sum", "barrier", "cleanup",
           "init_distributed", "main_process_first", "resolve_device", "split_global_batch", "wrap_model"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this module opened the process group (and closes it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def split_global_batch(
    global_batch_size: int, world_size: int, micro_batch_size: int | None = None
) -> tuple[int, int]:
    """``(micro-batch size per rank, micro-batches per rank and optimizer step)`` of one global batch.

    ``micro_batch_size=None`` derives both: every rank takes ``global_batch_size / world_size``
    sequences at once (accumulation 1). An explicit ``micro_batch_size`` is kept, and the
    accumulation is ``global_batch_size / (micro_batch_size * world_size)``. E.g. global 32 on 2
    ranks: ``(16, 1)`` derived, ``(4, 4)`` with ``micro_batch_size=4``.

    Raises:
        ConfigError: the global batch does not split evenly (derived: over the ranks; explicit:
            into micro-batches on every rank), naming the values and the keys to change.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if micro_batch_size is None:
        if global_batch_size % world_size:
            raise ConfigError(
                f"train.global_batch_size ({global_batch_size}) must be a multiple of the world size ({world_size}): "
                f"each rank takes global / world size sequences per step; choose a multiple of {world_size}"
            )
        return global_batch_size // world_size, 1
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({micro_batch_size}) x world size ({world_size}); leave train.micro_batch_size unset (null) to "
            "derive it from the world size"
        )
    return micro_batch_size, global_batch_size // per_step


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """:func:`tadm.devices.resolve_device`, with ``auto`` and ``cuda`` meaning this process's GPU, ``cuda:LOCAL_RANK``."""
    device = resolve_named_device(spec)
    if device.type == "cuda" and str(spec).strip().lower() in ("auto", "cuda"):
        return torch.device(f"cuda:{local_rank}")
    return device


def init_distributed(device: str = "auto") -> DistInfo:
    """Read ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``; open the process group when ``WORLD_SIZE`` > 1.

    NCCL is used when the run's device is CUDA, gloo otherwise. ``MASTER_ADDR``/``MASTER_PORT``
    come from the environment (``torchrun`` sets them). A process group opened by the caller is
    reused and left open.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"inconsistent RANK={rank} / WORLD_SIZE={world_size}")
    resolved = resolve_device(device, local_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    owns = False
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if resolved.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": resolved} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
        owns = True
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=resolved, owns_group=owns)


def cleanup(info: DistInfo) -> None:
    """Close the process group if :func:`init_distributed` opened it."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def _portable(err: Exception) -> tuple[type[Exception], str]:
    """``err``'s class (RuntimeError if it cannot be sent to another process) and message."""
    kind: type[Exception] = type(err)
    try:
        pickle.loads(pickle.dumps(kind))
    except Exception:  # a class pickle cannot name (defined inside a function)
        kind = RuntimeError
    return kind, str(err)


def _rebuilt(kind: type[Exception], message: str) -> Exception:
    """An exception of class ``kind`` with ``message`` (a RuntimeError if ``kind`` takes other arguments)."""
    try:
        return kind(message)
    except Exception:
        return RuntimeError(message)


@contextmanager
def main_process_first(info: DistInfo) -> Iterator[None]:
    """Rank 0 runs the body first (e.g. trains the tokenizer, packs the data); the others then reuse its files.

    If the body fails on rank 0, every other rank raises an error of the same class and message
    (so under ``torchrun`` each prints the same one line), instead of waiting on a barrier that
    rank 0's exit breaks with a gloo/NCCL traceback.
    """
    if not info.distributed:
        yield
        return
    if not info.is_main:
        failure = all_gather_objects(None, info)[0]  # waits for rank 0's body
        if failure is not None:
            raise _rebuilt(*failure)
        yield
        return
    try:
        yield
    except Exception as err:
        all_gather_objects(_portable(err), info)
        raise
    all_gather_objects(None, info)


def all_reduce_sum(tensor: Tensor, info: DistInfo) -> Tensor:
    """Sum of ``tensor`` over ranks (a new tensor; the input is left unchanged)."""
    out = tensor.detach().clone()
    if info.distributed:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_mean(tensor: Tensor, info: DistInfo) -> Tensor:
    """Mean of ``tensor`` over ranks."""
    return all_reduce_sum(tensor, info) / info.world_size


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects)."""
    if not info.distributed:
        return [obj]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def wrap_model(model: nn.Module, info: DistInfo) -> nn.Module:
    """``DistributedDataParallel(model)`` in a distributed run (rank 0's weights are broadcast), else ``model``."""
    if not info.distributed:
        return model
    return DistributedDataParallel(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
