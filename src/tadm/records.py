"""Result records on disk, one way for every experiment: JSON-ready values, atomic writes, provenance, unit stores.

* :func:`json_ready`, :func:`write_json`, :func:`read_json`, :func:`read_json_lines`, :func:`write_csv`:
  values and files as every result writer needs them;
* :func:`replace_atomically`, :func:`replace_directory`: how a file or a directory is put in place, through
  a temporary sibling (:func:`temporary_path`) that ``tadm.training.rundir.remove_stale_temporaries``
  cleans up after a kill;
* :func:`git_commit`, :func:`machine_info`: where a result came from;
* :class:`UnitStore`: the resumable units of a sweep, a study or a task run, each one JSON file holding
  the *spec* that produced it, its payload and its provenance; a unit holding the same spec is skipped;
* :func:`check_publishable`: a table from a source tree with local changes needs ``allow_dirty``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

import torch  # heavy: only when a result is written

from tadm import __version__

__all__ = ["ALLOW_DIRTY_ENV", "DirtyTreeError", "UnitStore", "check_publishable", "dataclass_record", "fsync_dir",
           "git_commit", "json_ready", "markdown_table", "machine_info", "provenance_note", "read_json",
           "read_json_lines", "replace_atomically", "replace_directory", "same_spec", "temporary_path", "write_csv",
           "write_json", "write_text"]

ALLOW_DIRTY_ENV = "TADM_ALLOW_DIRTY"
_SOURCE = Path(__file__).resolve().parent
_COMMIT_CACHE: dict[str, Any] = {}


def json_ready(value: Any) -> Any:
    """``value`` with NaN/inf as None and tuples as lists (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def dataclass_record(result: Any, *properties: str, omit: Iterable[str] = ()) -> dict[str, Any]:
    """The fields of the dataclass ``result`` in declaration order (less ``omit``), then its ``properties``.

    Values are kept as they are (not copied), so a record is cheap to build and :func:`json_ready` does the rest.
    """
    omitted = set(omit)
    record = {f.name: getattr(result, f.name) for f in fields(result) if f.name not in omitted}
    record.update((name, getattr(result, name)) for name in properties)
    return record


def markdown_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table: the first column left-aligned, the others centred, each cell written with ``str``."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def temporary_path(path: str | os.PathLike[str], kind: str = "tmp") -> Path:
    """``.<name>.<kind>-<pid>`` beside ``path``: where this process assembles ``path`` before renaming it."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}")


def replace_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any], *, fsync: bool = True) -> Path:
    """``write(file)`` into :func:`temporary_path`, flushed to disk if ``fsync``, then ``os.replace`` onto ``path``:
    a reader or a kill finds the old file or the new one, and an error leaves no temporary."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush the directory ``path`` (the renames into it) to disk."""
    with contextlib.suppress(OSError):  # some platforms cannot open or fsync directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_directory(staging: Path, target: Path, *, fsync: bool = False) -> None:
    """Rename the directory ``staging`` onto ``target``; a ``target`` already there is moved aside to
    ``temporary_path(target, "old")`` first, put back if the rename fails and removed after it.

    With ``fsync``, the files of ``staging`` are flushed to disk before the rename and the parent
    directory after it. A kill between the two renames leaves the moved-aside copy, which
    ``remove_stale_temporaries`` puts back.
    """
    if fsync:
        for file in staging.iterdir():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    old = temporary_path(target, "old") if target.exists() else None
    if old is not None:
        os.replace(target, old)
    try:
        os.replace(staging, target)
    except OSError:
        if old is not None:
            os.replace(old, target)
        raise
    if fsync:
        fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`replace_atomically`, no fsync); parents are created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return replace_atomically(path, lambda f: f.write(text.encode("utf-8")), fsync=False)


def write_json(path: str | os.PathLike[str], payload: Any, indent: int = 1) -> Path:
    """``payload`` as JSON (:func:`json_ready`), written atomically."""
    return write_text(path, json.dumps(json_ready(payload), indent=indent) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in ``path``, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_json_lines(path: str | os.PathLike[str]) -> list[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSON-lines file; a malformed line is a one-line error."""
    values = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{number}: not UTF-8 (byte {raw[err.start]:#04x} at column "
                                 f"{err.start + 1}); the file must be UTF-8 JSON lines") from None
            if line.strip():
                try:
                    values.append((number, json.loads(line)))
                except ValueError as err:
                    raise ValueError(f"{path}:{number}: not valid JSON ({err})") from None
    return values


def write_csv(path: str | os.PathLike[str], fields: Sequence[str], rows: Sequence[dict[str, Any]]) -> Path:
    """Rows as CSV with the columns ``fields`` (missing and None values empty), written atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in fields})
    return write_text(path, buf.getvalue())


# -------------------------------------------------------------------------------------- provenance
def git_commit(where: Path | None = None) -> dict[str, Any]:
    """The git commit of the tadm source tree (None outside a checkout) and whether it has local changes.

    A folder that git does not track is no checkout of it, even inside another repository: tadm installed into a
    virtualenv within a user's own project reports None, not that project's commit and changes. Read at most
    once every 30 seconds per folder (a unit store writes many records).
    """
    where = where or _SOURCE
    cached = _COMMIT_CACHE.get(str(where))
    if cached is not None and time.monotonic() - cached[0] < 30.0:
        return dict(cached[1])

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    result: dict[str, Any] = {"commit": None, "dirty": None}
    try:
        if git("ls-files", "--", "."):
            result = {"commit": git("rev-parse", "HEAD"),
                      "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):  # no git, no repository, or no commit yet
        pass
    _COMMIT_CACHE[str(where)] = (time.monotonic(), result)
    return dict(result)


def machine_info() -> dict[str, Any]:
    """Python, torch, CPU/GPU and thread count of this machine, for result files."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
        "tadm": __version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


class DirtyTreeError(ValueError):
    """A table was about to be published from a source tree with uncommitted changes."""


def check_publishable(allow_dirty: bool = False) -> dict[str, Any]:
    """The source tree's commit; a :class:`DirtyTreeError` if it has local changes and ``allow_dirty`` is not given.

    ``TADM_ALLOW_DIRTY=1`` allows it too. A tree that is no git checkout (an installed package) is fine.
    """
    source = git_commit()
    if source.get("dirty") and not (allow_dirty or os.environ.get(ALLOW_DIRTY_ENV) == "1"):
        raise DirtyTreeError(f"the tadm source tree ({_SOURCE.parent.parent}) has uncommitted changes at "
                             f"{str(source['commit'])[:10]}: commit them, or pass --allow-dirty (the table then "
                             f"says it came from a tree with local changes)")
    return source


def provenance_note(records: Sequence[dict[str, Any]]) -> str | None:
    """A sentence for tables built from units any of which came from a tree with local changes, else None."""
    dirty = sorted({str(r.get("commit"))[:10] for r in records if isinstance(r, dict) and r.get("dirty")})
    if not dirty:
        return None
    return f"**Made from a source tree with local changes** (at {', '.join(dirty)}): not reproducible from a commit."


# -------------------------------------------------------------------------------------- unit store
def same_spec(payload: Any, spec: Any) -> bool:
    """Whether a stored unit holds ``spec`` (compared as it reads back from JSON: tuples become lists)."""
    return isinstance(payload, dict) and payload.get("spec") == json.loads(json.dumps(json_ready(spec)))


class UnitStore:
    """Spec-keyed unit records under ``root``: written atomically with their provenance, skipped when done.

    >>> store = UnitStore("runs/x")
    >>> if not store.done("units/a.json", spec):
    ...     store.save("units/a.json", spec, {"accuracy": 0.5})
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, relative: str | os.PathLike[str]) -> Path:
        return self.root / relative

    def load(self, relative: str | os.PathLike[str]) -> dict[str, Any] | None:
        payload = read_json(self.path(relative))
        return payload if isinstance(payload, dict) else None

    def done(self, relative: str | os.PathLike[str], spec: Any) -> bool:
        return same_spec(self.load(relative), spec)

    def save(self, relative: str | os.PathLike[str], spec: Any, payload: dict[str, Any]) -> Path:
        """Write ``{"spec": spec, **payload, "provenance": {commit, dirty}}`` atomically."""
        return write_json(self.path(relative), {"spec": spec, **payload, "provenance": git_commit()})
