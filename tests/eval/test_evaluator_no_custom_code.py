"""Hugging Face directories and ids are loaded without running their code (``trust_remote_code=False``).

A directory whose config or tokenizer config maps classes to its own Python file is refused in
one line; the file (which would create a sentinel file when imported) never runs, and nothing
prompts on the terminal.
"""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import transformers

from tadm.cli import main
from tadm.eval.evaluator import load_evaluator
from tadm.specs import load_hf_tokenizer

PAYLOAD = '''
from pathlib import Path
Path({sentinel!r}).write_text("custom code ran")
from transformers import PretrainedConfig, PreTrainedTokenizerFast
class EvilConfig(PretrainedConfig):
    model_type = "evil"
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
'''


@pytest.fixture(autouse=True)
def no_prompt(monkeypatch):
    """Any interactive question is a test failure."""

    def refuse(*args, **kwargs):
        raise AssertionError("tadm asked an interactive question")

    monkeypatch.setattr(builtins, "input", refuse)


def with_payload(directory: Path, config: dict | None = None, tokenizer_config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "evil.py").write_text(PAYLOAD.format(sentinel=str(directory / "PWNED")))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def tiny_llama(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<|endoftext|>", "the", "cat"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|endoftext|>")
    config = transformers.LlamaConfig(vocab_size=4, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


EVIL_MODEL = {"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                  "AutoModelForCausalLM": "evil.EvilModel"}}


def test_an_evaluator_directory_that_needs_custom_code_is_refused(tmp_path):
    directory = with_payload(tmp_path / "evil", config=EVIL_MODEL)
    with pytest.raises(ValueError, match="needs custom code") as info:
        load_evaluator(directory)
    assert str(directory) in str(info.value) and "\n" not in str(info.value)
    assert not (directory / "PWNED").exists()


def test_the_cli_refuses_it_in_one_line(tmp_path, capsys):
    directory = with_payload(tmp_path / "evil", config=EVIL_MODEL)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n")
    code = main(["eval", "gen-ppl", "--texts", str(texts), "--evaluator", str(directory), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "custom code" in err and str(directory) in err
    assert not (directory / "PWNED").exists()


def test_a_known_architecture_loads_its_built_in_class_and_ignores_auto_map(tmp_path):
    directory = tiny_llama(tmp_path / "llama")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel", "AutoConfig": "evil.EvilConfig"}
    with_payload(directory, config=config)
    evaluator = load_evaluator(directory)
    assert type(evaluator.model).__name__ == "LlamaForCausalLM" and evaluator.vocab_size == 4
    assert not (directory / "PWNED").exists()


def test_a_tokenizer_that_needs_custom_code_is_refused(tmp_path):
    directory = with_payload(tmp_path / "tok", tokenizer_config={
        "tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": [None, "evil.EvilTokenizer"]}})
    with pytest.raises(ValueError, match="needs custom code") as info:
        load_hf_tokenizer(directory)
    assert str(directory) in str(info.value) and "\n" not in str(info.value)
    assert not (directory / "PWNED").exists()


@pytest.mark.parametrize("spec, needle", [("./no/such/dir", "does not exist"), ("notes.txt", "is a file"),
                                          (".", "not a saved Hugging Face directory")])
def test_a_missing_tokenizer_is_a_one_line_error(tmp_path, monkeypatch, spec, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    with pytest.raises(FileNotFoundError, match=needle) as info:
        load_hf_tokenizer(spec)
    assert spec in str(info.value)


def test_trust_remote_code_false_is_passed_explicitly(tmp_path, monkeypatch):
    directory = tiny_llama(tmp_path / "llama")
    seen = []

    def record(kind, result):
        def from_pretrained(source, **kwargs):
            seen.append((kind, kwargs.get("trust_remote_code", "absent")))
            if isinstance(result, Exception):
                raise result
            return result
        return from_pretrained

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record("tokenizer", object()))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record("model", OSError("stop here")))
    with pytest.raises(FileNotFoundError, match="stop here"):
        load_evaluator(directory)
    assert seen == [("tokenizer", False), ("model", False)]


def test_a_hub_repository_that_needs_custom_code_is_a_one_line_error(monkeypatch):
    def remote_code(source, **kwargs):
        assert kwargs["trust_remote_code"] is False
        raise ValueError(f"The repository {source} contains custom code which must be executed to correctly load "
                         "the model.\nPlease pass the argument `trust_remote_code=True` to allow custom code to be run.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", remote_code)
    with pytest.raises(ValueError, match="'owner/evil' needs custom code") as info:
        load_evaluator("owner/evil")
    assert "\n" not in str(info.value)
