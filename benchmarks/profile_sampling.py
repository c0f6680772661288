"""Where a reverse step's time goes: torch.profiler breakdown of Algorithm 1's loop, before and after.

    python benchmarks/profile_sampling.py                                   # CPU, mid-size TADM
    python benchmarks/profile_sampling.py --size small --length 1024 --steps 1024 --profile-steps 8
    python benchmarks/profile_sampling.py --device cuda --dtype bfloat16 --size small --length 1024 \\
        --steps 1024 --profile-steps 64 --sampler remdm-loop

Runs the first ``--profile-steps`` reverse steps of a ``--steps``-step generation (from the prior,
random weights: speed does not depend on them) twice under ``torch.profiler``: with the output
head and log-softmax on every position (``full_output=True``, the reference path) and on the
decoded rows only (the default). Each part of the step is a ``record_function`` range: S (the
embedding), A (anchor stack), Phi (fusion), D (denoiser stack, or MDLM's stack), the output head,
the log-softmax / SUBS, the sampler; what is left of the wall time is Python, launches and
synchronisations. Prints milliseconds per step for each part (CPU time on CPU, device time on CUDA).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import tadm.nn.base as nn_base
from tadm.cli import OneLineErrorParser
from tadm.cli.common import masked_samplers, positive_int
from tadm.devices import resolve_device
from tadm.nn import mdlm_small, tadm_small, tadm_tiny
from tadm.sampling import FixedRefresh, get_sampler
from tadm.sampling.loop import LoopContext, denoise

SIZES: dict[str, Callable[[], Any]] = {
    "tiny": lambda: tadm_tiny(),
    # a CPU-sized model with the paper's vocabulary: d = 256, 8 + 4 blocks
    "mid": lambda: tadm_small(hidden_size=256, num_heads=4, anchor_layers=8, denoiser_layers=4, cond_dim=64,
                              dropout=0.0, max_seq_len=1024),
    "small": lambda: tadm_small(dropout=0.0),  # the paper's 224M TADM: d = 768, 12 + 6 blocks, GPT-2 vocabulary
    "mdlm-small": lambda: mdlm_small(dropout=0.0),  # the paper's MDLM: 12 blocks
}
PARTS = ("S (embedding)", "A (anchor stack)", "Phi (fusion)", "D (denoiser stack)", "output head",
         "log-softmax / SUBS", "sampler")


def _ranged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def instrument_functions() -> None:
    """Wrap the SUBS / masked log-softmax functions the networks call (once per process)."""
    for name in ("subs_log_probs", "masked_log_probs"):
        setattr(nn_base, name, _ranged(PARTS[5], getattr(nn_base, name)))


def instrument_sampler(sampler: Any) -> None:
    for name in ("step", "plan_moves", "step_moves"):
        setattr(sampler, name, _ranged(PARTS[6], getattr(sampler, name)))


def instrument(model: Any) -> None:
    """Wrap each part of the model's step in a ``record_function`` range named as in :data:`PARTS` (once)."""
    model.encode = _ranged(PARTS[0], model.encode)
    if model.layer_split.anchor:
        model.anchor.forward = _ranged(PARTS[1], model.anchor.forward)
    if hasattr(model, "fusion"):
        model.fusion.forward = _ranged(PARTS[2], model.fusion.forward)
    stack = model.denoiser if hasattr(model, "denoiser") else model.blocks
    stack.forward = _ranged(PARTS[3], stack.forward)
    model.head.forward = _ranged(PARTS[4], model.head.forward)


class StopAfter(LoopContext):
    """Ends the loop after ``n`` steps."""

    def __init__(self, n: int) -> None:
        self.n, self.done = n, 0

    def after_step(self, position: int, step_index: int | torch.Tensor, z: torch.Tensor, output: Any) -> torch.Tensor:
        self.done += 1
        return output.prev_sample

    def finished(self) -> bool:
        return self.done >= self.n


def run_steps(model: Any, args: argparse.Namespace, device: torch.device, full_output: bool) -> int:
    """Runs the first ``args.profile_steps`` steps (at most ``args.steps``); returns how many ran."""
    sampler = get_sampler(args.sampler, model.mask_token_id)
    instrument_sampler(sampler)
    sampler.set_timesteps(args.steps)
    g = torch.Generator(device=device).manual_seed(0)
    z = sampler.initial_canvas(args.batch_size, args.length, g, device)
    amp = getattr(torch, args.dtype)
    # stop after the first profile_steps steps of the T-step run (its final full-output step is not among them)
    stop = StopAfter(args.profile_steps)
    with torch.autocast(device.type, dtype=amp) if amp != torch.float32 else nullcontext():
        denoise(model, sampler, z, range(args.steps, 0, -1), policy=FixedRefresh(args.refresh), generator=g,
                full_output=full_output, context=stop)
    return stop.done


def breakdown(model: Any, args: argparse.Namespace, device: torch.device, full_output: bool) -> dict[str, float]:
    """Milliseconds per step of each part, and of the whole step (``total``), for one path."""
    run_steps(model, args, device, full_output)  # warm-up (first call: allocations, one-time set-up)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        steps = run_steps(model, args, device, full_output)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    per_step = 1.0 / steps  # the loop ends after T steps even when --profile-steps asks for more
    times = {name: 0.0 for name in PARTS}
    for event in prof.key_averages():
        if event.key in times:
            micros = event.device_time_total if device.type == "cuda" else event.cpu_time_total
            times[event.key] += micros / 1e3 * per_step
    times["Python, launches, syncs (rest of wall)"] = max(wall * 1e3 * per_step - sum(times.values()), 0.0)
    times["total (wall)"] = wall * 1e3 * per_step
    return times


def main(argv: list[str] | None = None) -> None:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="mid", choices=sorted(SIZES))
    p.add_argument("--sampler", default="remdm-loop", choices=masked_samplers())
    p.add_argument("--refresh", "-K", type=positive_int, default=1)
    p.add_argument("--steps", "-T", type=positive_int, default=256,
                   help="T of the generation whose first steps are run")
    p.add_argument("--profile-steps", type=positive_int, default=16)
    p.add_argument("--length", type=positive_int, default=256)
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="profiled runs per path, alternating (median reported)")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        p.error(str(err))
    torch.manual_seed(0)
    model = SIZES[args.size]().to(device).eval()
    instrument(model)
    instrument_functions()
    paths = {"full output (before)": True, "decoded rows (after)": False}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in paths}
    for _ in range(args.repeats):  # the two paths alternate, so a drift of the machine hits both
        for label, full in paths.items():
            runs[label].append(breakdown(model, args, device, full))
    rows = {label: {part: statistics.median(r[part] for r in reps) for part in reps[0]}
            for label, reps in runs.items()}
    print(f"# {args.size}: L={args.length} B={args.batch_size} T={args.steps} K={args.refresh} {args.sampler} "
          f"{args.dtype} on {device} ({torch.get_num_threads()} threads), "
          f"first {min(args.profile_steps, args.steps)} steps, ms per step "
          f"({'device' if device.type == 'cuda' else 'CPU'} time), median of {args.repeats} runs per path")
    labels = list(rows)
    print(f"| part | {' | '.join(labels)} |")
    print("|---|" + "---:|" * len(labels))
    for part in next(iter(rows.values())):
        print(f"| {part} | " + " | ".join(f"{rows[label][part]:.2f}" for label in labels) + " |")
    before, after = (rows[label]["total (wall)"] for label in labels)
    print(f"\nspeedup per step: {before / after:.2f}x")


if __name__ == "__main__":
    main()
