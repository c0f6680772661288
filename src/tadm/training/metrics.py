"""Training metrics: one JSON object per line in ``out_dir/metrics.jsonl``, optionally TensorBoard too.

Each record has ``"step"`` (optimizer steps done), ``"split"`` (``"train"`` or ``"val"``) and
numbers, e.g. ``{"step": 100, "split": "train", "loss": 5.31, "lr": 3e-4, "tokens_per_s": 812.5}``.
Floats are written with ``repr`` precision, so a value read back equals the logged one exactly.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILENAME", "MetricsLogger", "read_metrics"]

METRICS_FILENAME = "metrics.jsonl"


def read_metrics(path: str | os.PathLike[str], split: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (only those of ``split`` when given), in file order."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if split is None or record.get("split") == split:
                records.append(record)
    return records


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


class MetricsLogger:
    """Appends records to ``out_dir/metrics.jsonl`` (and TensorBoard scalars); a no-op when disabled.

    Args:
        out_dir: run directory.
        enabled: False on every rank but 0.
        tensorboard: also write ``out_dir/tensorboard`` event files; warns and skips when the
            ``tensorboard`` package is missing.
        resume_step: when resuming, records of later steps (written after the checkpoint the run
            resumes from) are dropped first, so the file holds one history.
    """

    def __init__(
        self, out_dir: str | os.PathLike[str], enabled: bool = True, tensorboard: bool = False,
        resume_step: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / METRICS_FILENAME
        self._writer: Any = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.is_file():
            kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn(
                    "train.tensorboard=true but the tensorboard package is not installed "
                    "(pip install tensorboard); logging to metrics.jsonl only",
                    stacklevel=2,
                )
            else:
                self._writer = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"), purge_step=resume_step)

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
