"""Sampling speed in the paper's Table 2 layout, TADM and MDLM, measured side by side in one run.

    python benchmarks/bench_gpu.py                       # one GPU: the paper's config (below)
    python benchmarks/bench_gpu.py --batch-sizes 1 8 32 64 --steps 1024 --refresh 1 8
    python benchmarks/bench_gpu.py --preset cpu          # this machine: a mid-size config

The paper's config (``--preset paper``, the default on CUDA): the 224M TADM (d = 768, 12 anchor +
6 denoiser blocks) and the 12-block MDLM, GPT-2 vocabulary, L = 1024, batch 1, bf16 autocast,
ReMDM-loop (top-p 0.9), T in {128, 256, 512, 1024}, K in {1, 2, 4, 8}. Random weights: speed does
not depend on them. For every (model, batch, T, K) it prints the median tokens/s of ``--repeats``
generations (all B x L tokens counted, as in the paper), the layer calls of Eq.
(anchor-cache-compute), the measured speedup over K = 1 of the same model and T, the analytic
ratio of matmul FLOPs (layers + fusion + output head, :func:`tadm.eval.compute.generation_flops`)
and the achieved TFLOP/s next to the device's bf16 peak. ``--weights bfloat16`` runs bf16 weights
instead of autocast, ``--compile reduce-overhead`` compiles the DiT stacks and fusion with CUDA
graphs (:meth:`~tadm.nn.MaskedDiffusionNetwork.compile_stacks`). ``--compare-full`` also times the
reference path that computes x_theta at every position (``full_output=True``), for the gain of
computing it on decoded rows only; ``--compare-skip`` times MDLM's skip of unchanged canvases
together with the anchor cache. Cells are timed in interleaved rounds so that a drift of the
machine hits every cell alike. On CPU, where a run takes minutes, a progress bar (stderr) names the
cell being generated and shows its reverse steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from tqdm.auto import tqdm

from tadm.cli import OneLineErrorParser
from tadm.cli.common import masked_samplers, nonnegative_int, positive_float, positive_int
from tadm.devices import resolve_device
from tadm.eval.compute import generation_flops, layer_calls
from tadm.nn import mdlm_small, tadm_small
from tadm.sampling import generate, get_sampler

PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"models": {"tadm": lambda: tadm_small(dropout=0.0), "mdlm": lambda: mdlm_small(dropout=0.0)},
              "length": 1024, "steps": [128, 256, 512, 1024], "dtype": "bfloat16"},
    # the paper's vocabulary and depth ratio at d = 256, L = 128: minutes on two CPU cores
    "cpu": {"models": {"tadm": lambda: tadm_small(hidden_size=256, num_heads=4, anchor_layers=8, denoiser_layers=4,
                                                  cond_dim=64, dropout=0.0),
                       "mdlm": lambda: mdlm_small(hidden_size=256, num_heads=4, num_layers=8, cond_dim=64,
                                                  dropout=0.0)},
            "length": 128, "steps": [32, 64, 128], "dtype": "float32"},
}
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0, "GH200": 989.0}


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """Dense bf16 tensor-core peak of the GPU (vendor data sheet), or ``override``; None on CPU."""
    if override is not None or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


class HeadRows:
    """Counts the rows the output layer computes (for the FLOPs actually done)."""

    def __init__(self, model: Any) -> None:
        self.rows = 0
        model.head.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, out: torch.Tensor) -> None:
        self.rows += out.numel() // out.shape[-1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cells(cells: list[dict[str, Any]], args: argparse.Namespace, device: torch.device) -> None:
    """Fill each cell's ``seconds`` (timed generations) and ``head_rows``, in shuffled interleaved rounds; on CPU a
    bar counts the generations, names the cell at work and shows its reverse steps."""
    amp = getattr(torch, args.dtype)
    rounds, on_cpu = args.warmup + args.repeats, device.type == "cpu"
    bar = tqdm(total=rounds * len(cells), unit="generation", disable=not on_cpu)
    for r in range(rounds):
        order = list(cells)
        random.Random(r).shuffle(order)
        for cell in order:
            bar.set_description(f"round {r + 1}/{rounds}{' (warm-up)' if r < args.warmup else ''}: {cell['name']} "
                                f"B={cell['batch']} T={cell['T']} K={cell['K']} {cell['variant']}")
            sampler = get_sampler(args.sampler, cell["model"].mask_token_id)
            g = torch.Generator(device=device).manual_seed(r)
            counter = cell["head"]
            counter.rows = 0
            _sync(device)
            start = time.perf_counter()
            autocast = amp != torch.float32 and args.weights == "float32"
            with torch.autocast(device.type, dtype=amp) if autocast else nullcontext():
                generate(cell["model"], sampler, batch_size=cell["batch"], seq_len=args.length,
                         num_steps=cell["T"], refresh_interval=cell["K"], generator=g, device=device,
                         full_output=cell["variant"] == "full", skip_unchanged=cell["variant"] == "skip",
                         progress=on_cpu)  # a bar update per step costs microseconds against a CPU step's ms
            _sync(device)
            if r >= args.warmup:
                cell.setdefault("seconds", []).append(time.perf_counter() - start)
                cell["head_rows"] = counter.rows
            bar.update()
    bar.close()


def count_syncs(model: Any, args: argparse.Namespace, device: torch.device, T: int, K: int) -> int:
    """Synchronising CUDA calls of one generation (``torch.cuda.set_sync_debug_mode("warn")`` warnings)."""
    import warnings

    sampler = get_sampler(args.sampler, model.mask_token_id)
    g = torch.Generator(device=device).manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            generate(model, sampler, batch_size=1, seq_len=args.length, num_steps=T, refresh_interval=K,
                     generator=g, device=device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def variants(args: argparse.Namespace) -> list[str]:
    """The paths timed per (model, B, T, K): decoded rows only (default), full output, skip unchanged."""
    return ["rows"] + (["full"] if args.compare_full else []) + (["skip"] if args.compare_skip else [])


def build_cells(args: argparse.Namespace, models: dict[str, Callable[[], Any]], device: torch.device) -> list[dict]:
    cells = []
    for name, make in models.items():
        model = make().to(device).eval()
        if args.weights != "float32":
            model = model.to(getattr(torch, args.weights))  # inference weights instead of autocast
        if args.compile != "none":
            model.compile_stacks(mode=args.compile)
        head = HeadRows(model)
        for batch in args.batch_sizes:
            for T in args.steps:
                for K in args.refresh if model.layer_split.anchor else [1]:
                    for variant in variants(args):
                        cells.append({"name": name, "model": model, "head": head, "batch": batch, "T": T, "K": K,
                                      "variant": variant})
    return cells


def report(cells: list[dict[str, Any]], args: argparse.Namespace, peak: float | None) -> None:
    index = {(c["name"], c["batch"], c["T"], c["K"], c["variant"]): c for c in cells}
    head = ["model", "B", "T", "K", "tokens/s", "layer calls", "speedup", "analytic", "TFLOP/s"]
    head += ["% of peak"] if peak else []
    head += ["full-output tok/s", "gain"] if args.compare_full else []
    head += ["skip-unchanged tok/s"] if args.compare_skip else []
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * 4 + "---:|" * (len(head) - 4))
    for c in cells:
        if c["variant"] != "rows":
            continue
        model, B, T, K, L = c["model"], c["batch"], c["T"], c["K"], args.length
        seconds = statistics.median(c["seconds"])
        tps = B * L / seconds
        base = index[(c["name"], B, T, 1, "rows")]
        base_tps = B * L / statistics.median(base["seconds"])
        flops = generation_flops(model, batch_size=B, seq_len=L, num_steps=T, refresh_interval=K,
                                 head_rows=c["head_rows"])
        flops_k1 = generation_flops(model, batch_size=B, seq_len=L, num_steps=T, head_rows=base["head_rows"])
        tflops = flops.total / seconds / 1e12
        row = [c["name"], str(B), str(T), str(K), f"{tps:,.1f}", str(layer_calls(model.layer_split, T, K)),
               f"{tps / base_tps:.2f}x", f"{flops_k1.total / flops.total:.2f}x", f"{tflops:.2f}"]
        row += [f"{100 * tflops / peak:.1f}%"] if peak else []
        if args.compare_full:
            full = B * L / statistics.median(index[(c["name"], B, T, K, "full")]["seconds"])
            row += [f"{full:,.1f}", f"{tps / full:.2f}x"]
        if args.compare_skip:
            row += [f"{B * L / statistics.median(index[(c['name'], B, T, K, 'skip')]['seconds']):,.1f}"]
        print("| " + " | ".join(row) + " |")


def main(argv: list[str] | None = None) -> None:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: paper on CUDA, cpu otherwise")
    p.add_argument("--models", nargs="+", choices=["tadm", "mdlm"], default=["tadm", "mdlm"])
    p.add_argument("--steps", "-T", nargs="+", type=positive_int, help="default: the preset's")
    p.add_argument("--refresh", "-K", nargs="+", type=positive_int, default=[1, 2, 4, 8])
    p.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1])
    p.add_argument("--length", type=positive_int, help="default: the preset's L")
    p.add_argument("--sampler", default="remdm-loop", choices=masked_samplers())
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="autocast dtype; default: the preset's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--warmup", type=nonnegative_int, default=1)
    p.add_argument("--weights", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="cast the weights for inference (then no autocast); default: float32 weights + autocast")
    p.add_argument("--compile", choices=["none", "default", "reduce-overhead", "max-autotune"], default="none",
                   help="torch.compile the DiT stacks and fusion (reduce-overhead: CUDA graphs); the head stays eager")
    p.add_argument("--compare-full", action="store_true", help="also time x_theta on every position (reference)")
    p.add_argument("--compare-skip", action="store_true",
                   help="also time skip_unchanged (no network call when the canvas did not change)")
    p.add_argument("--peak-tflops", type=positive_float, help="the device's dense bf16 peak, if not known")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        p.error(str(err))
    preset = PRESETS[args.preset or ("paper" if device.type == "cuda" else "cpu")]
    args.steps = args.steps or preset["steps"]
    args.length = preset["length"] if args.length is None else args.length
    args.dtype = args.dtype or preset["dtype"]
    if 1 not in args.refresh:
        p.error("--refresh must include 1 (the reference of the speedup)")
    if args.compile != "none" and args.warmup == 0:
        p.error("--compile needs --warmup >= 1: the first generation of each cell compiles, and would be timed")
    torch.manual_seed(0)
    models = {name: preset["models"][name] for name in args.models}
    cells = build_cells(args, models, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# {where}; L={args.length}, {args.sampler}, autocast {args.dtype}, weights {args.weights}, "
          f"compile {args.compile}, median of {args.repeats} "
          f"(+{args.warmup} warm-up) per cell, {len(cells)} cells interleaved")
    start = time.perf_counter()
    time_cells(cells, args, device)
    report(cells, args, peak_tflops(device, args.peak_tflops))
    if device.type == "cuda":
        for c in cells[:1]:
            syncs = count_syncs(c["model"], args, device, c["T"], c["K"])
            print(f"\nsynchronising CUDA calls in one {c['name']} generation of T = {c['T']}: {syncs} "
                  f"({syncs / c['T']:.2f} per step)")
    print(f"\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
