"""Cost of the stale-anchor likelihood next to a fresh evaluation, side by side in one run.

    python benchmarks/bench_staleness.py                       # a mid-size TADM and ADLM on this machine
    python benchmarks/bench_staleness.py --device cuda --sizes small --length 1024

``tadm.eval.likelihood.stale_anchor_nelbo`` evaluates the T-ANELBO at cache ages k = 1 .. k_max on
top of the fresh bound, reusing the fresh pass's S(z_t); each age adds one anchor pass and one
fusion + denoiser pass. This script times, on the same blocks and seed, ``diffusion_nelbo`` (the fresh
bound alone) and ``stale_anchor_nelbo`` with ``--max-age`` ages, and prints the cost of one age as
a multiple of the fresh evaluation (the target is at most 1.5x) and the check that k = 0 equals the
fresh bound exactly. Random weights: the cost does not depend on them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tadm.cli import OneLineErrorParser
from tadm.cli.common import positive_int
from tadm.devices import resolve_device
from tadm.eval.likelihood import diffusion_nelbo, stale_anchor_nelbo
from tadm.nn import adlm_small, tadm_small

SIZES = {
    "mid": dict(hidden_size=256, num_heads=4, anchor_layers=8, denoiser_layers=4, vocab_size=8192, cond_dim=64),
    "small": dict(),
}


def timed(fn, repeats: int) -> tuple[float, object]:
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def main(argv: list[str] | None = None) -> None:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["mid"], choices=sorted(SIZES))
    p.add_argument("--length", type=positive_int, default=128)
    p.add_argument("--blocks", type=positive_int, default=16)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-age", type=positive_int, default=4)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        p.error(str(err))
    print(f"{'model':<12} {'fresh s':>8} {'stale s':>8} {'per age':>8} {'ages':>5}  k=0 == fresh")
    for size in args.sizes:
        for name, builder in (("tadm", tadm_small), ("adlm", adlm_small)):
            model = builder(**SIZES[size], dropout=0.0, max_seq_len=args.length).to(device).eval()
            vocab = model.vocab_size - 1
            x = torch.randint(0, vocab, (args.blocks, args.length), generator=torch.Generator().manual_seed(0))
            kw = dict(batch_size=args.batch_size, seed=0, device=device)
            fresh_s, fresh = timed(lambda: diffusion_nelbo(model, x, **kw), args.repeats)
            stale_s, stale = timed(lambda: stale_anchor_nelbo(model, x, steps=(128,), max_age=args.max_age,
                                                              uninformative=False, **kw), args.repeats)
            per_age = (stale_s - fresh_s) / args.max_age / fresh_s
            print(f"{name + '-' + size:<12} {fresh_s:>8.3f} {stale_s:>8.3f} {per_age:>7.2f}x {args.max_age:>5}  "
                  f"{stale.fresh == fresh.nll}")


if __name__ == "__main__":
    main()
