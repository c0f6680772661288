"""The run directory's safety: one run at a time, and no leftovers of saves killed midway.

* :class:`RunDirLock` is an exclusive OS file lock (``fcntl.flock``) on ``out_dir/.tadm.lock``,
  held for the whole of a ``tadm train``, ``tadm posttrain train`` or ``tadm study``
  (:func:`claim_run_dir` takes it for a possibly distributed run): a second run on the same
  ``out_dir`` (fresh or resumed) is refused with a message naming the holder (PID and host,
  written into the lock file). The OS releases the lock when the holder exits, also when it
  crashes or is killed.
* Files and directories are saved atomically through a temporary sibling named after the writing
  process, ``.<name>.tmp-<pid>`` (see :func:`tadm.records.temporary_path`). A process killed during a save
  leaves it behind; :func:`remove_stale_temporaries` deletes those whose writer is dead and
  never touches one of a live process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tadm.config import ConfigError
from tadm.records import replace_atomically, temporary_path  # also importable from here, where they lived first
from tadm.training.distributed import DistInfo, all_gather_objects

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILENAME", "RunDirLock", "RunDirLockedError", "claim_run_dir", "pid_alive", "prepare_run_dir",
           "remove_stale_temporaries", "replace_atomically", "temporary_path"]

LOCK_FILENAME = ".tadm.lock"
# ".<target>.tmp-<pid>" (or "<target>.tmp-<pid>" in the data cache); ".<target>.old-<pid>" is a
# previous model directory moved aside while its replacement is renamed into place.
_TEMPORARY = re.compile(r"^\.?(?P<target>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


class RunDirLockedError(ConfigError):
    """Another process holds the run directory's lock."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(directory: str | os.PathLike[str], target: str | None = None) -> list[Path]:
    """Delete the temporaries in ``directory`` whose writing process is dead; return what was cleaned.

    A moved-aside previous model directory (``.<target>.old-<pid>``) whose ``target`` is missing
    (the kill landed between the two renames of a replacement) is renamed back instead of
    deleted. Temporaries of live processes, this one included, are left alone. With ``target``,
    only the temporaries of that name are considered (for directories tadm does not own).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    cleaned = []
    for path in sorted(directory.iterdir()):
        found = _TEMPORARY.match(path.name)
        if found is None or pid_alive(int(found["pid"])) or target not in (None, found["target"]):
            continue
        destination = directory / found["target"]
        if found["kind"] == "old" and not destination.exists():
            os.replace(path, destination)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        cleaned.append(path)
    return cleaned


def prepare_run_dir(directory: str | os.PathLike[str], what: str = "train.out_dir") -> Path:
    """Create ``directory`` if needed; a one-line ConfigError if a file is in the way or it is not writable."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{what} {str(directory)!r} is an existing file, not a directory; choose another {what}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"{what} {str(directory)!r} cannot be created ({err.strerror or err}); choose another {what}"
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(directory)!r} is read-only; choose a writable {what}")
    return directory


class RunDirLock:
    """An exclusive lock on a run directory, held from :meth:`acquire` to :meth:`release` (or process exit).

    Use as ``with RunDirLock(out_dir): ...``. The lock file stays in place (removing it would let
    two processes lock two different files); its content names the latest holder.
    """

    def __init__(self, directory: str | os.PathLike[str], what: str = "train.out_dir") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILENAME
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock or raise :class:`RunDirLockedError` naming the holder; ConfigError if it cannot be written."""
        if fcntl is None or self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"{self.what} {str(self.directory)!r} is not writable ({err.strerror or err})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "a process that is starting"
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise ConfigError(f"cannot lock {self.path}: {err.strerror or err}") from None
            raise RunDirLockedError(
                f"{self.what} {str(self.directory)!r} is in use by another run ({holder}); wait for it to end, "
                f"or choose another {self.what}"
            ) from None
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"PID {os.getpid()} on host {socket.gethostname()}, since {stamp}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock up (closing the file releases it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def claim_run_dir(
    directory: str | os.PathLike[str], info: DistInfo, *, what: str = "train.out_dir",
    check: Callable[[], None] | None = None,
) -> Iterator[list[Path]]:
    """Hold ``directory`` for one (possibly distributed) run: rank 0 runs ``check`` (a callable raising
    ConfigError, e.g. "nothing to resume"), creates the directory (:func:`prepare_run_dir`), takes its
    :class:`RunDirLock` for the body and removes leftovers of killed saves in it.

    If rank 0 cannot, every rank raises: rank 0 its own error, the others a ConfigError with its
    message (so under ``torchrun`` no rank waits for the others). Yields the leftovers removed
    (on rank 0; ``[]`` on the others).
    """
    lock, problem, cleaned = None, None, []
    if info.is_main:
        try:
            if check is not None:
                check()
            lock = RunDirLock(prepare_run_dir(directory, what), what).acquire()
            cleaned = remove_stale_temporaries(directory)
        except ConfigError as err:
            problem = err
    problems = all_gather_objects(None if problem is None else str(problem), info)
    if problem is not None:
        raise problem
    if problems[0] is not None:
        raise ConfigError(problems[0])
    try:
        yield cleaned
    finally:
        if lock is not None:
            lock.release()
