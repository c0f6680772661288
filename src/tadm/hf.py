"""Hugging Face directories and Hub ids, loaded without running code shipped with them.

A directory or id is loaded through :func:`load_hf` (or :func:`load_hf_tokenizer`) with
``trust_remote_code=False``; a directory that needs custom code is refused in one line
(:func:`refuse_custom_code`), and a missing source is named (:func:`check_hf_source`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from huggingface_hub import constants
from huggingface_hub.utils import validate_repo_id

__all__ = ["NO_CUSTOM_CODE", "TOKENIZER_FILES", "check_hf_source", "first_line", "hub_reachable",
           "is_connection_error", "is_repo_id", "load_hf", "local_parent", "load_hf_tokenizer", "refuse_custom_code"]

NO_CUSTOM_CODE = "tadm never runs code shipped with a model (trust_remote_code=False)"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A local tokenizer directory holds at least one of these (fast, saved, SentencePiece, BPE or WordPiece vocabulary)."""
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """Can the Hugging Face Hub be reached? False with ``HF_HUB_OFFLINE`` set, or when the endpoint's host
    (``HF_ENDPOINT``, by default huggingface.co) refuses a connection within ``timeout`` seconds; True behind
    a proxy, which is not probed. One probe per process, so that a missing network costs seconds once
    instead of the Hub client's retries (about 25 s) at every request."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return True
    endpoint = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", endpoint.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def is_connection_error(err: BaseException) -> bool:
    """Whether ``err`` means the Hub could not be reached (no network, a refused connection, a timeout, a proxy
    error, ``HF_HUB_OFFLINE``), as opposed to an answer from the Hub (401, 404, ...)."""
    if isinstance(err, (ConnectionError, TimeoutError)):  # huggingface_hub's OfflineModeIsEnabled among them
        return True
    # huggingface_hub's HTTP client (httpx, or its fork httpx2) raises subclasses of its TransportError for these
    return any(cls.__name__ == "TransportError" for cls in type(err).__mro__)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
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
        raise ValueError(f"{what} {os.fspath(path)!r}: {config_file} is not valid JSON ({first_line(err)})") from None
    if not isinstance(raw, dict) or not raw.get("auto_map"):
        return
    # transformers is optional (the eval, posttrain and tasks extras): imported when a directory is checked
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
        raise ValueError(f"could not load {what} {text!r}: {first_line(err)}") from None


def load_hf_tokenizer(source: str | os.PathLike[str], what: str = "tokenizer", **kwargs: Any) -> Any:
    """``transformers.AutoTokenizer`` from a directory or Hub id without custom code; errors are one line.

    Raises FileNotFoundError naming ``source`` when it cannot be found or read, or when it is a
    local directory without a tokenizer file (:data:`TOKENIZER_FILES`): from a model directory
    holding only ``config.json``, ``transformers`` would build an empty tokenizer of its special
    tokens, which encodes every text to nothing. ValueError when it needs custom code (see :func:`load_hf`).
    """
    from transformers import AutoTokenizer  # optional dependency (the eval, posttrain and tasks extras)

    text = os.fspath(source)
    local = Path(text).expanduser()
    if local.is_dir() and (local / "config.json").is_file() and not any(
            (local / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{what} {text!r} is a model directory without a tokenizer (no "
                                f"{', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]})")
    check_hf_source(text, what, files=TOKENIZER_FILES)
    config_logger = logging.getLogger("transformers.configuration_utils")
    config_logger.addFilter(_no_model_type_warning)
    try:
        return load_hf(AutoTokenizer.from_pretrained, text, what, **kwargs)
    except OSError as err:
        raise FileNotFoundError(f"could not load {what} {text!r}: {first_line(err)}") from None
    finally:
        config_logger.removeFilter(_no_model_type_warning)


def _no_model_type_warning(record: logging.LogRecord) -> bool:
    """Drop transformers' "You are using a model of type X to instantiate a model of type Y": a tokenizer load
    reads config.json only to choose a tokenizer class, and a tadm checkpoint's model type is not one of
    transformers' (that warning is about instantiating models)."""
    return not record.getMessage().startswith("You are using a model of type")


def check_hf_source(
    source: str | os.PathLike[str], what: str = "model", files: tuple[str, ...] = ("config.json",)
) -> None:
    """Raise a one-line FileNotFoundError naming ``source`` unless it is a directory holding one of
    ``files``, or could be a Hub id (``name`` or ``owner/name``, not path-like)."""
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in files):
            raise FileNotFoundError(f"{what} {text!r} is not a saved Hugging Face directory (no {' or '.join(files)})")
    elif path.exists():
        raise FileNotFoundError(f"{what} {text!r} is a file, not a model directory")
    elif not is_repo_id(text):
        raise FileNotFoundError(f"{what} {text!r} does not exist")


def local_parent(name: str) -> str | None:
    """The folder of ``owner/name`` when ``owner`` is a directory here (``runs/typo`` beside ``runs/``): such a
    name is a local path, even though it has the form of a Hub id; None otherwise."""
    parts = name.split("/")
    return parts[0] if len(parts) == 2 and parts[0] and Path(parts[0]).expanduser().is_dir() else None


def is_repo_id(name: str) -> bool:
    """Whether ``name`` could be a Hub repository id (``name`` or ``owner/name``), not a path: it does not start
    like one, and its owner is no local directory (:func:`local_parent`)."""
    if name.startswith((".", "/", "~")) or "\\" in name or local_parent(name) is not None:
        return False
    try:
        validate_repo_id(name)
    except ValueError:  # HFValidationError subclasses ValueError
        return False
    return True
