"""One way to name models and tokenizers on the command line, in YAML and in Python.

* a **model spec** is a builder name (``"tadm-tiny"``, random weights), a checkpoint directory
  written by ``save_pretrained`` or ``tadm train`` (``OUT/final``), or a Hugging Face Hub id;
  :func:`resolve_model` turns any of them into a model;
* a **tokenizer** is found by :func:`find_tokenizer`: the one given explicitly, else the one saved in
  or beside a checkpoint directory (the directory, its ``tokenizer/``, its parent, the parent's
  ``tokenizer/``), or with a model on the Hub.

Devices and dtypes are named in :mod:`tadm.devices`, Hugging Face directories are loaded
without custom code by :mod:`tadm.hf`; :func:`resolve_device`, :func:`resolve_dtype` and
:func:`load_hf_tokenizer` are re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tadm.devices import resolve_device, resolve_dtype
from tadm.hf import is_repo_id, load_hf_tokenizer, local_parent
from tadm.nn import MODEL_BUILDERS, build_model, load_model
from tadm.nn.hub import saved_tokenizer_dir
from tadm.training.tokenization import META_FILENAME, check_vocab_compatible, load_tokenizer

__all__ = ["check_model_source", "find_tokenizer", "find_tokenizer_dir", "load_hf_tokenizer",
           "load_model_and_tokenizer", "resolve_device", "resolve_dtype", "resolve_model"]


def check_model_source(spec: str | os.PathLike[str]) -> Path | str | None:
    """Raise the FileNotFoundError :func:`resolve_model` would, without loading anything.

    Returns what ``spec`` names: None for a builder name, the checkpoint directory, or the Hub id.
    """
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if text in MODEL_BUILDERS and not path.exists():
        return None
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"model {text!r} is a file; pass the checkpoint directory that holds it")
    if is_repo_id(text) and "/" in text:
        return text
    if local_parent(text) is not None:
        raise FileNotFoundError(f"model directory {text!r} does not exist (its folder {local_parent(text)!r} does, so "
                                "this is a local path, not a Hub id)")
    raise FileNotFoundError(
        f"model {text!r} is neither a checkpoint directory, a Hub id (owner/name) nor a builder name "
        f"(builders: {', '.join(sorted(MODEL_BUILDERS))})"
    )


def resolve_model(spec: str | os.PathLike[str], *, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model named by ``spec`` (a builder name, a checkpoint directory or a Hub id), in eval mode on ``device``.

    Raises FileNotFoundError naming the spec when it is none of these.
    """
    source = check_model_source(spec)
    # a builder name builds; a directory or Hub id loads (a Hub id raises a clear FileNotFoundError offline)
    model = build_model(os.fspath(spec)) if source is None else load_model(source, device=str(device))
    return model.to(device).eval()


def find_tokenizer_dir(model_dir: str | os.PathLike[str]) -> Path | None:
    """The saved tokenizer in or beside a checkpoint directory, or None (nothing is looked up on the Hub)."""
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        return None
    for candidate in (path, path / "tokenizer", path.parent, path.parent / "tokenizer"):
        if (candidate / META_FILENAME).is_file():
            return candidate
    return None


def find_tokenizer(model: str | os.PathLike[str] | None, tokenizer: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer for ``model``: ``tokenizer`` when given (a directory or ``gpt2``), else the model's saved one
    (in or beside its checkpoint directory, or in its Hub repository).

    Raises FileNotFoundError when neither is there.
    """
    if tokenizer is not None:
        name = os.fspath(tokenizer)
        if not Path(name).expanduser().exists() and name != "gpt2":
            raise FileNotFoundError(f"tokenizer {name!r}: no such directory")
        return load_tokenizer(tokenizer)
    found = find_tokenizer_dir(model) if model is not None else None
    text = os.fspath(model) if model is not None else ""
    if found is None and is_repo_id(text) and "/" in text and not Path(text).expanduser().exists():
        found = saved_tokenizer_dir(text)  # saved with the model on the Hub (save_pretrained / push_to_hub)
    if found is None:
        raise FileNotFoundError(f"no tokenizer found for model {os.fspath(model) if model else None!r}: pass its "
                                "tokenizer directory (--tokenizer DIR)")
    return load_tokenizer(found)


def load_model_and_tokenizer(
    spec: str | os.PathLike[str], tokenizer: str | os.PathLike[str] | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, Any]:
    """The model ``spec`` names (:func:`resolve_model`) and its tokenizer (:func:`find_tokenizer`), vocabularies checked.

    A masked model's vocabulary must hold the tokenizer's tokens and mask id; the AR baseline has no
    mask token, so its vocabulary may be the tokenizer's without the mask. A builder name (random weights)
    is built with the tokenizer's vocabulary.
    """
    if check_model_source(spec) is None:  # a builder name: random weights, sized to the tokenizer given
        tok = find_tokenizer(spec, tokenizer)
        model = build_model(os.fspath(spec), vocab_size=tok.vocab_size).to(device).eval()
    else:
        model = resolve_model(spec, device=device)
        tok = find_tokenizer(spec, tokenizer)
    if model.mask_token_id is None:
        if model.vocab_size not in (tok.vocab_size, tok.vocab_size - 1):
            raise ValueError(f"vocabulary mismatch: the tokenizer has {tok.vocab_size} tokens but the AR model "
                             f"has {model.vocab_size}")
    else:
        check_vocab_compatible(tok, model.vocab_size, model.mask_token_id)
    return model, tok
