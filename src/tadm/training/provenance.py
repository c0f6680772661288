"""What a BPE tokenizer was trained on: ``tokenizer_provenance.json`` beside its ``tokenizer.json``.

A tokenizer trained by tadm (``tadm tokenizer train``, or a run's ``out_dir/tokenizer``) records
its corpus: the source's canonical name and its files (sizes, modification times, see
:func:`tadm.training.data.source_identity`), a SHA-256 of the training text, the text field, the
requested vocabulary size and the merge threshold. A run that finds a tokenizer in its
``out_dir`` reuses it only if that record fits its config (:func:`check_provenance`), which lets a
moved or touched corpus with the same text pass.
"""

from __future__ import annotations

import collections
import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tadm.config import ConfigError
from tadm.records import read_json, write_json
from tadm.training.data import load_texts, source_identity
from tadm.training.tokenization import META_FILENAME, TextTokenizer, train_bpe_tokenizer

__all__ = ["PROVENANCE_FILENAME", "TokenizerMismatchError", "check_provenance", "read_provenance",
           "train_recorded_tokenizer"]

PROVENANCE_FILENAME = "tokenizer_provenance.json"
_FORMAT = 1


class TokenizerMismatchError(ConfigError):
    """A saved tokenizer was trained on another corpus or vocabulary size than the run asks for."""


class _TextDigest:
    """SHA-256 over documents (each prefixed by its byte length), updated while they stream past."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.documents = 0

    def over(self, texts: Iterable[str]) -> Iterator[str]:
        for text in texts:
            data = text.encode("utf-8", "surrogatepass")
            self._sha.update(len(data).to_bytes(8, "little"))
            self._sha.update(data)
            self.documents += 1
            yield text

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _corpus(source: str | os.PathLike[str], text_field: str) -> dict[str, Any]:
    name, files = source_identity(source)
    return {"source": name, "source_files": files, "text_field": text_field}


def read_provenance(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record saved beside a tokenizer, or None when there is none (or it is unreadable)."""
    record = read_json(Path(directory) / PROVENANCE_FILENAME)
    return record if isinstance(record, dict) and record.get("format") == _FORMAT else None


def train_recorded_tokenizer(
    source: str | os.PathLike[str],
    vocab_size: int,
    directory: str | os.PathLike[str],
    *,
    text_field: str = "text",
    min_frequency: int = 2,
) -> TextTokenizer:
    """Train a byte-level BPE on ``source`` and save it into ``directory`` with its provenance record.

    The record is written before the tokenizer, whose ``tadm_tokenizer.json`` comes last, so an
    interrupted save never leaves a loadable tokenizer with another tokenizer's record.
    """
    record = {"format": _FORMAT, **_corpus(source, text_field), "vocab_size": vocab_size,
              "min_frequency": min_frequency}
    digest = _TextDigest()
    tok = train_bpe_tokenizer(digest.over(load_texts(source, text_field=text_field)), vocab_size,
                              min_frequency=min_frequency)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / META_FILENAME).unlink(missing_ok=True)
    record |= {"text_sha256": digest.hexdigest(), "num_documents": digest.documents}
    write_json(directory / PROVENANCE_FILENAME, record)
    tok.save(directory)
    return tok


def check_provenance(
    directory: str | os.PathLike[str],
    source: str | os.PathLike[str],
    vocab_size: int,
    *,
    text_field: str = "text",
    advice: str = "",
    missing_ok: bool = False,
) -> None:
    """Raise :class:`TokenizerMismatchError` unless the tokenizer in ``directory`` was trained on ``source``
    with ``vocab_size`` (and ``text_field``); ``advice`` (how to proceed) ends the message.

    A missing record is an error unless ``missing_ok``. When only the source's name or files
    differ, the current text is hashed: the same text passes, and the record is refreshed.
    """
    directory = Path(directory)
    tail = f"; {advice}" if advice else ""
    saved = read_provenance(directory)
    if saved is None:
        if missing_ok:
            return
        raise TokenizerMismatchError(f"{directory} holds a tokenizer with no record of what it was trained on "
                                     f"({PROVENANCE_FILENAME}){tail}")
    now = _corpus(source, text_field) | {"vocab_size": vocab_size}
    differ = [k for k in ("vocab_size", "text_field", "source") if saved.get(k) != now[k]]
    hub = now["source"].startswith("hf:")  # a hub dataset is not hashed again (it would be downloaded)
    if [k for k in differ if k != "source"] or (differ and hub):
        details = ", ".join(f"{k} {saved.get(k)!r} (now {now[k]!r})" for k in differ)
        raise TokenizerMismatchError(f"the tokenizer in {directory} was trained with {details}{tail}")
    if not differ and saved.get("source_files") == now["source_files"]:
        return
    digest = _TextDigest()
    collections.deque(digest.over(load_texts(source, text_field=text_field)), maxlen=0)  # hash every document
    if digest.hexdigest() != saved.get("text_sha256"):
        what = f"on {saved.get('source')!r}" if differ else f"on an earlier version of {now['source']!r}"
        raise TokenizerMismatchError(f"the tokenizer in {directory} was trained {what}, not on the text of "
                                     f"{str(source)!r} now{tail}")
    write_json(directory / PROVENANCE_FILENAME, saved | {"source": now["source"], "source_files": now["source_files"]})
