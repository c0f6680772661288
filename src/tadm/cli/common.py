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
