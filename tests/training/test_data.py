"""Pretraining data: corpus reading, MDLM wrap packing, the pack cache, resumable sharded batches."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pickle
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import tadm.training.data as data_mod
from tadm.corpora import bundled_corpus_path, bundled_license_path
from tadm.training.data import (
    BlockSampler,
    PackedTokens,
    build_packed_dataset,
    load_texts,
    token_dtype,
)
from tadm.training.tokenization import TextTokenizer, check_vocab_compatible, train_bpe_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"


def fixture_docs() -> list[str]:
    return [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines()]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return train_bpe_tokenizer(fixture_docs(), vocab_size=512)


class CharTokenizer:
    """One id per character, ``ord(c) + offset``; BOS = EOS = the last id before the mask.

    No ``encode_batch``, so the plain protocol path is exercised; a large ``offset`` forces
    uint32 storage.
    """

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.eos_id = self.bos_id = offset + 256
        self.vocab_size = offset + 258
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [ord(c) + self.offset for c in text]

    def fingerprint(self) -> str:
        return f"chars+{self.offset}"


def write_lines(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# ================================================================== load_texts
def test_jsonl_fixture_reads_every_document() -> None:
    docs = list(load_texts(FIXTURE))
    assert docs == fixture_docs() and len(docs) == 30


def test_txt_is_one_document_unless_doc_sep(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("first para\n\nsecond para\n\n\n\nthird doc\n")
    assert list(load_texts(f)) == ["first para\n\nsecond para\n\n\n\nthird doc\n"]
    assert list(load_texts(f, doc_sep="\n\n\n\n")) == ["first para\n\nsecond para", "third doc\n"]
    # blank pieces are skipped
    assert list(load_texts(f, doc_sep="\n\n")) == ["first para", "second para", "third doc\n"]


def test_directory_is_recursive_sorted_and_mixed(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("from b")
    (tmp_path / "a").mkdir()
    write_lines(tmp_path / "a" / "c.jsonl", ["c1", "  ", "c2"])
    with gzip.open(tmp_path / "a" / "d.jsonl.gz", "wt") as g:
        g.write(json.dumps({"body": "d1", "text": "d-text"}) + "\n")
    (tmp_path / "a" / "notes.md").write_text("ignored")
    assert list(load_texts(tmp_path)) == ["c1", "c2", "d-text", "from b"]
    write_lines(tmp_path / "only.jsonl", ["x"])
    with pytest.raises(ValueError, match=r"only.jsonl:1: no field 'body'"):
        list(load_texts(tmp_path / "only.jsonl", text_field="body"))


def test_bundled_corpus_exists_and_loads() -> None:
    path = bundled_corpus_path()
    assert path.name == "brown.jsonl.gz" and path.stat().st_size < 10 * 2**20
    assert "redistribution permitted" in bundled_license_path().read_text()
    docs = load_texts("brown")
    first = [next(docs) for _ in range(3)]
    assert first[0].startswith("The Fulton County Grand Jury said Friday")
    assert all(len(d.split()) > 1000 for d in first)  # Brown samples are ~2,000 words each
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 500 and len({r["genre"] for r in rows}) == 15
    assert rows[0]["id"] == "ca01" and rows[0]["genre"] == "news"
    assert "/nn" not in rows[0]["text"] and "``" not in rows[0]["text"]  # tags and quotes undone
    by_id = {r["id"]: r for r in rows}
    for line in FIXTURE.read_text().splitlines():  # the fixture is whole leading paragraphs
        row = json.loads(line)
        assert by_id[row["id"]]["genre"] == row["genre"]
        assert (by_id[row["id"]]["text"] + "\n\n").startswith(row["text"] + "\n\n")
    with pytest.raises(ValueError, match="valid names: brown"):
        bundled_corpus_path("shakespeare")


def _build_script() -> types.ModuleType:
    path = Path(__file__).resolve().parents[2] / "scripts" / "build_bundled_corpus.py"
    spec = importlib.util.spec_from_file_location("build_bundled_corpus", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_build_detokenizes_form_c() -> None:
    script = _build_script()
    tagged = (
        "\n\n\tThe/at jury/nn said/vbd ``/`` it/pps was/bedz fine/jj ''/'' ,/, Mr./np Pye/np said/vbd ./.\n"
        "Did/dod he/pps go/vb ?/. ?/.\n\n\n"
        "Merger/nn-hl proposed/vbn-hl \n"
        "He/pps met/vbd Ivan/np Allen/np Jr./np ./.\n\n\n"
        "\t(/( See/vb '/' Met/np '/' ;/. ;/. it/pps is/bez 1/2/cd )/) ./.\n"
    )
    paragraphs = list(script.brown_paragraphs(tagged))
    assert paragraphs == [
        'The jury said "it was fine," Mr. Pye said. Did he go?',
        "Merger proposed",
        "He met Ivan Allen Jr.",
        "(See 'Met'; it is 1/2).",
    ]


def test_missing_source_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "corpus.jsonl"
    with pytest.raises(FileNotFoundError, match="corpus.jsonl"):
        load_texts(missing)  # raised on the call, before iteration
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        load_texts("./no_such_dir")


def test_empty_corpus_names_the_source(tmp_path: Path) -> None:
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n\t\n")
    with pytest.raises(ValueError, match="blank.txt.*no non-blank text"):
        list(load_texts(blank))
    blanks = write_lines(tmp_path / "blanks.jsonl", ["", " ", "\n"])
    with pytest.raises(ValueError, match="blanks.jsonl.*no non-blank text"):
        list(load_texts(blanks))


def test_bad_inputs(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_texts(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="single split"):
        load_texts(FIXTURE, split="validation")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_texts(tmp_path / "empty_dir")


def test_hub_name_without_datasets_says_how_to_go_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install datasets.*local .*jsonl"):
        load_texts("openwebtext")


def test_hub_dataset_through_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load_dataset(name: str, split: str) -> list[dict[str, str]]:
        calls.append((name, split))
        if name == "offline/owt":
            raise ConnectionError("hub unreachable")
        return [{"text": "doc one", "id": "1"}, {"text": "", "id": "2"}, {"text": "doc three", "id": "3"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(data_mod, "hub_reachable", lambda: True)
    assert list(load_texts("openwebtext")) == ["doc one", "doc three"]
    assert calls == [("openwebtext", "train")]
    with pytest.raises(ValueError, match="no field 'body'"):
        list(load_texts("openwebtext", split="validation", text_field="body"))
    assert calls[-1] == ("openwebtext", "validation")
    with pytest.raises(OSError, match="hub unreachable.*Offline, pass a local"):
        load_texts("offline/owt")


def test_unreachable_hub_without_a_cached_copy_fails_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fake = types.SimpleNamespace(load_dataset=lambda name, split: calls.append(name) or [{"text": "cached doc"}])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr(data_mod, "hub_reachable", lambda: False)
    monkeypatch.setattr(data_mod.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with pytest.raises(OSError, match="'owner/owt': the Hub cannot be reached .* no copy is in the local cache"):
        load_texts("owner/owt")
    assert calls == []  # not handed to `datasets`, whose client would retry for about 25 s
    for cached in (tmp_path / "hub" / "datasets--owner--owt", tmp_path / "datasets" / "owner___owt"):
        cached.mkdir(parents=True)
        assert list(load_texts("owner/owt")) == ["cached doc"]  # a cached copy is still read offline
        cached.rmdir()
    assert calls == ["owner/owt", "owner/owt"]


def test_dataset_saved_to_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = tmp_path / "owt_saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}')
    splits = {"train": [{"text": "t1"}, {"text": "t2"}], "validation": [{"text": "v1"}]}
    fake = types.SimpleNamespace(load_from_disk=lambda path: splits if Path(path) == saved else None)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert list(load_texts(saved)) == ["t1", "t2"]
    assert list(load_texts(saved, split="validation")) == ["v1"]
    with pytest.raises(ValueError, match=r"no split 'test'; splits: \['train', 'validation'\]"):
        load_texts(saved, split="test")


def test_a_datasets_cache_folder_is_read_as_arrow_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_dataset``'s cache folder (dataset_info.json + *.arrow) is no save_to_disk output: its files are read;
    a folder with state.json (a saved Dataset) still goes to ``datasets.load_from_disk``."""
    pa = pytest.importorskip("pyarrow")
    cache = tmp_path / "json" / "default-0" / "0.0.0"
    cache.mkdir(parents=True)
    (cache / "dataset_info.json").write_text('{"features": {"text": {"dtype": "string"}}}')
    with pa.OSFile(str(cache / "json-train.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as writer:
            writer.write_table(pa.table({"text": ["first doc", "second doc"]}))
    fake = types.SimpleNamespace(load_from_disk=lambda path: {"train": [{"text": f"saved {Path(path).name}"}]})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert list(load_texts(cache)) == ["first doc", "second doc"]
    assert data_mod.source_identity(cache)[1][0][0] == "json-train.arrow"  # the stamp follows the .arrow file
    saved = tmp_path / "saved"
    saved.mkdir()
    for name in ("dataset_info.json", "state.json", "data-00000-of-00001.arrow"):
        (saved / name).write_text("{}")
    assert list(load_texts(saved)) == ["saved saved"]


# ================================================================== packing
def test_pack_by_hand_with_char_tokenizer(tmp_path: Path) -> None:
    corpus = write_lines(tmp_path / "c.jsonl", ["abc", "de"])
    t = CharTokenizer()
    packed = build_packed_dataset(corpus, t, seq_len=4, cache_dir=tmp_path / "cache", val_fraction=0)
    a, b, c, d, e = (ord(ch) for ch in "abcde")
    B = E = 256
    # stream a b c E d e E, cut into pieces of seq_len - 2 = 2; the lone trailing E is dropped
    expected = [[B, a, b, E], [B, c, E, E], [B, d, e, E]]
    assert [packed.train[i].tolist() for i in range(len(packed.train))] == expected
    assert packed.train[0].dtype == torch.long and packed.train.dtype == np.uint16
    assert packed.train.meta["dropped_tokens"] == 1 and packed.train.meta["num_tokens"] == 7
    assert len(packed.val) == 0 and packed.val.get_batch([]).shape == (0, 4)


def test_uint32_when_ids_exceed_16_bits(tmp_path: Path) -> None:
    assert token_dtype(50258) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    corpus = write_lines(tmp_path / "c.jsonl", ["xyz"])
    t = CharTokenizer(offset=70_000)
    packed = build_packed_dataset(corpus, t, seq_len=5, cache_dir=tmp_path, val_fraction=0)
    assert packed.train.dtype == np.uint32
    assert packed.train[0].tolist() == [70_256, 70_000 + ord("x"), 70_000 + ord("y"), 70_000 + ord("z"), 70_256]


def test_packing_round_trip_on_fixture(tok: TextTokenizer, tmp_path: Path) -> None:
    docs = fixture_docs()
    seq_len = 128
    train = build_packed_dataset(FIXTURE, tok, seq_len, tmp_path, val_fraction=0).train
    blocks = train.array  # (N, L)
    assert blocks.shape == (len(train), seq_len) and blocks.dtype == np.uint16
    assert (blocks[:, 0] == tok.bos_id).all() and (blocks[:, -1] == tok.eos_id).all()
    inner = blocks[:, 1:-1].reshape(-1)
    stream = np.concatenate([tok.encode(d) + [tok.eos_id] for d in docs])
    assert len(train) == len(stream) // (seq_len - 2)
    np.testing.assert_array_equal(inner, stream[: inner.size])
    # as text: the documents, each followed by the EOS marker, up to the dropped tail
    joined = "".join(d + "<|endoftext|>" for d in docs)
    decoded = tok.decode(inner.tolist())
    assert len(decoded) > 0.99 * len(joined) and joined.startswith(decoded)
    assert torch.equal(train.get_batch([3, 0]), torch.stack([train[3], train[0]]))
    assert torch.equal(train[-1], train[len(train) - 1])
    with pytest.raises(IndexError):
        train[len(train)]


def test_val_split_is_seeded_disjoint_and_round_trips(tok: TextTokenizer, tmp_path: Path) -> None:
    docs = fixture_docs()
    seq_len = 64
    splits = build_packed_dataset(FIXTURE, tok, seq_len, tmp_path / "a", val_fraction=0.23, seed=3)
    val_ids = splits.val.meta["val_document_ids"]
    # round(30 * 0.23) = 7 documents, chosen by the seeded permutation
    assert val_ids == sorted(torch.randperm(30, generator=torch.Generator().manual_seed(3))[:7].tolist())
    train_ids = [i for i in range(30) if i not in val_ids]
    assert splits.train.meta["num_documents"] == 23 and splits.val.meta["num_documents"] == 7
    for split, ids in ((splits.train, train_ids), (splits.val, val_ids)):
        stream = np.concatenate([tok.encode(docs[i]) + [tok.eos_id] for i in ids])
        inner = split.array[:, 1:-1].reshape(-1)
        assert len(split) == len(stream) // (seq_len - 2) > 0
        np.testing.assert_array_equal(inner, stream[: inner.size])
    # same seed elsewhere: identical bytes; another seed: other documents
    again = build_packed_dataset(FIXTURE, tok, seq_len, tmp_path / "b", val_fraction=0.23, seed=3)
    assert again.val.meta["val_document_ids"] == val_ids
    assert again.train.path.read_bytes() == splits.train.path.read_bytes()
    other = build_packed_dataset(FIXTURE, tok, seq_len, tmp_path / "a", val_fraction=0.23, seed=4)
    assert other.val.meta["val_document_ids"] != val_ids
    assert other.train.path.parent != splits.train.path.parent


def test_val_split_keeps_one_document_each_side(tmp_path: Path) -> None:
    corpus = write_lines(tmp_path / "c.jsonl", ["abcd", "efgh", "ijkl"])
    # round(3 * 0.9) = 3 is capped to 2 so that training keeps a document
    big = build_packed_dataset(corpus, CharTokenizer(), 4, tmp_path / "big", val_fraction=0.9)
    assert (big.train.meta["num_documents"], big.val.meta["num_documents"]) == (1, 2)
    # round(3 * 0.1) = 0 is raised to 1
    small = build_packed_dataset(corpus, CharTokenizer(), 4, tmp_path / "small", val_fraction=0.1)
    assert (small.train.meta["num_documents"], small.val.meta["num_documents"]) == (2, 1)
    # 5 tokens per document (EOS included) -> 2 blocks of 2 tokens per document, 1 token dropped
    assert (len(big.train), len(big.val)) == (2, 5)


def test_a_rebuild_removes_leftovers_of_killed_builds(tmp_path: Path) -> None:
    import subprocess

    corpus = write_lines(tmp_path / "c.jsonl", ["hello world " * 20, "second document " * 10])
    first = build_packed_dataset(corpus, CharTokenizer(), 16, tmp_path / "cache", val_fraction=0.3)
    pack_dir = first.train.path.parent
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    (pack_dir / f"documents.bin.tmp-{dead}").write_bytes(b"tokens of a killed build")
    (pack_dir / f"documents.bin.tmp-{os.getpid()}x").write_bytes(b"not a temporary name")
    first.train.sidecar.unlink()  # forces a rebuild
    build_packed_dataset(corpus, CharTokenizer(), 16, tmp_path / "cache", val_fraction=0.3)
    assert sorted(f.name for f in pack_dir.iterdir()) == [
        f"documents.bin.tmp-{os.getpid()}x", "train.bin", "train.json", "val.bin", "val.json"]


def test_a_single_document_is_split_by_tokens(tmp_path: Path) -> None:
    corpus = tmp_path / "book.txt"
    corpus.write_text("abcdefghij" * 10)  # one document: 100 characters + EOS = 101 tokens
    splits = build_packed_dataset(corpus, CharTokenizer(), 6, tmp_path / "cache", val_fraction=0.2)
    # round(101 * 0.2) = 20 tail tokens are held out, the first 81 train
    assert (splits.train.meta["num_tokens"], splits.val.meta["num_tokens"]) == (81, 20)
    assert splits.val.meta["val_tail_tokens"] == 20 and splits.train.meta["num_corpus_documents"] == 1
    stream = [ord(c) for c in "abcdefghij" * 10] + [256]
    for split, part in ((splits.train, stream[:81]), (splits.val, stream[81:])):
        inner = split.array[:, 1:-1].reshape(-1).tolist()
        assert inner == part[: len(inner)] and len(split) == len(part) // 4


@pytest.mark.parametrize("name", ["c.jsonl.gz", "c.txt.gz"])
def test_a_truncated_or_corrupt_gzip_file_is_named(name: str, tmp_path: Path) -> None:
    whole = gzip.compress(FIXTURE.read_bytes())
    for content, detail in ((whole[: len(whole) // 2], "ended before"), (b"not gzip at all\n", "Not a gzipped file"),
                            (whole[:200] + b"\x00" * 64 + whole[264:], "")):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}: truncated or corrupt gzip file \(.*{detail}"):
            list(load_texts(path))


def test_non_utf8_files_name_the_file_and_line(tmp_path: Path) -> None:
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:2: not valid UTF-8 \(byte 0xe9\)"):
        list(load_texts(jsonl))
    packed = tmp_path / "c.jsonl.gz"
    packed.write_bytes(gzip.compress(jsonl.read_bytes()))
    with pytest.raises(ValueError, match=r"c\.jsonl\.gz:2: not valid UTF-8"):
        list(load_texts(packed))
    txt = tmp_path / "c.txt"
    txt.write_bytes(b"one\ntwo\nthr\xffee\n")
    with pytest.raises(ValueError, match=r"c\.txt:3: not valid UTF-8 \(byte 0xff\)"):
        list(load_texts(txt))


def test_cache_is_reused_without_tokenizing(tmp_path: Path) -> None:
    corpus = write_lines(tmp_path / "c.jsonl", ["hello world " * 20, "second document " * 10, "third document " * 5])
    t = CharTokenizer()
    first = build_packed_dataset(corpus, t, 32, tmp_path / "cache", val_fraction=0.3)
    assert t.calls == 3
    files = sorted(first.train.path.parent.iterdir())
    assert [f.name for f in files] == ["train.bin", "train.json", "val.bin", "val.json"]  # no temp left
    stamps = {f: f.stat().st_mtime_ns for f in files}

    second = build_packed_dataset(corpus, t, 32, tmp_path / "cache", val_fraction=0.3)
    assert t.calls == 3  # nothing re-tokenized
    assert {f: f.stat().st_mtime_ns for f in files} == stamps
    assert torch.equal(second.train.get_batch(range(len(second.train))), first.train.get_batch(range(len(first.train))))

    # another seq_len: a separate build, and the first stays valid
    third = build_packed_dataset(corpus, t, 16, tmp_path / "cache", val_fraction=0.3)
    assert t.calls == 6 and third.train.seq_len == 16 and third.train.path.parent != first.train.path.parent
    build_packed_dataset(corpus, t, 32, tmp_path / "cache", val_fraction=0.3)
    assert t.calls == 6


def test_cache_rebuilds_when_source_or_files_change(tmp_path: Path) -> None:
    corpus = write_lines(tmp_path / "c.jsonl", ["alpha beta gamma " * 10])
    t = CharTokenizer()
    first = build_packed_dataset(corpus, t, 16, tmp_path / "cache", val_fraction=0)
    n_first = len(first.train)
    write_lines(corpus, ["alpha beta gamma " * 10, "delta epsilon " * 10])  # source edited
    second = build_packed_dataset(corpus, t, 16, tmp_path / "cache", val_fraction=0)
    assert t.calls == 3 and second.train.path == first.train.path and len(second.train) > n_first
    second.train.path.write_bytes(b"\0\0")  # truncated data file: sidecar no longer matches
    third = build_packed_dataset(corpus, t, 16, tmp_path / "cache", val_fraction=0)
    assert t.calls == 5 and len(third.train) == len(second.train)
    # a different tokenizer never reuses these blocks
    build_packed_dataset(corpus, CharTokenizer(offset=1), 16, tmp_path / "cache", val_fraction=0)
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_corpus_shorter_than_one_block(tmp_path: Path, tok: TextTokenizer) -> None:
    small = tmp_path / "small.txt"
    small.write_text("hello world")
    n = len(tok.encode("hello world")) + 1
    with pytest.raises(ValueError, match=rf"train split .* has {n} tokens .* seq_len=64 needs 62"):
        build_packed_dataset(small, tok, 64, tmp_path / "cache", val_fraction=0)
    # 3 documents of 801 tokens (EOS included), round(3 * 0.34) = 1 held out: train 1602, val 801
    corpus = write_lines(tmp_path / "three.jsonl", ["a long document " * 50] * 3)
    with pytest.raises(ValueError, match=r"val split .* has 801 tokens .* needs 1022 \(raise val_fraction\)"):
        build_packed_dataset(corpus, CharTokenizer(), 1024, tmp_path / "cache", val_fraction=0.34)
    # one document is split by tokens: its 10% tail (1 token) cannot fill a block of 4
    with pytest.raises(ValueError, match=r"val split .* has 1 tokens \(a span of the corpus's one document, EOS "
                                         r"included\), but one block of seq_len=4 needs 2 \(raise val_fraction\)"):
        build_packed_dataset(small, tok, 4, tmp_path / "cache", val_fraction=0.1)
    with pytest.raises(ValueError, match="seq_len=2"):
        build_packed_dataset(small, tok, 2, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must be in \[0, 1\)"):
        build_packed_dataset(small, tok, 8, tmp_path / "cache", val_fraction=1.0)


def test_empty_and_missing_corpus_through_build(tmp_path: Path, tok: TextTokenizer) -> None:
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        build_packed_dataset(tmp_path / "absent.jsonl", tok, 16, tmp_path / "cache")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    with pytest.raises(ValueError, match="blank.txt.*no non-blank"):
        build_packed_dataset(blank, tok, 16, tmp_path / "cache")
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert leftovers == []  # a failed build leaves no files behind


def test_model_vocab_mismatch_against_packed_data(tok: TextTokenizer, tmp_path: Path) -> None:
    packed = build_packed_dataset(FIXTURE, tok, 256, tmp_path, val_fraction=0)
    assert packed.train.meta["vocab_size"] == tok.vocab_size == 512
    assert int(packed.train.array.max()) < tok.mask_id  # data never holds the mask token
    with pytest.raises(ValueError, match="512 tokens.*vocab_size=50258"):
        check_vocab_compatible(tok, 50258)


def test_packed_tokens_pickle_and_dataloader(tok: TextTokenizer, tmp_path: Path) -> None:
    train = build_packed_dataset(FIXTURE, tok, 64, tmp_path, val_fraction=0).train
    _ = train[0]  # open the memory map
    blob = pickle.dumps(train)
    assert len(blob) < 4096  # the map itself is not pickled
    clone = pickle.loads(blob)
    assert torch.equal(clone[5], train[5])
    reopened = PackedTokens(train.sidecar)
    assert torch.equal(reopened[7], train[7])
    sampler = BlockSampler(len(train), batch_size=4, seed=1)
    loader = iter(DataLoader(train, batch_sampler=sampler))
    for step in range(3):
        batch = next(loader)
        assert batch.shape == (4, 64) and batch.dtype == torch.long
        assert torch.equal(batch, train.get_batch(BlockSampler(len(train), 4, seed=1).batch_indices(step)))


# ================================================================== BlockSampler
def take(sampler: BlockSampler, n: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_sampler_epochs_are_permutations() -> None:
    s = BlockSampler(num_blocks=10, batch_size=4, seed=0)
    assert s.steps_per_epoch == 2
    batches = take(s, 6)  # 3 epochs of 2 steps; 2 blocks per epoch left over
    for e in range(3):
        seen = batches[2 * e] + batches[2 * e + 1]
        assert len(set(seen)) == 8 and set(seen) <= set(range(10))
        assert seen == s.epoch_permutation(e)[:8].tolist()
    assert batches[0:2] != batches[2:4]  # a new order each epoch
    assert take(BlockSampler(10, 4, seed=0), 6) == batches  # seeded
    assert take(BlockSampler(10, 4, seed=1), 6) != batches


def test_sampler_ranks_shard_the_global_batch() -> None:
    single = take(BlockSampler(20, 8, seed=5), 7)
    r0 = take(BlockSampler(20, 8, seed=5, rank=0, world_size=2), 7)
    r1 = take(BlockSampler(20, 8, seed=5, rank=1, world_size=2), 7)
    for g, a, b in zip(single, r0, r1):
        assert len(a) == len(b) == 4
        assert not set(a) & set(b)
        assert a + b == g


def test_sampler_resume_equals_uninterrupted() -> None:
    uninterrupted = take(BlockSampler(13, 4, seed=2, rank=1, world_size=2), 9)
    first = BlockSampler(13, 4, seed=2, rank=1, world_size=2)
    head = take(first, 4)
    state = first.state_dict()
    assert state == {"step": 4, "seed": 2, "num_blocks": 13, "batch_size": 4}
    resumed = BlockSampler(13, 4, seed=2, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert head + take(resumed, 5) == uninterrupted
    assert take(BlockSampler(13, 4, seed=2, rank=1, world_size=2, start_step=4), 5) == uninterrupted[4:]
    # the global batch does not depend on the world size, so a run may resume on fewer ranks
    solo = BlockSampler(13, 4, seed=2)
    solo.load_state_dict(state)
    assert [b[2:] for b in take(solo, 5)] == uninterrupted[4:]


def test_sampler_errors() -> None:
    s = BlockSampler(13, 4, seed=2)
    with pytest.raises(ValueError, match="seed=3, this sampler has 2"):
        s.load_state_dict({"step": 1, "seed": 3, "num_blocks": 13, "batch_size": 4})
    with pytest.raises(ValueError, match="multiple of world_size=3"):
        BlockSampler(13, 4, world_size=3)
    with pytest.raises(ValueError, match="rank=2"):
        BlockSampler(13, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="smaller than one global batch"):
        BlockSampler(3, 4)


# ---------------------------------------------------------------- the Hub loader's files (OpenWebText offline)
def _hub_shards(root: Path, docs: list[str]) -> Path:
    """The files a cluster user has from the Hub: Parquet shards (as on the Hub) and an Arrow cache file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = root / "plain_text"
    shards.mkdir(parents=True)
    half = len(docs) // 2
    pq.write_table(pa.table({"text": docs[:half]}), shards / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": docs[half:]}), shards / "train-00001-of-00002.parquet")
    with pa.OSFile(str(root / "openwebtext-train.arrow"), "wb") as sink:  # datasets' cache: an IPC stream
        with pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as writer:
            writer.write_table(pa.table({"text": docs[:3]}))
    return shards


def test_parquet_shards_and_arrow_cache_files_are_read(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    docs = fixture_docs()
    shards = _hub_shards(tmp_path / "owt", docs)
    assert list(load_texts(shards)) == docs  # a directory of shards, in sorted order
    assert list(load_texts(shards / "train-00001-of-00002.parquet")) == docs[len(docs) // 2:]
    assert list(load_texts(tmp_path / "owt" / "openwebtext-train.arrow")) == docs[:3]
    with pytest.raises(ValueError, match="no column 'body'"):
        list(load_texts(shards, text_field="body"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="broken.parquet: not a readable parquet file"):
        list(load_texts(tmp_path / "broken.parquet"))


def test_a_folder_of_split_shards_is_read_for_its_train_split(tmp_path: Path) -> None:
    """Hub shards named by split: only train-* is read (validation is held out by the packer, test never trained
    on), with one warning naming what was skipped; a folder of train shards alone is read without one."""
    pytest.importorskip("pyarrow")
    docs = fixture_docs()
    shards = _hub_shards(tmp_path / "owt", docs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice: nothing skipped
        assert list(load_texts(shards)) == docs
    write_lines(shards / "validation-00000-of-00001.jsonl", ["validation doc"])
    write_lines(shards / "test-00000-of-00001.jsonl", ["test doc"])
    with pytest.warns(UserWarning) as caught:
        assert list(load_texts(shards)) == docs
    assert [str(w.message) for w in caught] == [
        f"{shards}: reading the train split only (2 file(s)); skipped the test, validation split(s) (2 file(s): "
        "test-00000-of-00001.jsonl, validation-00000-of-00001.jsonl); point the source at a file to read it"]
    assert [f[0] for f in data_mod.source_identity(shards)[1]] == ["train-00000-of-00002.parquet",
                                                                    "train-00001-of-00002.parquet"]
    assert list(load_texts(shards / "test-00000-of-00001.jsonl")) == ["test doc"]  # named, it is read
    # splits as folders
    layout = tmp_path / "layout"
    for split, text in (("train", "t"), ("test", "x")):
        (layout / "data" / split).mkdir(parents=True)
        write_lines(layout / "data" / split / "0.jsonl", [text])
    with pytest.warns(UserWarning, match="skipped the test split"):
        assert list(load_texts(layout)) == ["t"]
    # names that only start like a split are no split: "training.jsonl", "value.jsonl"
    plain = tmp_path / "plain"
    plain.mkdir()
    write_lines(plain / "training.jsonl", ["a"])
    write_lines(plain / "value.jsonl", ["b"])
    write_lines(plain / "train.jsonl", ["c"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(load_texts(plain)) == ["c", "a", "b"]


@pytest.mark.slow
def test_the_openwebtext_presets_train_from_local_shards(tmp_path: Path, tok: TextTokenizer) -> None:
    """``tadm-owt-small`` and ``study-owt`` with ``data.source`` at local Parquet shards (tiny overrides)."""
    pytest.importorskip("pyarrow")
    from tadm.cli import main
    from tadm.study.config import load_study_config, model_experiment_config

    shards = _hub_shards(tmp_path / "owt", fixture_docs())
    tok.save(tmp_path / "tok")
    common = [f"data.source={shards}", f"data.tokenizer={tmp_path / 'tok'}", "data.seq_len=64",
              f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.1"]
    code = main(["train", "tadm-owt-small", *common, "model.preset=tiny", "train.max_steps=2",
                 "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_every=2",
                 "train.eval_batches=1", "train.device=cpu", "train.precision=fp32", f"train.out_dir={tmp_path / 'run'}"])
    assert code == 0 and (tmp_path / "run" / "final" / "model.safetensors").is_file()
    study = load_study_config("study-owt", [f"out_dir={tmp_path / 'study'}", *common])
    exp = model_experiment_config(study, study.models[0], 0)
    splits = build_packed_dataset(exp.data.source, tok, seq_len=exp.data.seq_len, cache_dir=exp.data.cache_dir,
                                  val_fraction=exp.data.val_fraction)
    assert len(splits.train) > 0 and len(splits.val) > 0
