"""Pretraining data: read a corpus, tokenize and pack it once into memory-mapped blocks, stream them.

Three steps, each usable alone:

1. :func:`load_texts` turns a *source* (a file, a directory, the bundled corpus ``"brown"`` or a
   Hugging Face dataset such as the paper's ``"openwebtext"``) into an iterator of documents.
2. :func:`build_packed_dataset` tokenizes the documents, holds out a seeded fraction of them for
   validation, and packs each split MDLM-style ("wrap"): every document gets an EOS appended,
   the documents are concatenated into one token stream, and the stream is cut into pieces of
   ``seq_len - 2`` tokens, each stored as the block ``[BOS] + piece + [EOS]`` of length
   ``seq_len``. Blocks therefore start and end mid-document; the tail of the stream shorter than
   one piece is dropped. The blocks go to a ``numpy.memmap`` (``uint16`` when every id fits,
   else ``uint32``) with a JSON sidecar, cached by tokenizer, source and ``seq_len``.
3. :class:`PackedTokens` serves the blocks as a torch ``Dataset`` and :class:`BlockSampler`
   draws deterministic, resumable, rank-sharded global batches of block indices.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import re
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub import constants
from torch.utils.data import Dataset, Sampler
from tqdm.auto import tqdm

from tadm.corpora import BUNDLED_CORPORA, bundled_corpus_path
from tadm.hf import hub_reachable
from tadm.records import write_json
from tadm.training.rundir import remove_stale_temporaries
from tadm.training.tokenization import PackingTokenizer

__all__ = ["TEXT_SUFFIXES", "BlockSampler", "PackedSplits", "PackedTokens", "build_packed_dataset", "hashed_seed",
           "load_texts", "source_identity", "token_dtype"]

# File types a local source may hold; ".gz" means gzip-compressed. Parquet and Arrow files are what the
# Hugging Face dataset loader downloads and caches (e.g. OpenWebText's train-000NN-of-000MM.parquet shards).
TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet", ".arrow")
_PATHLIKE_SUFFIXES = TEXT_SUFFIXES + (".json", ".gz", ".csv")
# Files that only `datasets.Dataset.save_to_disk` (state.json) / `DatasetDict.save_to_disk` (dataset_dict.json)
# write: a folder with one is read with `datasets.load_from_disk`. dataset_info.json alone is no marker, since
# the `datasets` cache folder of `load_dataset` (dataset_info.json + *.arrow) holds it too.
_HF_DISK_MARKERS = ("dataset_dict.json", "state.json")
# Split names of the Hub's shard files (train-00000-of-00004.parquet, validation-..., test/...): a folder holding
# train files and files of another split is read for its train files only.
_SPLIT_NAMES = ("train", "validation", "valid", "val", "dev", "test")
_SPLIT_FILE = re.compile(r"(train|validation|valid|val|dev|test)(?:[-_.]|$)")
# The files whose sizes and times stamp a save_to_disk folder (source_identity).
_HF_DISK_FILES = ("dataset_info.json", *_HF_DISK_MARKERS)
_PACK_FORMAT = 1
_CHUNK_TOKENS = 1 << 22  # tokens copied per step while packing: bounds memory, not results


# ============================================================================ reading documents
def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(TEXT_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def _looks_like_path(spec: str) -> bool:
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(_PATHLIKE_SUFFIXES):
        return True
    head = spec.split(os.sep, 1)[0]
    return os.sep in spec and Path(head).is_dir()


def _open_bytes(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


@contextmanager
def _gzip_errors(path: Path) -> Iterator[None]:
    """A truncated or corrupt ``.gz`` file (EOFError, BadGzipFile, zlib.error) as a ValueError naming it."""
    try:
        yield
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise ValueError(f"{path}: truncated or corrupt gzip file ({err}); re-download or re-compress it") from None


def _decode(data: bytes, path: Path, lineno: int = 1) -> str:
    """``data`` as UTF-8, else a ValueError naming the file and line (``lineno`` is the line ``data`` starts on)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = lineno + data.count(b"\n", 0, err.start)
        raise ValueError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{data[err.start]:02x}); save the file as UTF-8"
        ) from None


def _read_txt(path: Path, doc_sep: str | None) -> Iterator[str]:
    with _gzip_errors(path), _open_bytes(path) as f:
        text = _decode(f.read(), path)
    yield from ([text] if doc_sep is None else text.split(doc_sep))


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with _gzip_errors(path), _open_bytes(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from err
            if not isinstance(row, dict) or text_field not in row:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path}:{lineno}: no field {text_field!r} (has {keys})")
            text = row[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not str")
            yield text


def _read_table(path: Path, text_field: str) -> Iterator[str]:
    """The ``text_field`` column of a Parquet file or an Arrow file (IPC stream or file, as ``datasets``
    writes its cache), read batch by batch with pyarrow (installed with ``datasets``)."""
    try:
        # deferred: pyarrow is optional (only for Parquet and Arrow corpora)
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"{path}: reading Parquet/Arrow files needs pyarrow (pip install datasets)") from err
    try:
        if path.name.lower().endswith(".parquet"):
            table = pq.ParquetFile(path)
            names = table.schema_arrow.names
            batches: Iterable[Any] = table.iter_batches(columns=[text_field]) if text_field in names else ()
        else:
            with pa.memory_map(str(path)) as source:
                try:
                    reader = pa.ipc.open_stream(source)
                except pa.ArrowInvalid:
                    reader = pa.ipc.open_file(source)
                table = reader.read_all()
            names = table.schema.names
            batches = table.select([text_field]).to_batches() if text_field in names else ()
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"{path}: not a readable {path.suffix[1:]} file ({err})") from None
    if text_field not in names:
        raise ValueError(f"{path}: no column {text_field!r} (has {names}); set data.text_field")
    for batch in batches:
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path}: column {text_field!r} holds {type(text).__name__}, not str")
            yield text or ""


def _read_file(path: Path, text_field: str, doc_sep: str | None) -> Iterator[str]:
    suffix = _suffix(path)
    if suffix in (".jsonl", ".jsonl.gz"):
        return _read_jsonl(path, text_field)
    if suffix in (".parquet", ".arrow"):
        return _read_table(path, text_field)
    return _read_txt(path, doc_sep)


def _saved_by_datasets(path: Path) -> bool:
    """Whether the folder ``path`` was written by ``save_to_disk`` (see :data:`_HF_DISK_MARKERS`)."""
    return any((path / m).is_file() for m in _HF_DISK_MARKERS)


def _all_dir_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*") if p.is_file() and _suffix(p) is not None]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _split_of(path: Path, root: Path) -> str | None:
    """The Hub split a file of ``root`` belongs to, from a folder named after it (``test/``) or its name
    (``test-00000-of-00001.parquet``, ``validation.jsonl``); None for other names."""
    rel = path.relative_to(root)
    for part in rel.parts[:-1]:
        if part.lower() in _SPLIT_NAMES:
            return part.lower()
    found = _SPLIT_FILE.match(rel.name.lower())
    return found.group(1) if found else None


def _dir_split_files(root: Path) -> tuple[list[Path], list[Path]]:
    """``(files read, files skipped)`` of the directory ``root``: every data file, or, when it holds files named
    after the train split and after another split (Hub shards), the train ones only."""
    files = _all_dir_files(root)
    splits = [_split_of(f, root) for f in files]
    if "train" not in splits or not set(splits) - {"train", None}:
        return files, []
    return ([f for f, s in zip(files, splits) if s == "train"], [f for f, s in zip(files, splits) if s != "train"])


def _dir_files(root: Path) -> list[Path]:
    return _dir_split_files(root)[0]


def _skipped_notice(root: Path, kept: list[Path], skipped: list[Path]) -> str:
    splits = sorted({_split_of(f, root) or "unnamed" for f in skipped})
    names = ", ".join(f.relative_to(root).as_posix() for f in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    return (f"{root}: reading the train split only ({len(kept)} file(s)); skipped the {', '.join(splits)} split(s) "
            f"({len(skipped)} file(s): {names}); point the source at a file to read it")


def _hf_hint(source: str) -> str:
    bundled = ", ".join(repr(n) for n in sorted(BUNDLED_CORPORA))
    return (
        f"Offline, pass a local {'/'.join(TEXT_SUFFIXES)} file or a directory of them, or a "
        f"bundled corpus ({bundled}), instead of {source!r}."
    )


def _hub_cached(source: str) -> bool:
    """Whether the Hub dataset ``source`` has a copy in the Hub download cache or the datasets cache."""
    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
    return ((Path(constants.HF_HUB_CACHE) / f"datasets--{source.replace('/', '--')}").is_dir()
            or (Path(datasets_cache) / source.replace("/", "___")).is_dir())


def _hf_rows(source: str, split: str | None, local_dir: Path | None) -> Iterable[Any]:
    try:
        # deferred: the Hugging Face datasets package is optional (only for Hub datasets)
        import datasets
    except ImportError as err:
        raise ImportError(
            f"{source!r} is not a local file or directory, so it would be loaded as a Hugging Face "
            f"dataset, which needs `pip install datasets` and network access. {_hf_hint(source)}"
        ) from err
    split = split or "train"
    if local_dir is None and not hub_reachable() and not _hub_cached(source):
        raise OSError(f"could not load Hugging Face dataset {source!r}: the Hub cannot be reached (or HF_HUB_OFFLINE "
                      f"is set) and no copy is in the local cache. {_hf_hint(source)}")
    try:
        if local_dir is not None:
            ds = datasets.load_from_disk(str(local_dir))
        else:
            ds = datasets.load_dataset(source, split=split)
    except Exception as err:  # offline hub, unknown name, bad cache: one message for all (an OSError: not loadable)
        raise OSError(
            f"could not load Hugging Face dataset {source!r} (split {split!r}): {err}. {_hf_hint(source)}"
        ) from err
    if isinstance(ds, dict):  # a DatasetDict saved to disk
        if split not in ds:
            raise ValueError(f"dataset {source!r} has no split {split!r}; splits: {sorted(ds.keys())}")
        ds = ds[split]
    return ds


def _read_hf(rows: Iterable[Any], source: str, text_field: str) -> Iterator[str]:
    for i, row in enumerate(rows):
        if text_field not in row:
            raise ValueError(f"dataset {source!r} row {i} has no field {text_field!r} (has {sorted(row)})")
        yield row[text_field]


def _nonblank(docs: Iterator[str], source: str) -> Iterator[str]:
    seen = False
    for doc in docs:
        if doc.strip():
            seen = True
            yield doc
    if not seen:
        raise ValueError(f"corpus {source!r} holds no non-blank text")


def load_texts(
    source: str | os.PathLike[str],
    *,
    text_field: str = "text",
    split: str | None = None,
    doc_sep: str | None = None,
) -> Iterator[str]:
    """Iterate over the documents of ``source``, skipping blank ones.

    ``source`` is, in this order of precedence:

    * a bundled corpus name, ``"brown"`` (see :mod:`tadm.corpora`; use ``"./brown"`` for a local
      path of that name);
    * a ``.txt`` / ``.txt.gz`` file: the whole file is ONE document, unless ``doc_sep`` is given
      (e.g. ``"\\n\\n\\n"``), in which case it is split on that string;
    * a ``.jsonl`` / ``.jsonl.gz`` file: one JSON object per line, text in ``text_field``;
    * a ``.parquet`` / ``.arrow`` file: the files the Hugging Face dataset loader downloads and
      caches (e.g. OpenWebText's shards), column ``text_field``, read with pyarrow;
    * a directory: a dataset saved by Hugging Face ``datasets.save_to_disk`` (it holds ``state.json``
      or ``dataset_dict.json``), or else every file above found recursively, in sorted
      relative-path order (so a ``datasets`` cache folder of ``*.arrow`` files is read as files).
      A folder of Hub shards named by split (``train-00000-of-00002.parquet``,
      ``validation-...``, ``test-...``, or ``train/``, ``test/`` subfolders) is read for its
      train files only, with a one-line warning naming what was skipped: validation documents
      are held out by :func:`build_packed_dataset`, and a test split is never trained on. Name a
      file to read it anyway;
    * anything else is a Hugging Face hub dataset name (``"openwebtext"``), loaded with
      ``datasets.load_dataset(source, split=split or "train")`` (needs ``datasets`` and network).

    ``split`` selects a Hugging Face split; local sources have just one, so only ``None`` or
    ``"train"`` is accepted for them (validation documents are held out by
    :func:`build_packed_dataset`). Files, ``datasets`` and the hub are checked when this is
    called; documents are read lazily.

    Raises:
        FileNotFoundError: ``source`` looks like a path (has a data-file suffix or starts with
            ``.``, ``/``, ``~``) but does not exist.
        ImportError / OSError: a Hugging Face dataset was requested but ``datasets`` is
            missing or the load failed; the message says how to supply a local file instead.
        ValueError: (while iterating) the corpus holds no non-blank text, or a JSON line lacks
            ``text_field``.
    """
    spec = os.fspath(source)
    path = Path(spec).expanduser()
    if spec in BUNDLED_CORPORA:
        if text_field != "text":
            raise ValueError(f"text_field {text_field!r} does not apply to the bundled corpus {spec!r} (its field is "
                             "'text')")
        files = [bundled_corpus_path(spec)]
    elif path.is_file():
        if _suffix(path) is None:
            raise ValueError(f"{path}: unsupported file type; expected one of {', '.join(TEXT_SUFFIXES)}")
        files = [path]
    elif path.is_dir() and not _saved_by_datasets(path):
        files, skipped = _dir_split_files(path)
        if not files:
            raise ValueError(f"directory {path} holds no {'/'.join(TEXT_SUFFIXES)} files")
        if skipped:
            # issued here (no stacklevel): the default filter shows it once however often the corpus is read
            warnings.warn(_skipped_notice(path, files, skipped))
    elif path.is_dir() or not _looks_like_path(spec):  # a dataset saved by `datasets`, or a hub name
        return _nonblank(_read_hf(_hf_rows(spec, split, path if path.is_dir() else None), spec, text_field), spec)
    else:
        raise FileNotFoundError(f"corpus file or directory {spec!r} does not exist")
    if text_field != "text" and all(_suffix(f) in (".txt", ".txt.gz") for f in files):
        raise ValueError(f"text_field {text_field!r} applies to JSON lines, Parquet and Arrow files; {spec!r} is "
                         "plain text")
    if split not in (None, "train"):
        raise ValueError(
            f"split={split!r} given for local source {spec!r}, which has a single split; "
            "pass split=None and hold out validation documents with val_fraction"
        )
    return _nonblank((d for f in files for d in _read_file(f, text_field, doc_sep)), spec)


# ============================================================================ packing
def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id in ``[0, vocab_size)`` fits in 16 bits, else ``uint32``."""
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**32]")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class PackedTokens(Dataset[torch.Tensor]):
    """Packed blocks of one split, read from a memory map: ``dataset[i]`` is a LongTensor (seq_len,).

    Every block is ``[BOS] + seq_len - 2 tokens + [EOS]`` (see the module docstring). Opened from
    the JSON sidecar written by :func:`build_packed_dataset`; the map is opened lazily in each
    process, so the dataset pickles cheaply into ``DataLoader`` workers.
    """

    def __init__(self, sidecar: str | os.PathLike[str]) -> None:
        self.sidecar = Path(sidecar)
        self.meta: dict[str, Any] = json.loads(self.sidecar.read_text())
        self.path = self.sidecar.with_name(self.meta["file"])
        self.seq_len: int = int(self.meta["seq_len"])
        self.num_blocks: int = int(self.meta["num_blocks"])
        self.dtype = np.dtype(self.meta["dtype"])
        self._data: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        """The blocks as a read-only (num_blocks, seq_len) array (a memmap when non-empty)."""
        if self._data is None:
            if self.num_blocks == 0:  # numpy cannot map an empty file
                self._data = np.empty((0, self.seq_len), dtype=self.dtype)
            else:
                self._data = np.memmap(
                    self.path, dtype=self.dtype, mode="r", shape=(self.num_blocks, self.seq_len)
                )
        return self._data

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -self.num_blocks <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range for {self.num_blocks} blocks")
        return torch.from_numpy(self.array[index].astype(np.int64))  # (L,)

    def get_batch(self, indices: Sequence[int]) -> torch.Tensor:
        """Blocks ``indices`` stacked: LongTensor (B, L)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_blocks):
            raise IndexError(f"block indices must lie in [0, {self.num_blocks})")
        return torch.from_numpy(self.array[idx].astype(np.int64))  # (B, L)

    def __getitems__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        # DataLoader's batched fetch: one fancy-indexed read instead of one read per block
        return list(self.get_batch(indices).unbind(0))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_data": None}

    def __repr__(self) -> str:
        return f"PackedTokens({self.meta['split']!r}, num_blocks={self.num_blocks}, seq_len={self.seq_len})"


@dataclass(frozen=True)
class PackedSplits:
    """Training and held-out blocks built from one corpus."""

    train: PackedTokens
    val: PackedTokens


def source_identity(source: str | os.PathLike[str]) -> tuple[str, list[Any]]:
    """A canonical name for ``source`` and a stamp that changes when local files change."""
    spec = os.fspath(source)
    if spec in BUNDLED_CORPORA:
        path = bundled_corpus_path(spec)
        return f"bundled:{spec}", [path.stat().st_size]
    path = Path(spec).expanduser()
    if path.is_file():
        st = path.stat()
        return str(path.resolve()), [[path.name, st.st_size, st.st_mtime_ns]]
    if path.is_dir():
        saved = _saved_by_datasets(path)
        files = [path / m for m in _HF_DISK_FILES if (path / m).is_file()] if saved else _dir_files(path)
        stamp = [[f.relative_to(path).as_posix(), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        return str(path.resolve()), stamp
    return f"hf:{spec}", []


def _slug(name: str) -> str:
    base = name.rstrip("/").rsplit("/", 1)[-1].split(":")[-1]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base)[:48] or "corpus"


def _sidecar_ok(sidecar: Path, expected: dict[str, Any]) -> bool:
    try:
        meta = json.loads(sidecar.read_text())
        if any(meta.get(k) != v for k, v in expected.items()):
            return False
        data = sidecar.with_name(meta["file"])
        nbytes = int(meta["num_blocks"]) * int(meta["seq_len"]) * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError):  # absent, unreadable or foreign sidecar
        return False
    return data.is_file() and data.stat().st_size == nbytes


def _tokenize_to_file(
    docs: Iterable[str],
    tokenizer: PackingTokenizer,
    out: Path,
    dtype: np.dtype,
    progress: bool | None,
    label: str,
    batch_docs: int = 256,
) -> np.ndarray:
    """Write every document's ids + EOS to ``out``; return the per-document token counts."""
    encode_batch = getattr(tokenizer, "encode_batch", None)
    lengths: list[int] = []
    eos = tokenizer.eos_id
    bar = tqdm(desc=f"tokenizing {label}", unit="doc", disable=None if progress is None else not progress)
    docs = iter(docs)
    with open(out, "wb") as f:
        for batch in iter(lambda: list(itertools.islice(docs, batch_docs)), []):
            encoded = encode_batch(batch) if encode_batch else [tokenizer.encode(d) for d in batch]
            sizes = [len(ids) + 1 for ids in encoded]
            ends = np.cumsum(sizes)
            flat = np.full(int(ends[-1]), eos, dtype=np.int64)  # EOS pre-filled after each document
            for ids, end in zip(encoded, ends):
                flat[end - 1 - len(ids) : end - 1] = ids
            if flat.min() < 0 or flat.max() >= tokenizer.vocab_size:
                raise ValueError(f"tokenizer produced ids outside [0, {tokenizer.vocab_size})")
            f.write(flat.astype(dtype).tobytes())
            lengths.extend(sizes)
            bar.update(len(batch))
    bar.close()
    return np.asarray(lengths, dtype=np.int64)


def _doc_runs(offsets: np.ndarray, doc_ids: np.ndarray) -> Iterator[tuple[int, int]]:
    """Token ranges [start, end) of ``doc_ids`` (sorted), consecutive documents merged."""
    if doc_ids.size == 0:
        return
    breaks = np.flatnonzero(np.diff(doc_ids) != 1) + 1
    for run in np.split(doc_ids, breaks):
        yield int(offsets[run[0]]), int(offsets[run[-1] + 1])


def _pack_split(
    stream: np.ndarray, offsets: np.ndarray, doc_ids: np.ndarray, seq_len: int, bos: int, eos: int, out: Path
) -> int:
    """Wrap-pack the documents ``doc_ids`` of ``stream`` into ``out``; return the number of blocks."""
    inner = seq_len - 2
    carry = stream[:0]
    n_blocks = 0
    with open(out, "wb") as f:
        for start, end in _doc_runs(offsets, doc_ids):
            for lo in range(start, end, _CHUNK_TOKENS):
                buf = np.concatenate([carry, stream[lo : min(end, lo + _CHUNK_TOKENS)]])
                n = buf.size // inner
                if n:
                    blocks = np.empty((n, seq_len), dtype=stream.dtype)  # (n, L)
                    blocks[:, 0] = bos
                    blocks[:, 1:-1] = buf[: n * inner].reshape(n, inner)
                    blocks[:, -1] = eos
                    f.write(blocks.tobytes())
                    n_blocks += n
                carry = buf[n * inner :].copy()
    return n_blocks


def _split_units(lengths: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Token offsets (n_units + 1,) of the units the splits are made of, and each split's unit ids.

    The units are the documents, or the two token spans of a one-document corpus (the validation
    span holds at least one token, EOS included); see :func:`build_packed_dataset`.
    """
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    by_tokens = lengths.size == 1 and val_fraction > 0
    n = int(offsets[-1]) if by_tokens else lengths.size  # tokens or documents
    n_val = min(n - 1, max(1, round(n * val_fraction))) if val_fraction else 0
    if by_tokens:
        return np.array([0, n - n_val, n], dtype=np.int64), {"train": np.array([0]), "val": np.array([1])}
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    val_ids = np.sort(perm[:n_val].numpy()).astype(np.int64)
    is_val = np.zeros(lengths.size, dtype=bool)
    is_val[val_ids] = True
    return offsets, {"train": np.flatnonzero(~is_val), "val": val_ids}


def _check_split_sizes(
    name: str, n_tokens: dict[str, int], split_ids: dict[str, np.ndarray], seq_len: int, by_tokens: bool
) -> None:
    """Raise a ValueError naming the split unless every non-empty split fills at least one block."""
    for s, ids in split_ids.items():
        if (ids.size or s == "train") and n_tokens[s] < seq_len - 2:
            what = "a span of the corpus's one document" if by_tokens else f"{ids.size} documents"
            hint = " (raise val_fraction)" if s == "val" else ""
            raise ValueError(
                f"the {s} split of {name!r} has {n_tokens[s]} tokens ({what}, EOS included), but one block "
                f"of seq_len={seq_len} needs {seq_len - 2}{hint}"
            )


def build_packed_dataset(
    source: str | os.PathLike[str],
    tokenizer: PackingTokenizer,
    seq_len: int,
    cache_dir: str | os.PathLike[str],
    val_fraction: float = 0.01,
    seed: int = 0,
    *,
    text_field: str = "text",
    split: str | None = None,
    doc_sep: str | None = None,
    progress: bool | None = None,
) -> PackedSplits:
    """Tokenize ``source`` once, split it by documents, wrap-pack both splits into blocks.

    ``val_fraction`` of the documents (rounded, at least one, at most all but one; none when it
    is 0) are chosen by a permutation seeded with ``seed`` and form the validation split; both
    splits keep corpus order. A corpus of a single document (a lone ``.txt`` file) is split by
    tokens instead: the last ``val_fraction`` of them are the validation split. Each split is packed as described in the module docstring into
    ``<cache_dir>/<name>-<key>/{train,val}.bin`` with ``{train,val}.json`` sidecars. The key
    hashes the source, ``text_field``/``split``/``doc_sep``, the tokenizer fingerprint,
    ``seq_len``, ``val_fraction`` and ``seed``; a later call with the same arguments reuses the
    files without tokenizing, unless the sidecars disagree (e.g. a local source file changed
    size or mtime), in which case they are rebuilt. Call it on one process first under
    distributed training.

    Returns:
        ``PackedSplits(train, val)``; blocks are (seq_len,) LongTensors.

    Raises:
        ValueError: ``seq_len < 3``, ``val_fraction`` outside [0, 1), or a split holding fewer
            than ``seq_len - 2`` tokens (the message gives both numbers); plus everything
            :func:`load_texts` raises.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len={seq_len} is too short: a block is BOS + at least one token + EOS")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
    name, stamp = source_identity(source)
    dtype = token_dtype(tokenizer.vocab_size)
    settings = {
        "format": _PACK_FORMAT,
        "source": name,
        "text_field": text_field,
        "hf_split": split,
        "doc_sep": doc_sep,
        "tokenizer_fingerprint": tokenizer.fingerprint(),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "seq_len": seq_len,
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "seed": seed,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    out_dir = Path(cache_dir) / f"{_slug(name)}-{key}"
    expected = settings | {"source_stamp": stamp}
    sidecars = {s: out_dir / f"{s}.json" for s in ("train", "val")}
    if all(_sidecar_ok(sidecars[s], expected | {"split": s}) for s in sidecars):
        return PackedSplits(train=PackedTokens(sidecars["train"]), val=PackedTokens(sidecars["val"]))

    docs = load_texts(source, text_field=text_field, split=split, doc_sep=doc_sep)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)  # of builds killed midway
    for sidecar in sidecars.values():  # invalidate first: a crash below leaves no stale sidecar
        sidecar.unlink(missing_ok=True)
    tmp = f".tmp-{os.getpid()}"
    all_path = out_dir / f"documents.bin{tmp}"
    try:
        lengths = _tokenize_to_file(docs, tokenizer, all_path, dtype, progress, _slug(name))
        offsets, split_ids = _split_units(lengths, val_fraction, seed)
        n_tokens = {s: int((offsets[ids + 1] - offsets[ids]).sum()) for s, ids in split_ids.items()}
        _check_split_sizes(name, n_tokens, split_ids, seq_len, by_tokens=offsets.size != lengths.size + 1)
        stream = np.memmap(all_path, dtype=dtype, mode="r") if offsets[-1] else np.zeros(0, dtype)
        for s, ids in split_ids.items():
            bin_tmp = out_dir / f"{s}.bin{tmp}"
            n_blocks = _pack_split(stream, offsets, ids, seq_len, tokenizer.bos_id, tokenizer.eos_id, bin_tmp)
            os.replace(bin_tmp, out_dir / f"{s}.bin")
            meta = expected | {
                "split": s,
                "file": f"{s}.bin",
                "num_blocks": n_blocks,
                "num_tokens": n_tokens[s],
                "dropped_tokens": n_tokens[s] - n_blocks * (seq_len - 2),
                "num_documents": int(ids.size),
                "num_corpus_documents": int(lengths.size),
            }
            if offsets.size != lengths.size + 1:  # one document, split by tokens
                meta["val_tail_tokens"] = int(offsets[-1] - offsets[1])
            elif s == "val":
                meta["val_document_ids"] = ids.tolist()
            write_json(sidecars[s], meta)
        del stream
    finally:
        for leftover in out_dir.glob(f"*{tmp}"):
            leftover.unlink(missing_ok=True)
    return PackedSplits(train=PackedTokens(sidecars["train"]), val=PackedTokens(sidecars["val"]))


# ============================================================================ batches
def hashed_seed(*parts: object) -> int:
    """A 63-bit seed from the SHA-256 of ``parts`` joined by ":" (e.g. ``"tadm-blocks", seed, epoch``)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class BlockSampler(Sampler[list[int]]):
    """Deterministic, resumable, rank-sharded batches of block indices (a ``batch_sampler``).

    ``batch_size`` is the GLOBAL batch size. Epoch ``e`` visits the blocks in a permutation
    seeded by ``(seed, e)``; step ``s`` takes global batch ``s % steps_per_epoch`` of epoch
    ``s // steps_per_epoch`` (the ``num_blocks % batch_size`` left-over blocks of each
    permutation are skipped), and rank ``r`` gets its ``r``-th contiguous slice of
    ``batch_size // world_size`` indices. The global batch of a step depends only on
    ``(num_blocks, batch_size, seed, step)``, so a run may resume on a different world size.

    Iterating yields this rank's batches forever from the current step, counting them in
    ``step``; ``state_dict()`` records that count. A ``DataLoader`` prefetches, so the sampler
    runs ahead of the training loop: resume from the loop's own count of consumed batches,
    ``BlockSampler(..., start_step=consumed)``. Use as
    ``DataLoader(packed, batch_sampler=BlockSampler(len(packed), ...))``.
    """

    def __init__(
        self,
        num_blocks: int,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(f"global batch_size={batch_size} must be a positive multiple of world_size={world_size}")
        if num_blocks < batch_size:
            raise ValueError(f"num_blocks={num_blocks} is smaller than one global batch of {batch_size}")
        if start_step < 0:
            raise ValueError(f"start_step={start_step} must be >= 0")
        super().__init__()
        self.num_blocks, self.batch_size, self.seed = num_blocks, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.step = start_step
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_blocks // self.batch_size

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        """The block order of ``epoch``: LongTensor (num_blocks,)."""
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(hashed_seed("tadm-blocks", self.seed, epoch))
            self._perm = torch.randperm(self.num_blocks, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, step: int) -> list[int]:
        """All ranks' indices of ``step``, in rank order (``batch_size`` of them)."""
        epoch, j = divmod(step, self.steps_per_epoch)
        perm = self.epoch_permutation(epoch)
        return perm[j * self.batch_size : (j + 1) * self.batch_size].tolist()

    def batch_indices(self, step: int) -> list[int]:
        """This rank's indices of ``step``."""
        b = self.batch_size // self.world_size
        return self.global_batch(step)[self.rank * b : (self.rank + 1) * b]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            indices = self.batch_indices(self.step)
            self.step += 1
            yield indices

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed, "num_blocks": self.num_blocks, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state['step']``; seed, num_blocks and batch_size must match."""
        for k in ("seed", "num_blocks", "batch_size"):
            if state[k] != getattr(self, k):
                raise ValueError(f"sampler state has {k}={state[k]}, this sampler has {getattr(self, k)}")
        self.step = int(state["step"])
