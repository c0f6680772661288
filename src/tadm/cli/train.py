"""``tadm train CONFIG [key=value ...] [--resume]``: pretrain a model described by a YAML preset."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="pretrain TADM / MDLM / ADLM / AR from a YAML config (torchrun for several GPUs)",
        description=(
            "Train the model described by CONFIG (a YAML file or a shipped preset: tadm-tiny, tadm-brown-cpu, tadm-owt-small, ...), with dotted overrides such as "
            "train.max_steps=200 model.overrides.hidden_size=128. Writes metrics.jsonl, training_state.pt "
            "and final/ (EMA model + tokenizer + config) into train.out_dir. Under torchrun "
            "(torchrun --nproc_per_node=N -m tadm train CONFIG) the run is data-parallel. "
            "Exit status: 0 done, 2 bad config or data, 3 the loss became NaN/inf."
        ),
    )
    p.add_argument("config", help="YAML preset, a YAML file or a shipped preset name, e.g. tadm-tiny")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.add_argument("--resume", action="store_true", help="continue from train.out_dir/training_state.pt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tadm.config import load_config
    from tadm.training.trainer import NonFiniteLossError, train

    cfg = load_config(args.config, args.overrides)
    try:
        train(cfg, resume=args.resume)
    except NonFiniteLossError as err:
        print(f"tadm train: {err}", file=sys.stderr)
        return 3
    return 0
