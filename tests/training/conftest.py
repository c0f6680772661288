"""Fixtures shared by the training tests: a tiny BPE trained on the fixture corpus and a data cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tadm.training.tokenization import train_bpe_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    docs = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines()]
    out = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(docs, vocab_size=320, save_dir=out)
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")
