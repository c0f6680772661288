"""``tadm compute``: the analytic Transformer-layer cost of anchor-cache inference (Eq. 9, Table 2)."""

from __future__ import annotations

import argparse

from tadm.cli.common import (CLIError, nonnegative_int, positive_int, print_json, refresh_arg, refresh_policies,
                             steps_arg)
from tadm.eval.compute import compute_row
from tadm.protocol import LayerSplit


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compute",
        help="analytic Transformer-layer calls of anchor-cache inference (paper Eq. 9 / Table 2)",
        description="Layer calls C = T (L_S + L_D) + R L_A for one generation (R = ceil(T/K) refreshes for a fixed "
                    "K, the listed steps of a schedule), normalised to a baseline.",
    )
    p.add_argument("--shared-layers", type=nonnegative_int, default=0, metavar="N")
    p.add_argument("--anchor-layers", type=nonnegative_int, required=True, metavar="N")
    p.add_argument("--denoiser-layers", type=nonnegative_int, required=True, metavar="N")
    steps_arg(p, many=True, required=True)
    refresh_arg(p, many=True, default="1")
    p.add_argument(
        "--baseline-layers",
        type=positive_int,
        default=None,
        metavar="N",
        help="normalise to an uncached N-layer model (paper: 12, MDLM); default: this split at K=1",
    )
    p.add_argument("--json", action="store_true", help="print JSON (one object for one (T, K), else a list)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    split = LayerSplit(args.shared_layers, args.anchor_layers, args.denoiser_layers)
    if split.total == 0:
        raise CLIError("--shared-layers, --anchor-layers and --denoiser-layers are all 0: a layer split needs at "
                       "least one Transformer layer")
    try:
        rows = [compute_row("model", split, t, policy, baseline_layers=args.baseline_layers)
                for t in args.steps for policy in refresh_policies(args)]
    except ValueError as err:
        raise CLIError(str(err)) from None
    if args.json:
        layers = {"shared_layers": split.shared, "anchor_layers": split.anchor, "denoiser_layers": split.denoiser}
        return print_json([{k: v for k, v in row.as_dict().items() if k != "name"} | layers for row in rows])
    print(f"layer split: shared={split.shared} anchor={split.anchor} denoiser={split.denoiser}")
    width = max(4, *(len(str(row.refresh)) for row in rows))  # K, or the key of another policy
    print(f"{'T':>6} {'K':>{width}} {'layer calls':>12} {'baseline':>10} {'relative':>9}")
    for row in rows:
        print(f"{row.num_steps:>6} {row.refresh!s:>{width}} {row.layer_calls:>12} {row.baseline_layer_calls:>10} "
              f"{row.relative:>8.2f}x")
    return 0
