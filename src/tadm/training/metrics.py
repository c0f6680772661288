"""Training metrics: one JSON object per line in ``out_dir/metrics.jsonl``, optionally TensorBoard too.

Each record has ``"step"`` (optimizer steps done), ``"split"`` (``"train"`` or ``"val"``) and
numbers, e.g. ``{"step": 100, "split": "train", "loss": 5.31, "lr": 3e-4, "tokens_per_s": 812.5}``.
Floats are written with ``repr`` precision, so a value read back equals the logged one exactly.
On resume the file is rewritten atomically (temporary file, fsync, ``os.replace``) without the
records after the checkpoint; a last line cut off by a killed run is dropped with a notice.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable

from tadm.training.rundir import temporary_path

__all__ = ["METRICS_FILENAME", "MetricsLogger", "read_metrics"]

METRICS_FILENAME = "metrics.jsonl"


def _parse(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The records of a metrics file, and its last line when a kill cut it off (not newline-terminated, not JSON).

    Raises:
        ValueError: another line is not a JSON record (file and line named).
    """
    lines = path.read_text().split("\n")
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if lineno == len(lines):
                return records, line
            raise ValueError(f"{path}:{lineno}: not a JSON record ({err.msg})") from None
    return records, None


def read_metrics(path: str | os.PathLike[str], split: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (only those of ``split`` when given), in file order.

    A last line cut off by a killed run is skipped.
    """
    records, _ = _parse(Path(path))
    return [r for r in records if split is None or r.get("split") == split]


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


class MetricsLogger:
    """Appends records to ``out_dir/metrics.jsonl`` (and TensorBoard scalars); a no-op when disabled.

    Args:
        out_dir: run directory.
        enabled: False on every rank but 0.
        tensorboard: also write ``out_dir/tensorboard`` event files; warns and skips when the
            ``tensorboard`` package is missing.
        resume_step: when resuming, records of later steps (written after the checkpoint the run
            resumes from) are dropped first, so the file holds one history.
        notice: prints a one-line notice (a dropped cut-off line); default: a warning.
    """

    def __init__(
        self, out_dir: str | os.PathLike[str], enabled: bool = True, tensorboard: bool = False,
        resume_step: int | None = None, notice: Callable[[str], None] | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / METRICS_FILENAME
        self._writer: Any = None
        self._kept: set[tuple[int, str]] = set()  # (step, split) of the records kept from the resumed run
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self._rewrite([])
        elif self.path.is_file():
            records, partial = _parse(self.path)
            if partial is not None:
                (notice or _warn)(f"{self.path}: dropped its last line, cut off by a killed run "
                                  f"({len(partial)} characters: {partial[:40]!r}...)")
            kept = [r for r in records if int(r.get("step", 0)) <= resume_step]
            self._rewrite(kept)
            self._kept = {(int(r.get("step", 0)), str(r.get("split"))) for r in kept}
        if tensorboard:
            try:
                # deferred: tensorboard is optional (only with --tensorboard)
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn(
                    "train.tensorboard=true but the tensorboard package is not installed "
                    "(pip install tensorboard); logging to metrics.jsonl only",
                    stacklevel=2,
                )
            else:
                self._writer = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"), purge_step=resume_step)

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the file by ``records`` atomically: a kill leaves the old file or the new one."""
        tmp = temporary_path(self.path)
        try:
            with open(tmp, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def holds(self, step: int, split: str) -> bool:
        """Whether the resumed run's kept records include one of ``step`` and ``split``."""
        return (step, split) in self._kept

    def log(self, step: int, split: str, values: dict[str, Any]) -> None:
        """Write one record; non-finite floats are stored as strings ("nan", "inf")."""
        if not self.enabled:
            return
        record = {"step": int(step), "split": split, **{k: _jsonable(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if key not in ("step", "split") and isinstance(value, (int, float)):
                    self._writer.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
