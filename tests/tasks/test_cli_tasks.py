"""``tadm eval tasks``: one-line errors (exit 2) for bad input, and a run on local files with a tiny base."""

from __future__ import annotations

import json

import pytest

from tadm.cli import main
from tests.tasks.test_datasets import write_jsonl
from tests.tasks.test_runner import GPQA


def one_line_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_unknown_task(capsys, tmp_path):
    argv = ["eval", "tasks", "--base", "B", "--tasks", "gsm8k,squad", "--data-dir", str(tmp_path)]
    err = one_line_error(capsys, argv)
    assert "unknown task 'squad'" in err and "known tasks: gsm8k, humaneval" in err


def test_missing_data_file(capsys, tmp_path):
    err = one_line_error(capsys, ["eval", "tasks", "--base", "B", "--tasks", "humaneval", "--data-dir", str(tmp_path),
                                       "--allow-code-execution"])
    assert str(tmp_path / "humaneval.jsonl") in err and "prompt, test, entry_point" in err


def test_malformed_data_line(capsys, tmp_path):
    (tmp_path / "aime.jsonl").write_text('{"problem": "p", "answer": 1}\n{not json\n')
    err = one_line_error(capsys, ["eval", "tasks", "--base", "B", "--tasks", "aime", "--data-dir", str(tmp_path)])
    assert "aime.jsonl:2: not valid JSON" in err


@pytest.mark.parametrize("flag, value", [("-K", "0"), ("-K", "1,x"), ("--refresh", ""), ("--seeds", "-1")])
def test_bad_K_and_seeds(capsys, flag, value):
    err = one_line_error(capsys, ["eval", "tasks", "--base", "B", flag, value])
    assert "error" in err and (flag in err or "--refresh" in err)


def test_base_and_model_are_exclusive(capsys):
    one_line_error(capsys, ["eval", "tasks", "--base", "B", "--model", "M"])
    for flags in (["--naive"], ["--canvas-length", "16"]):  # a tadm model samples at its own length
        err = one_line_error(capsys, ["eval", "tasks", "--model", "M", *flags, "--tasks", "gpqa"])
        assert err.endswith("--adapter, --split, --naive and --canvas-length apply to a post-training base (--base)")


@pytest.mark.slow
def test_a_run_on_local_files(capsys, tmp_path, base_dir, adapter_dir):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "gpqa.jsonl", GPQA)
    argv = ["eval", "tasks", "--base", str(base_dir), "--adapter", str(adapter_dir), "--tasks", "gpqa",
            "--data-dir", str(data), "-K", "1,2", "--seeds", "0", "--naive", "--limit", "2", "--steps", "2",
            "--canvas-length", "8", "--max-gen-toks", "8", "--device", "cpu", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    assert "5 units (5 run now)" in capsys.readouterr().out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {(c["method"], c["K"]) for c in results["cells"]} == {
        ("baseline", 1), ("tadm", 1), ("tadm", 2), ("naive", 1), ("naive", 2)}
    assert main(argv) == 0 and "5 units (0 run now)" in capsys.readouterr().out


def test_the_former_network_opt_in_names_what_replaced_it(capsys):
    err = one_line_error(capsys, ["eval", "tasks", "--base", "b", "--allow-code-network"])
    assert "--allow-code-network was replaced by --allow-uncontained-code GAP[,GAP]" in err and "local-sockets" in err
