"""The ``tadm`` command: one module per subcommand, each exposing ``add_parser(sub)`` and ``run(args)``."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from tadm.cli import compute, quickstart, sample, study, tokenizer, train
from tadm.cli import eval as eval_cmd
from tadm.cli import posttrain
from tadm.cli.common import CLIError

SUBCOMMANDS = (quickstart, train, sample, compute, tokenizer, eval_cmd, study, posttrain)


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (the usage itself is behind ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="tadm", description="Time-anchored diffusion language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already printed in one line
        return int(done.code or 0) if not isinstance(done.code, str) else 2
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError) as err:
        print(f"tadm {args.command}: error: {err}", file=sys.stderr)
        return 2
