"""Checkpoints: the exported model directory and the resumable training state.

Two kinds of files are written into a run's ``out_dir``:

* a **model directory** (``final/``, optionally ``best/``): ``save_pretrained`` of the EMA model
  (``config.json`` + ``model.safetensors``), the tokenizer (``tokenizer.json`` +
  ``tadm_tokenizer.json``) and the resolved experiment config (``train_config.yaml``), so that
  ``tadm sample --model out_dir/final`` works as is. It is assembled in a temporary directory and
  moved into place, so a crash never leaves a half-written model behind.
* the **training state** (``training_state.pt``): raw weights, optimizer, learning-rate schedule,
  EMA weights, every rank's RNG states, the data sampler and the step. It holds only tensors and
  plain Python values, is loaded with ``torch.load(weights_only=True)``, and is written atomically
  (temporary file, fsync, ``os.replace``).

Temporaries are named after the writing process (``.training_state.pt.tmp-<pid>``,
``.final.tmp-<pid>``); after every successful save those of dead processes are removed
(:func:`tadm.training.rundir.remove_stale_temporaries`).
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tadm.config import ExperimentConfig, save_config
from tadm.records import fsync_dir, replace_atomically, replace_directory, temporary_path
from tadm.training.rundir import remove_stale_temporaries

__all__ = ["CONFIG_FILENAME", "STATE_FILENAME", "STATE_FORMAT", "CorruptStateError", "UnsafeStateError",
           "capture_rng_state", "load_training_state", "restore_rng_state", "save_model_dir", "save_training_state"]

STATE_FILENAME = "training_state.pt"
CONFIG_FILENAME = "train_config.yaml"
STATE_FORMAT = 1


class UnsafeStateError(ValueError, pickle.UnpicklingError):
    """A training state that holds objects other than tensors and plain values; nothing of it was run."""


class CorruptStateError(ValueError):
    """A training state file that is truncated or otherwise unreadable."""


def save_training_state(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save(state)`` to ``path`` atomically: a temporary file beside it, fsync, ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, lambda f: torch.save(state, f))
    fsync_dir(path.parent)
    remove_stale_temporaries(path.parent)
    return path


def load_training_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a state written by :func:`save_training_state` (``weights_only=True``, tensors on CPU).

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsafeStateError: the file holds other objects (a pickle that would import or call
            something); it is refused before any of it runs.
        CorruptStateError: the file is truncated or corrupt (not a complete ``torch.save`` archive).
        ValueError: not a training state of format :data:`STATE_FORMAT`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no training state at {path}")
    try:
        if not zipfile.is_zipfile(path):
            raise RuntimeError(f"not a complete torch.save archive, {path.stat().st_size} bytes")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError) as err:
        why = str(err).split(". ")[0].splitlines()[0] if str(err) else type(err).__name__
        raise CorruptStateError(
            f"training state {path} is truncated or corrupt ({why}); restore a good copy, or start afresh "
            "(train.overwrite=true)"
        ) from None
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f"it would import or call {found.group(1)!r}" if found else "it holds objects other than tensors"
        raise UnsafeStateError(
            f"refusing to load {path}: {what}; a training state holds only tensors and plain values and is "
            "read with weights_only=True (a file that needs more may run code)"
        ) from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"{path} is not a tadm training state of format {STATE_FORMAT}")
    return state


# ------------------------------------------------------------------------------------ RNG states
def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), numpy and Python RNG states as tensors and plain values."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "key": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {
            "version": int(py_version),
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np_state = state["numpy"]
    key = np_state["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"]))
    py_state = state["python"]
    random.setstate((py_state["version"], tuple(int(v) for v in py_state["internal"].tolist()), py_state["gauss_next"]))


# ---------------------------------------------------------------------------------- model dirs
def save_model_dir(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any | None = None,
    config: ExperimentConfig | None = None,
) -> Path:
    """Write ``model.save_pretrained`` + tokenizer + ``train_config.yaml`` into ``directory``, replacing it.

    The files are written into a temporary sibling directory that is then renamed into place.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(directory)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        model.save_pretrained(tmp)  # type: ignore[operator]
        if tokenizer is not None:
            tokenizer.save(tmp)
        if config is not None:
            save_config(config, tmp / CONFIG_FILENAME)
        replace_directory(tmp, directory, fsync=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_stale_temporaries(directory.parent)
    return directory
