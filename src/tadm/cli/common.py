"""Helpers shared by the ``tadm`` subcommands: argument types and the user-error exception."""

from __future__ import annotations

import argparse
from typing import Callable


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type accepting integers >= ``minimum``, with a message naming the bad value."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {number}")
        return number

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def fidelity_args(p: argparse.ArgumentParser) -> None:
    """--nucleus and --time-grid: fidelity to the released ReMDM sampler (see tadm.sampling.remdm)."""
    from tadm.sampling.base import TIME_GRIDS
    from tadm.sampling.categorical import NUCLEUS_RULES

    p.add_argument("--nucleus", choices=NUCLEUS_RULES, default="released",
                   help="nucleus rule: 'released' (ReMDM code: cumulative mass <= p, plus the top-1; default) or "
                        "'standard' (also keeps the token crossing p)")
    p.add_argument("--time-grid", choices=TIME_GRIDS, default="paper",
                   help="'paper' (t = i/T, alpha from the schedule; default) or 'released' (ReMDM code: "
                        "t = linspace(1, 1e-5, T+1), alpha = 1 - t, final argmax call)")
