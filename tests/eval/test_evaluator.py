"""Evaluator loading: tadm AR checkpoints, Hugging Face directories, presets, and clear errors.

The builders at the top (tiny tokenizer, tiny AR / diffusion models with non-trivial output
heads) are shared by the other evaluation tests.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tadm.eval.evaluator import (
    Evaluator,
    evaluator_from_ar_model,
    evaluator_from_hf,
    load_evaluator,
    prepare_default_evaluator,
)
from tadm.nn import ar_tiny, mdlm_tiny, tadm_tiny
from tadm.training.tokenization import TextTokenizer, train_bpe_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"


# ------------------------------------------------------------------------------- shared builders
def fixture_docs(n: int | None = None) -> list[str]:
    docs = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines() if line.strip()]
    return docs if n is None else docs[:n]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> TextTokenizer:
    """Byte-level BPE with 320 ids (mask last), trained on the Brown fixture."""
    return train_bpe_tokenizer(fixture_docs(), vocab_size=320)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.3) -> torch.nn.Module:
    """Give every parameter random values: zero-initialised output layers would make every model uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def tiny_ar(seed: int = 0, max_seq_len: int = 64) -> torch.nn.Module:
    """AR model over the tiny tokenizer's ids without the mask (vocab 319)."""
    return randomize_(ar_tiny(vocab_size=tiny_tokenizer().vocab_size - 1, max_seq_len=max_seq_len), seed)


def tiny_diffusion(kind: str = "tadm", seed: int = 1, max_seq_len: int = 64) -> torch.nn.Module:
    builder = {"tadm": tadm_tiny, "mdlm": mdlm_tiny}[kind]
    return randomize_(builder(vocab_size=tiny_tokenizer().vocab_size, max_seq_len=max_seq_len), seed)


def tiny_ar_evaluator(seed: int = 0, max_seq_len: int = 64) -> Evaluator:
    return evaluator_from_ar_model(tiny_ar(seed, max_seq_len), tiny_tokenizer(), name="tiny-ar")


def save_ar_evaluator(directory: Path, seed: int = 0) -> Path:
    tiny_ar(seed).save_pretrained(directory)
    tiny_tokenizer().save(directory)
    return directory


def tiny_hf_gpt2(seed: int = 0):
    """A random 2-layer GPT-2 over the tiny tokenizer, built offline, and a matching HF tokenizer."""
    import transformers
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=tok.eos_id, eos_token_id=tok.eos_id)
    model = transformers.GPT2LMHeadModel(config).eval()
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token="<|endoftext|>",
                                                  pad_token="<|endoftext|>")
    return model, hf_tok


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_tadm_ar_checkpoint_loads_and_matches_the_model(tmp_path):
    directory = save_ar_evaluator(tmp_path / "ar")
    ev = load_evaluator(directory)
    assert ev.backend == "tadm" and ev.context_size == 64
    assert ev.end_ids == frozenset({tiny_tokenizer().eos_id})
    ids = torch.tensor([tiny_tokenizer().encode("The jury said Friday.")])
    out = ev.forward(ids, torch.ones_like(ids), hidden=True)
    torch.testing.assert_close(out.logits, tiny_ar()(ids))
    assert out.hidden is not None and out.hidden.shape == (1, ids.shape[1], 32)


def test_tadm_encode_keeps_end_of_text_as_the_eos_id():
    ev = tiny_ar_evaluator()
    tok = tiny_tokenizer()
    ids = ev.encode(["ab<|endoftext|>cd"])[0]
    assert ids == tok.encode("ab") + [tok.eos_id] + tok.encode("cd")
    # TextTokenizer alone would spell the separator out in bytes
    assert tok.eos_id not in tok.encode("ab<|endoftext|>cd")


def test_hf_directory_loads_and_matches_the_model(tmp_path):
    model, hf_tok = tiny_hf_gpt2()
    model.save_pretrained(tmp_path / "gpt2")
    hf_tok.save_pretrained(tmp_path / "gpt2")
    ev = load_evaluator(tmp_path / "gpt2")
    assert ev.backend == "transformers" and ev.context_size == 64
    assert tiny_tokenizer().eos_id in ev.end_ids
    ids = torch.tensor([ev.encode(["The jury said Friday."])[0]])
    expected = model(ids).logits
    torch.testing.assert_close(ev.forward(ids, torch.ones_like(ids)).logits, expected)


def test_context_size_is_capped_at_1024_and_by_request():
    model, hf_tok = tiny_hf_gpt2()
    assert evaluator_from_hf(model, hf_tok, name="x").context_size == 64
    assert evaluator_from_hf(model, hf_tok, name="x", context_size=16).context_size == 16
    big = ar_tiny(vocab_size=tiny_tokenizer().vocab_size - 1, max_seq_len=4096)
    assert evaluator_from_ar_model(big, tiny_tokenizer(), name="big").context_size == 1024


def test_missing_evaluator_path_is_a_clear_one_line_error(tmp_path):
    missing = tmp_path / "nowhere" / "evaluator"
    with pytest.raises(FileNotFoundError) as err:
        load_evaluator(missing)
    message = str(err.value)
    assert str(missing) in message and "--evaluator PATH" in message and "prepare-evaluator" in message
    assert "\n" not in message


def test_unprepared_default_evaluator_names_the_prepare_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TADM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="smollm2-135m.*not prepared.*prepare-evaluator") as err:
        load_evaluator(None)
    assert str(tmp_path / "cache" / "evaluators" / "smollm2-135m") in str(err.value)


def test_directory_without_a_model_is_rejected(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_evaluator(tmp_path / "empty")


def test_diffusion_checkpoint_is_not_an_evaluator(tmp_path):
    tiny_diffusion("mdlm").save_pretrained(tmp_path / "mdlm")
    tiny_tokenizer().save(tmp_path / "mdlm")
    with pytest.raises(ValueError, match="must be autoregressive"):
        load_evaluator(tmp_path / "mdlm")


def test_forward_rejects_chunks_longer_than_the_context():
    ev = tiny_ar_evaluator(max_seq_len=64)
    ids = torch.zeros((1, 65), dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds the evaluator context"):
        ev.forward(ids, torch.ones_like(ids))


def test_prepare_is_a_no_op_when_already_prepared_and_checks_local_files(tmp_path):
    dest = tmp_path / "prepared"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    (dest / "tadm_evaluator.json").write_text('{"preset": "smollm2-135m"}')  # the marker tadm writes
    messages: list[str] = []
    assert prepare_default_evaluator(dest=dest, log=messages.append) == dest
    assert "already prepared" in messages[0]
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        prepare_default_evaluator(dest=tmp_path / "other", gguf=tmp_path / "missing.gguf", log=messages.append)
    with pytest.raises(ValueError, match="unknown evaluator preset"):
        prepare_default_evaluator("gpt-9", log=messages.append)
