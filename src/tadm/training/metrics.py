"""Training metrics: one JSON object per line in ``out_dir/metrics.jsonl``, optionally TensorBoard and W&B too.

Each record has ``"step"`` (optimizer steps done), ``"split"`` (``"train"`` or ``"val"``) and
numbers, e.g. ``{"step": 100, "split": "train", "loss": 5.31, "lr": 3e-4, "tokens_per_s": 812.5}``.
Floats are written with ``repr`` precision, so a value read back equals the logged one exactly.
On resume the file is rewritten atomically (temporary file, fsync, ``os.replace``) without the
records after the checkpoint; a last line cut off by a killed run is dropped with a notice.

``metrics.jsonl`` is the source of truth and is always written; the other loggers of
:data:`tadm.config.LOGGERS` mirror its numbers (pretraining and post-training share this class).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from tadm.config import ConfigError, check_loggers
from tadm.records import replace_atomically

__all__ = ["METRICS_FILENAME", "TENSORBOARD_DIRNAME", "MetricsLogger", "read_metrics"]

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"


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


def _not_installed(package: str) -> None:
    install = "'tadm[tracking]'" if package == "tensorboard" else package
    warnings.warn(f"train.loggers names {package} but the {package} package is not installed (pip install "
                  f"{install}); logging to metrics.jsonl only", stacklevel=4)


def _check_tensorboard_dir(log_dir: Path) -> None:
    """A one-line ConfigError when TensorBoard could not write into ``log_dir`` (created here if missing).

    Checked before the writer starts: its thread would otherwise fail with a traceback of its own,
    printed after the run's error.
    """
    hint = "make it writable, or leave tensorboard out of train.loggers"
    if log_dir.exists() and not log_dir.is_dir():
        raise ConfigError(f"TensorBoard's folder {str(log_dir)!r} is a file, not a folder; move it, or leave "
                          "tensorboard out of train.loggers")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"TensorBoard's folder {str(log_dir)!r} cannot be created ({err.strerror or err}); "
                          f"{hint}") from None
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"TensorBoard's folder {str(log_dir)!r} is not writable (read-only); {hint}")


def _tensorboard_writer(log_dir: Path, purge_step: int) -> Any:
    """A TensorBoard writer on ``log_dir`` hiding older events of steps >= ``purge_step``; None without the package.

    """
    try:
        # deferred: tensorboard is optional (only with "tensorboard" in train.loggers)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        _not_installed("tensorboard")
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _wandb_run(out_dir: Path, project: str, config: dict[str, Any] | None) -> Any:
    """A Weights & Biases run named after ``out_dir`` (its files in ``out_dir/wandb``, mode from ``WANDB_MODE``);
    None without the wandb package."""
    try:
        import wandb  # deferred: optional extra, only with "wandb" in train.loggers
    except ImportError:
        _not_installed("wandb")
        return None
    # wandb writes under dir/wandb; mode None lets wandb read WANDB_MODE (online unless set, e.g. offline)
    return wandb.init(project=project, dir=str(out_dir), mode=os.environ.get("WANDB_MODE"), config=config,
                      name=out_dir.resolve().name)


class MetricsLogger:
    """Appends records to ``out_dir/metrics.jsonl`` and mirrors them to the other ``loggers``; a no-op when disabled.

    Args:
        out_dir: run directory.
        enabled: False on every rank but 0.
        loggers: names from :data:`tadm.config.LOGGERS`, as ``train.loggers`` of
            :class:`tadm.config.TrainSection` describes them (TensorBoard scalars are ``SPLIT/KEY``).
            A missing package warns and that logger is skipped.
        resume_step: when resuming, records of later steps (written after the checkpoint the run
            resumes from) are dropped first, so the file holds one history; TensorBoard hides its
            events of those steps too (``purge_step``), and a fresh run (None) hides all earlier ones.
            A resumed W&B run is a new W&B run whose steps continue after ``resume_step``.
        notice: prints a one-line notice (a dropped cut-off line); default: a warning.
        wandb_project: the W&B project.
        config: the run's resolved config, recorded by W&B.

    Raises:
        ConfigError: a name in ``loggers`` that is not one of :data:`tadm.config.LOGGERS`; a TensorBoard
            folder (``out_dir/tensorboard``) that is a file or cannot be written.
    """

    def __init__(
        self, out_dir: str | os.PathLike[str], enabled: bool = True, loggers: Sequence[str] = ("jsonl",),
        resume_step: int | None = None, notice: Callable[[str], None] | None = None, *,
        wandb_project: str = "tadm", config: dict[str, Any] | None = None,
    ) -> None:
        check_loggers("loggers", loggers)
        self.enabled = enabled
        self.path = Path(out_dir) / METRICS_FILENAME
        self._writer: Any = None  # TensorBoard SummaryWriter
        self._wandb: Any = None  # W&B run
        self._kept: set[tuple[int, str]] = set()  # (step, split) of the records kept from the resumed run
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in loggers:  # before anything is written, and before a writer thread could fail
            _check_tensorboard_dir(self.path.parent / TENSORBOARD_DIRNAME)
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
        if "tensorboard" in loggers:
            # purge_step: events of steps after the checkpoint (or, afresh, of any earlier run) are hidden
            purge_step = 0 if resume_step is None else resume_step + 1
            self._writer = _tensorboard_writer(self.path.parent / TENSORBOARD_DIRNAME, purge_step)
        if "wandb" in loggers:
            self._wandb = _wandb_run(self.path.parent, wandb_project, config)

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the file by ``records`` atomically: a kill leaves the old file or the new one."""
        text = "".join(json.dumps(r) + "\n" for r in records)
        replace_atomically(self.path, lambda f: f.write(text.encode()))

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
        scalars = {f"{split}/{key}": value for key, value in record.items()
                   if key not in ("step", "split") and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    def close(self) -> None:
        """Flush and close the TensorBoard writer and finish the W&B run (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
