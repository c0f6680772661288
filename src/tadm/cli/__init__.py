"""The ``tadm`` command: one module per subcommand, each exposing ``add_parser(sub)`` and ``run(args)``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from tadm.cli import compute, quickstart, sample, study, tokenizer, train
from tadm.cli import eval as eval_cmd
from tadm.cli import posttrain
from tadm.cli.common import CLIError

SUBCOMMANDS = (quickstart, train, sample, compute, tokenizer, eval_cmd, study, posttrain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tadm", description="Time-anchored diffusion language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError) as err:
        print(f"tadm {args.command}: error: {err}", file=sys.stderr)
        return 2
