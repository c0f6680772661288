"""A post-training base model that is missing, not a model directory, of the wrong kind or needing custom
code is a one-line error naming the path (``tadm posttrain train`` / ``sample --base``)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from tadm.cli import main
from tadm.config import PRESET_DIR
from tadm.posttrain.backbone import load_backbone

from .conftest import build_tiny_gemma, tiny_chat_tokenizer


@pytest.fixture(autouse=True)
def no_prompt(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tadm asked an interactive question")

    monkeypatch.setattr(builtins, "input", refuse)


@pytest.fixture(scope="module")
def saved_gemma(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("base") / "gemma"
    build_tiny_gemma().save_pretrained(base)
    tiny_chat_tokenizer().save_pretrained(base)
    return base


def bad_bases(root: Path, gemma: Path) -> dict[str, tuple[Path | str, str]]:
    """Base-model paths that are not usable, each with a phrase its error must contain."""
    (root / "notes.txt").write_text("not a model")
    (root / "empty").mkdir()
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "no-weights").mkdir()
    (root / "no-weights" / "config.json").write_text((gemma / "config.json").read_text())
    evil = root / "evil"
    evil.mkdir()
    (evil / "evil.py").write_text(f"open({str(evil / 'PWNED')!r}, 'w').write('ran')\n")
    (evil / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.C"}}))
    return {
        "missing": (root / "no" / "such" / "model", "does not exist"),
        "relative-missing": ("./no-such-base", "does not exist"),
        "file": (root / "notes.txt", "is a file"),
        "empty-dir": (root / "empty", "not a saved Hugging Face directory"),
        "wrong-kind": (root / "llama", "'llama' checkpoint"),
        "broken-config": (root / "broken", "not valid JSON"),
        "no-weights": (root / "no-weights", "could not load base model"),
        "custom-code": (evil, "custom code"),
    }


CASES = ["missing", "relative-missing", "file", "empty-dir", "wrong-kind", "broken-config", "no-weights",
         "custom-code"]


@pytest.fixture
def bases(tmp_path, saved_gemma, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return bad_bases(tmp_path, saved_gemma)


@pytest.mark.parametrize("case", CASES)
def test_load_backbone_names_the_path(bases, case):
    path, needle = bases[case]
    with pytest.raises((FileNotFoundError, ValueError), match=needle) as info:
        load_backbone("diffusion-gemma", path, dtype="fp32")
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert not (bases["custom-code"][0] / "PWNED").exists()


@pytest.mark.parametrize("case", ["missing", "file", "empty-dir", "wrong-kind"])
def test_an_mdlm_base_names_the_path(bases, case):
    path, needle = bases[case]
    needle = "'llama' checkpoint; this backbone loads 'mdlm'" if case == "wrong-kind" else needle
    with pytest.raises((FileNotFoundError, ValueError), match=needle) as info:
        load_backbone("mdlm", path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("case", CASES)
def test_posttrain_sample_gives_one_line(bases, case, capsys):
    path, needle = bases[case]
    # a split that fits the tiny base, so that what is wrong with the base (not the split) is what is said
    code = main(["posttrain", "sample", "--base", str(path), "--prompt", "hello", "--device", "cpu", "--split", "1,3"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert needle in err and str(path) in err


@pytest.mark.parametrize("case", ["missing", "empty-dir", "custom-code"])
def test_posttrain_train_gives_one_line(bases, case, tmp_path, capsys):
    path, needle = bases[case]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "hello", "response": "the cat sat"}) + "\n")
    code = main(["posttrain", "train", str(PRESET_DIR / "posttrain-tiny.yaml"), f"base.path={path}",
                 f"data.train_file={chat}", f"train.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert needle in err and str(path) in err


def test_a_tokenizer_without_a_chat_template_is_one_line_for_both_priors(tmp_path, capsys):
    from tadm.nn import mdlm_tiny
    from tadm.training.tokenization import train_bpe_tokenizer

    plain = tmp_path / "plain"
    tokenizer = train_bpe_tokenizer(["the cat sat on the mat"] * 20, vocab_size=280)
    tokenizer.save(plain)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "hello", "response": "the cat sat"}) + "\n")
    build_tiny_gemma().save_pretrained(tmp_path / "gemma")
    code = main(["posttrain", "train", str(PRESET_DIR / "posttrain-tiny.yaml"), f"base.path={tmp_path / 'gemma'}",
                 f"data.tokenizer={plain}", f"data.train_file={chat}", f"train.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"the tokenizer of {plain} has no chat template" in err.strip().splitlines()[-1]
    # tadm's own MDLM (the mask prior, rolled out with its MDLM sampler) reaches the same tokenizer check
    mdlm_tiny(vocab_size=tokenizer.vocab_size).save_pretrained(tmp_path / "mdlm")
    code = main(["posttrain", "train", str(PRESET_DIR / "posttrain-tiny.yaml"), "base.backbone=mdlm",
                 f"base.path={tmp_path / 'mdlm'}", f"data.tokenizer={plain}", f"data.train_file={chat}",
                 f"train.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"the tokenizer of {plain} has no chat template" in err.strip().splitlines()[-1]


def test_an_unreachable_hub_id_names_it(monkeypatch):
    from transformers import DiffusionGemmaForBlockDiffusion

    def offline(source, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "from_pretrained", offline)
    with pytest.raises(FileNotFoundError, match="could not load base model 'no-such-owner/no-such-model'") as info:
        load_backbone("diffusion-gemma", "no-such-owner/no-such-model")
    assert "couldn't connect" in str(info.value) and "\n" not in str(info.value)


def test_a_good_base_loads_with_trust_remote_code_false(saved_gemma, monkeypatch):
    from transformers import DiffusionGemmaForBlockDiffusion

    seen = {}
    real = DiffusionGemmaForBlockDiffusion.from_pretrained

    def record(source, **kwargs):
        seen.update(kwargs)
        return real(source, **kwargs)

    monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "from_pretrained", record)
    backbone = load_backbone("diffusion-gemma", saved_gemma, dtype="fp32")
    assert seen["trust_remote_code"] is False and backbone.num_layers == 6
