"""How a ``tadm`` process reports how it ended: which rank speaks under ``torchrun``, and Ctrl-C while it starts.

* Under ``torchrun`` every rank parses the same command line and reads the same config, so every
  rank meets the same bad argument: only rank 0 prints its one line (:func:`reports`), and every
  rank writes it into torchrun's error file for its rank (:func:`record_for_torchrun`), so that
  torchrun's failure summary names it instead of pointing to its documentation. (torchrun itself
  still prints that summary as a traceback of its own for any rank that exits non-zero: it must
  see the failure to stop the other ranks.)
* Importing the subcommands (torch, above all) takes a second or more; a Ctrl-C then would end in
  a ``KeyboardInterrupt`` traceback from the middle of an import. :func:`catch_startup_interrupt`
  turns it into one line and exit status 130 until :func:`restore_interrupt`.

This module imports only the standard library: it runs before anything heavy is loaded.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["DEBUG_ENV", "INTERRUPTED_STATUS", "catch_startup_interrupt", "debug_env", "record_for_torchrun",
           "reports", "restore_interrupt"]

DEBUG_ENV = "TADM_DEBUG"
INTERRUPTED_STATUS = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended
TORCHRUN_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each rank


def debug_env() -> bool:
    """The environment asks for tracebacks: ``TADM_DEBUG`` set to something other than '', '0', 'false' or 'no'."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def reports() -> bool:
    """Whether this process prints its one-line messages: yes, but for the ranks other than 0 under ``torchrun``."""
    try:
        return int(os.environ.get("RANK") or 0) == 0
    except ValueError:  # a malformed RANK is reported by init_distributed, once the command runs
        return True


def record_for_torchrun(line: str) -> None:
    """Write ``line`` into torchrun's error file of this rank (``TORCHELASTIC_ERROR_FILE``; nothing outside torchrun),
    in the layout torchrun reads, so that its failure summary shows the line."""
    path = os.environ.get(TORCHRUN_ERROR_FILE_ENV)
    if not path:
        return
    payload = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(payload, handle)
    except OSError:  # the summary then says what torchrun says without it
        pass


def _interrupted_while_starting(signum: int, frame: Any) -> None:
    if debug_env():
        raise KeyboardInterrupt  # the developer's traceback
    if reports():
        print("tadm: interrupted", file=sys.stderr)
    raise SystemExit(INTERRUPTED_STATUS)


def catch_startup_interrupt() -> Any:
    """From now on Ctrl-C (SIGINT) prints ``tadm: interrupted`` (on the reporting rank) and exits with status 130.

    Returns the handler it replaced, for :func:`restore_interrupt`; None (and nothing changed) off the main thread,
    where Python cannot install signal handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, _interrupted_while_starting)


def restore_interrupt(previous: Any) -> None:
    """Put back the SIGINT handler that :func:`catch_startup_interrupt` replaced (no-op for None)."""
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, previous)
