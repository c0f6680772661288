"""Measured anchor-cache speedup of K = 2, 4, 8 over K = 1 next to the analytic FLOP ratio, in one run.

    python benchmarks/bench_cache.py                         # tiny + paper-sized TADM on the CPU
    python benchmarks/bench_cache.py --device cuda --dtype bfloat16 --length 1024 --steps 128 \
        --small-length 1024 --small-steps 128 --repeats 5

For each model size and refresh interval K it times ``--repeats`` generations (after
``--warmup``) of ``--batch-size`` x L tokens with T reverse steps, random weights (speed does not
depend on them), and prints tokens/s (all L positions counted), the measured speedup over K = 1,
the Transformer-layer-call ratio C(1) / C(K) of Eq. (anchor-cache-compute), and the FLOP ratio
F(1) / F(K) that also counts the fusion module and the output head, which run at every step.

FLOPs of one generation (a multiply-add is 2 FLOPs; B sequences of L tokens, d = hidden size,
V = vocabulary, T steps, R = ceil(T / K) anchor refreshes):

    block   = 2 * P_block + 4 * L * d        per token and DiT block: the token-wise Linear
                                             weights P_block = (4 + 2 r) d^2 (q, k, v, out, MLP with
                                             ratio r), plus Q K^T and A V (2 L d each)
    fusion  = 2 * P_fusion                   per token: the gated-residual Linear weights
    head    = 2 * d * V                      per token: the output Linear
    F(K)    = B L [ T (L_D block + fusion + head) + R L_A block ]

Per-sequence work (adaLN modulation from the conditioning vector), embedding look-ups, norms and
the sampler's own work (softmax over V, Gumbel draws, nucleus sort) are left out of F; the sampler
work is why measured CPU speedups fall below the FLOP ratio, most visibly for large V.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from tadm.eval.compute import layer_calls
from tadm.nn import tadm_small, tadm_tiny
from tadm.sampling import generate, get_sampler


@dataclass
class FlopModel:
    """Per-token FLOP terms of a TADM (see the module docstring)."""

    block: int
    fusion: int
    head: int
    anchor_layers: int
    denoiser_layers: int

    def per_generation(self, batch: int, length: int, steps: int, refresh: int) -> int:
        refreshes = math.ceil(steps / refresh)
        per_step = self.denoiser_layers * self.block + self.fusion + self.head
        return batch * length * (steps * per_step + refreshes * self.anchor_layers * self.block)


def _token_linear_weights(module: nn.Module) -> int:
    """Weights of the Linear layers applied to every token (adaLN runs once per sequence: excluded)."""
    return sum(m.weight.numel() for name, m in module.named_modules()
               if isinstance(m, nn.Linear) and "adaLN" not in name)


def flop_model(model: nn.Module, length: int) -> FlopModel:
    d = model.config.hidden_size
    p_block = _token_linear_weights(model.anchor.blocks[0])
    return FlopModel(
        block=2 * p_block + 4 * length * d,
        fusion=2 * _token_linear_weights(model.fusion),
        head=2 * model.head.linear.weight.numel(),
        anchor_layers=model.config.anchor_layers,
        denoiser_layers=model.config.denoiser_layers,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tokens_per_second(model, sampler_name: str, args, length: int, steps: int, K: int, device) -> float:
    sampler = get_sampler(sampler_name, model.mask_token_id)
    seconds = []
    for rep in range(args.warmup + args.repeats):
        g = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(rep)
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=getattr(torch, args.dtype), enabled=args.dtype != "float32"):
            generate(model, sampler, batch_size=args.batch_size, seq_len=length, num_steps=steps,
                     refresh_interval=K, generator=g, device=device)
        _sync(device)
        if rep >= args.warmup:
            seconds.append(time.perf_counter() - start)
    return args.batch_size * length / statistics.median(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--refresh", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=64, help="T for the tiny model")
    p.add_argument("--length", type=int, default=64, help="L for the tiny model")
    p.add_argument("--small-steps", type=int, default=16, help="T for the paper-sized model")
    p.add_argument("--small-length", type=int, default=64, help="L for the paper-sized model")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sampler", default="mdlm", help="sampler name (mdlm: no nucleus sort)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default); 1 is steadier on a busy machine")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"device={device} dtype={args.dtype} batch={args.batch_size} sampler={args.sampler} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} (median) warmup={args.warmup}")
    sizes = {"tiny": (tadm_tiny, args.length, args.steps), "small": (tadm_small, args.small_length, args.small_steps)}
    rows = []
    for size in args.sizes:
        builder, length, steps = sizes[size]
        # rotary positions: the maximum length only bounds inputs, so raise it for long benchmarks
        model = builder(dropout=0.0, max_seq_len=max(length, 64 if size == "tiny" else 1024))
        model = model.to(device).eval()
        fm = flop_model(model, length)
        cfg = model.config
        print(f"\n{size}: d={cfg.hidden_size} V={cfg.vocab_size} L_A={cfg.anchor_layers} L_D={cfg.denoiser_layers} "
              f"L={length} T={steps}; per token: block 2*{(fm.block - 4 * length * cfg.hidden_size) // 2:,}"
              f" + 4*L*d = {fm.block:,} FLOPs, fusion {fm.fusion:,}, head 2*d*V = {fm.head:,}")
        base_tps = None
        for K in args.refresh:
            tps = tokens_per_second(model, args.sampler, args, length, steps, K, device)
            base_tps = base_tps or tps
            calls = layer_calls(model.layer_split, steps, args.refresh[0]) / layer_calls(model.layer_split, steps, K)
            f1 = fm.per_generation(args.batch_size, length, steps, args.refresh[0])
            fk = fm.per_generation(args.batch_size, length, steps, K)
            rows.append((size, length, steps, K, tps, tps / base_tps, calls, f1 / fk, fk / 1e9))
        del model
    print(f"\n{'model':<6} {'L':>5} {'T':>5} {'K':>3} {'tokens/s':>10} {'measured':>9} {'layer-call':>11} "
          f"{'FLOP ratio':>11} {'GFLOP/gen':>10}")
    print(f"{'':<6} {'':>5} {'':>5} {'':>3} {'':>10} {'speedup':>9} {'ratio':>11} {'(+head)':>11} {'':>10}")
    for size, length, steps, K, tps, speed, calls, flops, gflop in rows:
        print(f"{size:<6} {length:>5} {steps:>5} {K:>3} {tps:>10.1f} {speed:>8.2f}x {calls:>10.2f}x "
              f"{flops:>10.2f}x {gflop:>10.2f}")


if __name__ == "__main__":
    main()
