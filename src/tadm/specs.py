"""One way to name things on the command line, in YAML and in Python: models, tokenizers, devices, dtypes.

* a **model spec** is a builder name (``"tadm-tiny"``, random weights), a checkpoint directory
  written by ``save_pretrained`` or ``tadm train`` (``OUT/final``), or a Hugging Face Hub id;
  :func:`resolve_model` turns any of them into a model;
* a **tokenizer** is found by :func:`find_tokenizer`: the one given explicitly, else the one saved in
  or beside a checkpoint directory (the directory, its ``tokenizer/``, its parent, the parent's
  ``tokenizer/``);
* a **device** is ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``;
* a **dtype** is ``auto`` (bf16 on CUDA, fp32 on CPU), ``fp32``, ``bf16`` or ``fp16`` (the long
  names ``float32``, ``bfloat16``, ``float16`` are accepted as aliases);
* a **Hugging Face directory or id** is loaded through :func:`load_hf` (or
  :func:`load_hf_tokenizer`), never running custom code from it (``trust_remote_code=False``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEVICE_NAMES",
    "DTYPE_NAMES",
    "DTYPE_SPELLINGS",
    "check_hf_source",
    "check_model_source",
    "find_tokenizer",
    "find_tokenizer_dir",
    "load_hf",
    "load_hf_tokenizer",
    "refuse_custom_code",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
]

DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_NAMES = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
DTYPE_SPELLINGS = ("auto", *_DTYPES)  # every accepted spelling, for validating stored configs


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """A torch device from ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; CUDA must be available when named."""
    if isinstance(spec, torch.device):
        return spec
    name = str(spec).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} requested but CUDA is not available on this machine; use cpu or auto")
        index = int(name[5:]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device(name)
    raise ValueError(f"unknown device {spec!r}; valid: {', '.join(DEVICE_NAMES)}")


def resolve_dtype(name: str | torch.dtype | None = "auto", device: torch.device | str = "cpu") -> torch.dtype:
    """A torch dtype from a name of :data:`DTYPE_NAMES` (or a long alias); ``auto`` depends on ``device``."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPE_NAMES)}") from None


def resolve_model(spec: str | os.PathLike[str], *, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model named by ``spec`` (a builder name, a checkpoint directory or a Hub id), in eval mode on ``device``.

    Raises FileNotFoundError naming the spec when it is none of these.
    """
    from tadm.nn import MODEL_BUILDERS, build_model, load_model
    from tadm.nn.hub import _import_models, _is_repo_id

    _import_models()
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if text in MODEL_BUILDERS and not path.exists():
        model = build_model(text)
    elif path.is_dir():
        model = load_model(path, device=str(device))
    elif path.exists():
        raise FileNotFoundError(f"model {text!r} is a file; pass the checkpoint directory that holds it")
    elif _is_repo_id(text) and "/" in text:
        model = load_model(text, device=str(device))  # a Hub id; raises a clear FileNotFoundError offline
    else:
        raise FileNotFoundError(
            f"model {text!r} is neither a checkpoint directory, a Hub id (owner/name) nor a builder name "
            f"(builders: {', '.join(sorted(MODEL_BUILDERS))})"
        )
    return model.to(device).eval()


def check_model_source(spec: str | os.PathLike[str]) -> None:
    """Raise the FileNotFoundError :func:`resolve_model` would, without loading anything."""
    from tadm.nn import MODEL_BUILDERS
    from tadm.nn.hub import _import_models, _is_repo_id

    _import_models()
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if text in MODEL_BUILDERS or path.is_dir() or (_is_repo_id(text) and "/" in text and not path.exists()):
        return
    if path.exists():
        raise FileNotFoundError(f"model {text!r} is a file; pass the checkpoint directory that holds it")
    raise FileNotFoundError(
        f"model {text!r} is neither a checkpoint directory, a Hub id (owner/name) nor a builder name "
        f"(builders: {', '.join(sorted(MODEL_BUILDERS))})"
    )


def find_tokenizer_dir(model_dir: str | os.PathLike[str]) -> Path | None:
    """The saved tokenizer in or beside a checkpoint directory, or None."""
    from tadm.training.tokenization import META_FILENAME

    path = Path(model_dir).expanduser()
    if not path.is_dir():
        return None
    for candidate in (path, path / "tokenizer", path.parent, path.parent / "tokenizer"):
        if (candidate / META_FILENAME).is_file():
            return candidate
    return None


def find_tokenizer(model: str | os.PathLike[str] | None, tokenizer: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer for ``model``: ``tokenizer`` when given (a directory or ``gpt2``), else the model's saved one.

    Raises FileNotFoundError when neither is there.
    """
    from tadm.training.tokenization import load_tokenizer

    if tokenizer is not None:
        path = Path(os.fspath(tokenizer)).expanduser()
        if not path.exists() and os.fspath(tokenizer) != "gpt2":
            raise FileNotFoundError(f"tokenizer {os.fspath(tokenizer)!r}: no such directory")
        return load_tokenizer(tokenizer)
    found = find_tokenizer_dir(model) if model is not None else None
    if found is None:
        raise FileNotFoundError(f"no tokenizer found for model {os.fspath(model) if model else None!r}: pass its "
                                "tokenizer directory (--tokenizer DIR)")
    return load_tokenizer(found)


# ------------------------------------------------------------------------- Hugging Face directories
NO_CUSTOM_CODE = "tadm never runs code shipped with a model (trust_remote_code=False)"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def refuse_custom_code(path: str | os.PathLike[str], what: str = "model") -> None:
    """Raise a one-line ValueError when the local Hugging Face directory ``path`` needs custom code to load.

    It does when its ``config.json`` maps classes to its own code (``auto_map``) for a model type
    that ``transformers`` does not know. An unreadable ``config.json`` is a ValueError too.
    """
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{what} {os.fspath(path)!r}: {config_file} is not valid JSON ({_first_line(err)})") from None
    if not isinstance(raw, dict) or not raw.get("auto_map"):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if raw.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"{what} {os.fspath(path)!r} needs custom code (auto_map for model_type "
                         f"{raw.get('model_type')!r} in {config_file}); {NO_CUSTOM_CODE}")


def load_hf(loader: Callable[..., Any], source: str | os.PathLike[str], what: str = "model", **kwargs: Any) -> Any:
    """``loader(source, trust_remote_code=False, **kwargs)``: a Hugging Face ``from_pretrained`` that runs no custom code.

    A directory or Hub repository that needs custom code, or whose files ``transformers`` rejects,
    is a one-line ValueError naming ``what`` and ``source``; OSError (missing files, no network)
    passes through for the caller to word.
    """
    text = os.fspath(source)
    local = Path(text).expanduser()
    if local.is_dir():
        refuse_custom_code(local, what)
    try:
        return loader(str(local) if local.is_dir() else text, trust_remote_code=False, **kwargs)
    except ValueError as err:
        if "trust_remote_code" in str(err) or "custom code" in str(err):
            raise ValueError(f"{what} {text!r} needs custom code to load; {NO_CUSTOM_CODE}") from None
        raise ValueError(f"could not load {what} {text!r}: {_first_line(err)}") from None


def load_hf_tokenizer(source: str | os.PathLike[str], what: str = "tokenizer", **kwargs: Any) -> Any:
    """``transformers.AutoTokenizer`` from a directory or Hub id without custom code; errors are one line.

    Raises FileNotFoundError naming ``source`` when it cannot be found or read, ValueError when it
    needs custom code (see :func:`load_hf`).
    """
    from transformers import AutoTokenizer

    text = os.fspath(source)
    check_hf_source(text, what, files=("tokenizer_config.json", "tokenizer.json", "config.json"))
    try:
        return load_hf(AutoTokenizer.from_pretrained, text, what, **kwargs)
    except OSError as err:
        raise FileNotFoundError(f"could not load {what} {text!r}: {_first_line(err)}") from None


def check_hf_source(
    source: str | os.PathLike[str], what: str = "model", files: tuple[str, ...] = ("config.json",)
) -> None:
    """Raise a one-line FileNotFoundError naming ``source`` unless it is a directory holding one of
    ``files``, or could be a Hub id (``name`` or ``owner/name``, not path-like)."""
    from tadm.nn.hub import _is_repo_id

    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in files):
            raise FileNotFoundError(f"{what} {text!r} is not a saved Hugging Face directory (no {' or '.join(files)})")
    elif path.exists():
        raise FileNotFoundError(f"{what} {text!r} is a file, not a model directory")
    elif not _is_repo_id(text):
        raise FileNotFoundError(f"{what} {text!r} does not exist")
