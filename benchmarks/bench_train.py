"""Training throughput and peak memory of TADM vs MDLM vs ADLM at equal width, side by side in one run.

    python benchmarks/bench_train.py                                  # tiny + mid on the CPU
    python benchmarks/bench_train.py --sizes small --device cuda --dtype bfloat16 --batch-size 16 --seq-len 1024

Each measurement is one optimisation step of the architecture's pretraining objective, forward +
backward + AdamW update, on random token blocks: the T-ANELBO with stale anchors for TADM, the
masked NELBO for MDLM, the ANELBO (with the anchor term) for ADLM, as implemented by
``tadm.training.objectives`` (a local minimal version of the same losses is used if that module is
unavailable, and the header says so). Reported: training tokens/s (B * L per step, median over
``--steps`` after ``--warmup``), parameters, and peak memory.

Peak memory on CUDA is ``torch.cuda.max_memory_allocated``. On the CPU each model runs in a fresh
process (spawned) and the figure is that process's peak resident set size minus its resident size
just before the first step, i.e. the memory the training steps added (activations, gradients,
optimizer state); the absolute peak RSS is shown beside it.

Sizes keep one width per size and the paper's depth ratios: TADM and ADLM 2:1 anchor:denoiser
layers (paper: 12 + 6), MDLM as deep as the anchor (paper: 12).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import sys
import time
from typing import Any

from tadm.devices import resolve_device

SIZES: dict[str, dict[str, Any]] = {
    # width, heads, anchor layers (MDLM layers), denoiser layers, vocabulary, max length
    "tiny": dict(hidden_size=32, num_heads=2, anchor=2, denoiser=1, vocab_size=65, cond_dim=16),
    "mid": dict(hidden_size=256, num_heads=4, anchor=8, denoiser=4, vocab_size=8192, cond_dim=64),
    "small": dict(hidden_size=768, num_heads=12, anchor=12, denoiser=6, vocab_size=50258, cond_dim=128),
}
ARCHS = ("tadm", "mdlm", "adlm")


def build(arch: str, size: str, seq_len: int):
    from tadm.nn import adlm_small, mdlm_small, tadm_small

    s = SIZES[size]
    common = dict(hidden_size=s["hidden_size"], num_heads=s["num_heads"], vocab_size=s["vocab_size"],
                  cond_dim=s["cond_dim"], dropout=0.0, max_seq_len=max(seq_len, 64))
    if arch == "tadm":
        return tadm_small(anchor_layers=s["anchor"], denoiser_layers=s["denoiser"], **common)
    if arch == "adlm":
        return adlm_small(anchor_layers=s["anchor"], denoiser_layers=s["denoiser"], **common)
    return mdlm_small(num_layers=s["anchor"], **common)


def objective_fn(arch: str):
    """(loss_fn(model, x, generator) -> scalar, source name)."""
    try:
        from tadm.training.objectives import ObjectiveConfig, get_objective

        fn, cfg = get_objective(arch), ObjectiveConfig(gamma=3e-3 if arch == "adlm" else 0.0)
        return (lambda model, x, g: fn(model, x, g, cfg).loss), "tadm.training.objectives"
    except ImportError:
        return _local_objective(arch), "local minimal loss"


def _local_objective(arch: str):
    from tadm.diffusion import (
        further_mask, get_schedule, mask_corrupt, masked_diffusion_loss, sample_stale_anchor_times, sample_t,
    )

    sched = get_schedule("loglinear")

    def loss(model, x, g):
        mask_id = model.mask_token_id
        t = sample_t(x.shape[0], generator=g, device=x.device)  # (B,)
        if arch == "tadm":
            times = sample_stale_anchor_times(t, generator=g)
            z_t = mask_corrupt(x, sched.alpha(times.t), mask_id, g)
            z_tp = further_mask(z_t, sched.alpha(times.t), sched.alpha(times.t_anchor), mask_id, g)
            log_probs = model(z_t, z_anchor=z_tp).log_probs
        else:
            z_t = mask_corrupt(x, sched.alpha(t), mask_id, g)
            log_probs = model(z_t, t)
            if arch == "adlm":
                log_probs, anchor = log_probs
                extra = masked_diffusion_loss(anchor, x, z_t, t, sched, mask_id).mean()
                return masked_diffusion_loss(log_probs, x, z_t, t, sched, mask_id).mean() + 3e-3 * extra
        return masked_diffusion_loss(log_probs, x, z_t, t, sched, mask_id).mean()

    return loss


def measure(arch: str, size: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build(arch, size, args.seq_len).to(device).train()
    loss_fn, source = objective_fn(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab = SIZES[size]["vocab_size"]
    x = torch.randint(0, vocab - 1, (args.batch_size, args.seq_len), generator=g).to(device)  # (B, L)
    amp = getattr(torch, args.dtype)
    rss_before = _current_rss_mib()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=args.dtype != "float32"):
            loss = loss_fn(model, x, g)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    out = {
        "arch": arch, "size": size, "source": source,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_second": args.batch_size * args.seq_len / statistics.median(seconds),
        "loss": float(loss.detach()),
    }
    if device.type == "cuda":
        out["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        out["peak_note"] = "cuda max allocated"
    else:
        out["peak_mib"] = peak - rss_before
        out["peak_rss_mib"] = peak
    return out


def _current_rss_mib() -> float:
    """Resident set size now (Linux /proc), else the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(arch: str, size: str, args: argparse.Namespace, queue) -> None:
    try:
        queue.put(measure(arch, size, args))
    except BaseException as err:  # report, don't hang the parent
        queue.put({"arch": arch, "size": size, "error": repr(err)})


def run_isolated(arch: str, size: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(arch, size, args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main(argv: list[str] | None = None) -> None:
    # here, not at the top: each CPU measurement re-imports this module in a spawned process, and the CLI helpers
    # would add about 90 MiB to that process's absolute peak RSS
    from tadm.cli import OneLineErrorParser
    from tadm.cli.common import nonnegative_int, positive_int

    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny", "mid"], choices=sorted(SIZES))
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps (median)")
    p.add_argument("--warmup", type=nonnegative_int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads in each run (0: default)")
    args = p.parse_args(argv)
    try:
        args.device = str(resolve_device(args.device))  # "cpu" runs each model in its own process
    except ValueError as err:
        p.error(str(err))
    results = []
    for size in args.sizes:
        for arch in args.archs:
            r = run_isolated(arch, size, args) if args.device == "cpu" else measure(arch, size, args)
            if "error" in r:
                sys.exit(f"{arch}/{size} failed: {r['error']}")
            results.append(r)
    print(f"device={args.device} dtype={args.dtype} batch={args.batch_size} seq_len={args.seq_len} "
          f"steps={args.steps} (median) warmup={args.warmup}; objective from {results[0]['source']}")
    mem = "peak MiB (added)" if args.device == "cpu" else "peak MiB (cuda)"
    print(f"{'size':<6} {'arch':<5} {'params':>12} {'tokens/s':>10} {'vs MDLM':>8} {mem:>17} {'peak RSS MiB':>13}")
    for size in args.sizes:
        rows = [r for r in results if r["size"] == size]
        base = next((r["tokens_per_second"] for r in rows if r["arch"] == "mdlm"), None)
        for r in rows:
            rel = f"{r['tokens_per_second'] / base:.2f}x" if base else "-"
            rss = f"{r['peak_rss_mib']:.0f}" if "peak_rss_mib" in r else "-"
            print(f"{size:<6} {r['arch']:<5} {r['params']:>12,} {r['tokens_per_second']:>10.1f} {rel:>8} "
                  f"{r['peak_mib']:>17.1f} {rss:>13}")


if __name__ == "__main__":
    main()
