"""Argument-level checks of scripts/*.py: bad inputs fail in one line, options mean what their help says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def posttrain_demo():
    return load_script("posttrain_demo")


def one_line_error(capsys, call) -> str:
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_posttrain_demo_quick_keeps_explicit_options(posttrain_demo):
    quick = posttrain_demo.parse_args(["--quick", "--pretrain-steps", "100", "--eval-canvases", "40"])
    assert (quick.pretrain_steps, quick.posttrain_steps, quick.eval_canvases) == (100, 10, 40)
    full = posttrain_demo.parse_args([])
    assert (full.pretrain_steps, full.posttrain_steps, full.eval_canvases) == (600, 500, 128)


def test_posttrain_demo_first_loss_averages_the_steps_there_were(posttrain_demo):
    assert posttrain_demo.first_last_loss([1.0, 3.0]) == [2.0, 2.0]
    assert posttrain_demo.first_last_loss([float(n) for n in range(100)]) == [9.5, 74.5]


def test_posttrain_demo_bad_sizes_fail_in_its_own_terms(posttrain_demo, capsys):
    from tadm.training.tokenization import train_bpe_tokenizer

    err = one_line_error(capsys, lambda: posttrain_demo.parse_args(["--vocab-size", "3"]))
    assert "argument --vocab-size: must be >= 262, got 3" in err and "-1" not in err
    err = one_line_error(capsys, lambda: posttrain_demo.parse_args(["--threads", "0"]))
    assert "argument --threads: must be >= 1, got 0" in err
    smallest = posttrain_demo.parse_args(["--vocab-size", str(posttrain_demo.MIN_VOCAB_SIZE)]).vocab_size
    train_bpe_tokenizer(["a few words of text"] * 3, vocab_size=smallest - len(posttrain_demo.CHAT_SPECIAL_TOKENS))
