"""Measured anchor-cache speedup next to the analytic layer-call ratio, side by side in one run.

    python benchmarks/bench_sampling.py                      # tiny + mid-size TADM on this machine
    python benchmarks/bench_sampling.py --device cuda --dtype bfloat16 --sizes small --length 1024

For each model size and refresh interval K it generates ``--batch-size`` sequences of ``--length``
tokens with ``--steps`` reverse steps (``--sampler``, random weights: speed does not depend on the
weights) and prints tokens/s (all L positions counted, as in the paper), the measured speedup over
K = 1, and the analytic Transformer-layer ratio C(K=1) / C(K) of Eq. (anchor-cache-compute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tadm.eval.compute import layer_calls
from tadm.nn import tadm_small, tadm_tiny
from tadm.sampling import generate, get_sampler

SIZES = {
    "tiny": lambda: tadm_tiny(),
    # a CPU-sized model: 8 + 4 blocks at d = 256 with an 8k vocabulary
    "mid": lambda: tadm_small(hidden_size=256, num_heads=4, anchor_layers=8, denoiser_layers=4,
                              vocab_size=8192, cond_dim=64, dropout=0.0, max_seq_len=256),
    "small": lambda: tadm_small(dropout=0.0),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(model, args, K: int, device: torch.device) -> float:
    sampler = get_sampler(args.sampler, model.mask_token_id)
    seconds = []
    for rep in range(args.warmup + args.repeats):
        g = torch.Generator(device=device).manual_seed(rep)
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=getattr(torch, args.dtype), enabled=args.dtype != "float32"):
            generate(model, sampler, batch_size=args.batch_size, seq_len=args.length, num_steps=args.steps,
                     refresh_interval=K, generator=g, device=device)
        _sync(device)
        if rep >= args.warmup:
            seconds.append(time.perf_counter() - start)
    return args.batch_size * args.length / statistics.median(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny", "mid"], choices=sorted(SIZES))
    p.add_argument("--refresh", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sampler", default="mdlm", help="mdlm, remdm-cap (top-p 0.9), remdm-loop, ...")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"device={device} sampler={args.sampler} dtype={args.dtype} steps T={args.steps} length L={args.length} batch={args.batch_size} "
          f"threads={torch.get_num_threads()}")
    print(f"{'model':<6} {'split S/A/D':>11} {'K':>3} {'tokens/s':>10} {'speedup':>8} {'analytic':>9}")
    for size in args.sizes:
        model = SIZES[size]().to(device).eval()
        split = model.layer_split
        if args.length > model.config.max_seq_len:
            raise SystemExit(f"--length {args.length} exceeds {size}'s max_seq_len {model.config.max_seq_len}")
        base_tps = None
        for K in args.refresh:
            tps = measure(model, args, K, device)
            base_tps = base_tps or tps
            analytic = layer_calls(split, args.steps, args.refresh[0]) / layer_calls(split, args.steps, K)
            print(f"{size:<6} {f'{split.shared}/{split.anchor}/{split.denoiser}':>11} {K:>3} {tps:>10.1f} "
                  f"{tps / base_tps:>7.2f}x {analytic:>8.2f}x")


if __name__ == "__main__":
    main()
