"""``tadm eval tasks``'s runner: units x K x seeds x naive, accuracy, resume, the two tables."""

from __future__ import annotations

import csv
import json
import re

import pytest

import tadm.tasks.task_tables as task_tables_mod
from tadm.tasks.runner import TaskRunConfig, methods, run_tasks
from tadm.eval.significance import sign_test
from tadm.tasks.task_tables import prompt_comparison
from tests.tasks.fakes import FakeGenerator
from tests.tasks.test_datasets import GSM, write_jsonl

GPQA = [{"question": f"Pick {c}", "choices": ["w", "x", "y", "z"], "answer": c} for c in "ABCD"]
HUMANEVAL = [{"task_id": f"he/{n}", "prompt": f"def add{n}(a, b):\n", "entry_point": f"add{n}",
              "test": "def check(f):\n    assert f(2, 3) == 5\n"} for n in range(2)]


@pytest.fixture()
def data_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "gsm8k.jsonl", GSM)
    write_jsonl(data / "gpqa.jsonl", GPQA)
    write_jsonl(data / "humaneval.jsonl", HUMANEVAL)
    return data


def known_answers(prompt: str, run: dict) -> str:
    """TADM: right on GSM8K and HumanEval, GPQA wrong at K = 2 unless the answer is A; naive reuse: GSM8K and
    HumanEval wrong."""
    asked = re.findall(r"What is (\d+) \+ 1\?", prompt)
    if asked:
        value = int(asked[-1]) + 1 + (1 if run["naive"] else 0)
        return f"{asked[-1]} + 1 = {value}. The answer is {value}."
    picked = re.findall(r"Pick ([A-D])", prompt)
    if picked:
        return f"The answer is ({'A' if run['K'] == 2 and picked[-1] != 'A' else picked[-1]})."
    return "    return a + b\n" if not run["naive"] else "    return a - b\n"


def config(data_dir, out, **overrides):
    settings = dict(tasks="gsm8k,gpqa,humaneval", base="BASE", adapter="ADAPTER", naive=True, refresh=[1, 2],
                    seeds=[0, 1], data_dir=str(data_dir), out_dir=str(out), allow_code_execution=True)
    return TaskRunConfig(**{**settings, **overrides})


def run_fake(cfg, loads=None):
    def load(cfg, with_adapter):
        if loads is not None:
            loads.append(with_adapter)
        return FakeGenerator(known_answers)

    return run_tasks(cfg, load=load, log=lambda line: None, command="tadm eval tasks --fake")


def test_methods_per_model_kind():
    assert [m.key for m in methods(TaskRunConfig(base="b", adapter="a", naive=True, refresh=[1, 3]))] == [
        "baseline-K1", "tadm-K1", "tadm-K3", "naive-K1", "naive-K3"]
    assert [m.key for m in methods(TaskRunConfig(base="b"))] == ["baseline-K1"]
    assert [m.key for m in methods(TaskRunConfig(model="m", refresh=[1, 2]))] == ["tadm-K1", "tadm-K2"]


@pytest.mark.slow
def test_any_refresh_spec_is_a_method_and_its_key_names_the_units(data_dir, tmp_path):
    cfg = config(data_dir, tmp_path / "out", tasks="gsm8k", naive=False, seeds=[0],
                 refresh=[1, "adaptive:tau=0.25", {"policy": "fixed", "K": 2}])
    assert [(m.key, m.K) for m in methods(cfg)] == [
        ("baseline-K1", 1), ("tadm-K1", 1), ("tadm-Kadaptive-tau0.25", "adaptive-tau0.25"), ("tadm-K2", 2)]
    out = run_fake(cfg)
    assert sorted(p.name for p in (tmp_path / "out" / "units" / "gsm8k").glob("*.json")) == [
        "baseline-K1-seed0.json", "tadm-K1-seed0.json", "tadm-K2-seed0.json", "tadm-Kadaptive-tau0.25-seed0.json"]
    assert sorted(str(u["K"]) for u in out.units) == ["1", "1", "2", "adaptive-tau0.25"]
    with pytest.raises(ValueError, match="K: the same refresh policy is listed twice: 2, 2"):
        config(data_dir, tmp_path, refresh=[2, {"policy": "fixed", "K": 2}]).check()


@pytest.mark.slow
def test_accuracy_tables_and_resume(data_dir, tmp_path):
    out, loads = tmp_path / "out", []
    result = run_fake(config(data_dir, out), loads)
    assert loads == [True]  # one load of base + adapter: the baseline, every K, seed and naive reuse it
    assert result.ran == len(result.units) == 3 * (1 + 2 + 2) * 2
    cells = {(c["task"], c["method"], c["K"]): c for c in json.loads((out / "results.json").read_text())["cells"]}
    assert cells["gsm8k", "tadm", 2]["accuracy_mean"] == 1.0 and cells["gsm8k", "naive", 1]["accuracy_mean"] == 0.0
    assert cells["gsm8k", "tadm", 1]["examples"] == 3  # 8 records, the first 5 are the shots
    assert cells["gpqa", "tadm", 2]["accuracy_mean"] == 0.25 and cells["gpqa", "tadm", 1]["accuracy_mean"] == 1.0
    assert cells["humaneval", "tadm", 1]["accuracy_mean"] == 1.0
    assert cells["humaneval", "naive", 2]["accuracy_mean"] == 0
    assert cells["gsm8k", "tadm", 2]["layer_calls_per_request"] == 6 and cells["gsm8k", "tadm", 2]["seeds"] == 2

    table = (out / "table.md").read_text()
    assert "| TADM, K=2 | 100.0 ± 0.0 | 25.0 ± 0.0 | 100.0 ± 0.0 |" in table
    assert "## Naive reuse vs TADM" in table and "| 1 | 33.3 | - | - | - | 100.0 | - | - | - |" in table
    rows = list(csv.DictReader((out / "task_table.csv").open()))
    assert [r["method"] for r in rows] == ["Base, K=1", "TADM, K=1", "TADM, K=2"]
    assert float(rows[2]["compute"]) == 0.5 and float(rows[2]["GPQA-Diamond mean"]) == 0.25
    assert len(list(csv.DictReader((out / "cells.csv").open()))) == 3 * 5
    assert len(list(csv.DictReader((out / "naive_table.csv").open()))) == 2
    assert result.files["plot"] == out / "accuracy_vs_k.png"
    assert (out / "accuracy_vs_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    unit = json.loads((out / "units" / "gsm8k" / "naive-K1-seed0.json").read_text())
    assert unit["spec"]["K"] == 1 and unit["records"][0]["extracted"] == "1005" and not unit["records"][0]["correct"]
    # the paired columns count distinct prompts: per (task, prompt), TADM's mean correctness minus naive's
    naive_table = {int(r["K"]): r for r in csv.DictReader((out / "naive_table.csv").open())}
    for K in (1, 2):
        per_prompt: dict[tuple, list[float]] = {}
        for unit_file in (out / "units").glob(f"*/tadm-K{K}-seed*.json"):
            tadm_records = json.loads(unit_file.read_text())["records"]
            naive_file = unit_file.with_name(unit_file.name.replace("tadm-", "naive-"))
            naive_records = json.loads(naive_file.read_text())["records"]
            for t, n in zip(tadm_records, naive_records):
                per_prompt.setdefault((unit_file.parent.name, t["prompt"]), []).append(t["correct"] - n["correct"])
        diffs = [sum(v) / len(v) for v in per_prompt.values()]
        ahead, behind = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        assert int(naive_table[K]["prompts"]) == len(per_prompt)
        assert naive_table[K]["prompts TADM / naive ahead"] == f"{ahead} / {behind}"
        assert float(naive_table[K]["sign test p (prompts)"]) == pytest.approx(sign_test(ahead, behind), rel=0.03)
        assert naive_table[K]["TADM - naive (pp, 95% CI)"].startswith(f"{100 * sum(diffs) / len(diffs):+.1f} [")
    assert ahead + behind > 0
    # the tables say how they were made: command, machine, commit, wall time
    provenance = json.loads((out / "results.json").read_text())["provenance"]
    assert provenance["command"] == "tadm eval tasks --fake" and provenance["machine"]["cpu_count"] >= 1
    assert "commit" in provenance and provenance["wall_seconds"] >= 0
    assert "- Command: `tadm eval tasks --fake` (a rerun skips finished units)" in table
    assert "- Machine: " in table and "- Commit: `" in table and "s of generation over all units" in table

    again = []
    assert run_fake(config(data_dir, out), again).ran == 0 and again == []  # finished units are skipped
    more = run_fake(config(data_dir, out, seeds=[0, 1, 2]), again)
    assert more.ran == 3 * 5 and again == [True]
    changed = run_fake(config(data_dir, out, max_gen_toks=64))  # another spec: every unit runs again
    assert changed.ran == 3 * 5 * 2


def test_without_matplotlib_the_tables_are_written_and_the_plot_skipped(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(task_tables_mod, "can_plot", lambda: False)
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="plots skipped: matplotlib is not installed"):
        result = run_fake(config(data_dir, out, tasks="gsm8k", seeds=[0]))
    assert "plot" not in result.files and not (out / "accuracy_vs_k.png").exists()
    assert (out / "table.md").is_file() and json.loads((out / "results.json").read_text())["cells"]


def test_the_table_states_the_generation_length_used(data_dir, tmp_path):
    run_fake(config(data_dir, tmp_path / "paper", tasks="gsm8k,gpqa", naive=False, refresh=[1], seeds=[0]))
    assert "Benchmarks: GSM8K (5-shot, 1024 tokens, accuracy), GPQA-Diamond (0-shot, 2048 tokens, accuracy)." in (
        tmp_path / "paper" / "table.md").read_text()
    run_fake(config(data_dir, tmp_path / "cap", tasks="gsm8k,gpqa", naive=False, refresh=[1], seeds=[0],
                    max_gen_toks=1536))
    table = (tmp_path / "cap" / "table.md").read_text()
    assert ("Benchmarks: GSM8K (5-shot, 1024 tokens, accuracy), "
            "GPQA-Diamond (0-shot, 1536 tokens, capped from 2048, accuracy).") in table


def test_a_changed_data_file_reruns_its_task(data_dir, tmp_path):
    out = tmp_path / "out"
    run_fake(config(data_dir, out, tasks="gpqa", naive=False, seeds=[0]))
    write_jsonl(data_dir / "gpqa.jsonl", GPQA[:3])
    assert run_fake(config(data_dir, out, tasks="gpqa", naive=False, seeds=[0])).ran == 3


def test_the_judge_adds_corruption(data_dir, tmp_path, monkeypatch):
    from tadm.tasks import runner

    class Judge:
        judge_id = "fake-judge"

        def complete(self, messages):
            response = messages[0]["content"].split("<response>")[-1]
            looped = "1007" in response  # naive reuse's answer to the last question
            return json.dumps({"incoherent": False, "repetition_loop": looped, "evidence": [], "brief_reason": ""})

    monkeypatch.setattr(runner, "_judge_client", lambda cfg: Judge())
    out = tmp_path / "out"
    run_fake(config(data_dir, out, tasks="gsm8k", seeds=[0], judge="local"))
    cells = {(c["task"], c["method"], c["K"]): c for c in json.loads((out / "results.json").read_text())["cells"]}
    assert cells["gsm8k", "naive", 1]["corruption"] == pytest.approx(1 / 3)
    assert cells["gsm8k", "tadm", 1]["corruption"] == 0.0 and cells["gsm8k", "tadm", 1]["judged"] == 3
    table = (out / "table.md").read_text()
    assert "| 1 | 0.0 | 33.3 | 0.0 | 0/3 | 100.0 | 0.0 | 0.0 | 0/3 |" in table
    assert "- Judge: `fake-judge` (the default local judge (SmolLM2-135M-Instruct) does not tell" in table


def test_a_judge_whose_answers_never_parse_is_reported_as_such(data_dir, tmp_path, monkeypatch):
    from tadm.tasks import runner

    class Chatty:
        judge_id = "chatty-judge"

        def complete(self, messages):
            return "The answer is 42."

    monkeypatch.setattr(runner, "_judge_client", lambda cfg: Chatty())
    out = tmp_path / "out"
    run_fake(config(data_dir, out, tasks="gsm8k", seeds=[0], judge="local"))
    table = (out / "table.md").read_text()
    assert "| 1 | 0.0 | no verdict parsed | - | 3/3 | 100.0 | no verdict parsed | - | 3/3 |" in table


@pytest.mark.slow
def test_the_table_marks_a_code_task_where_timeouts_dominate(data_dir, tmp_path):
    """More than half the programs of a cell timed out: its accuracy gets a mark and a note naming the limit, the
    log says so, and the unit's spec holds the limit (a rerun with another one scores again)."""
    def answer(prompt, run):
        return "    while True:\n        pass\n" if run["K"] == 2 else "    return a + b\n"

    out, lines = tmp_path / "out", []
    run_tasks(config(data_dir, out, tasks="humaneval", naive=False, refresh=[1, 2], seeds=[0], code_timeout=2),
              load=lambda cfg, with_adapter: FakeGenerator(answer), log=lines.append)
    table = (out / "table.md").read_text()
    assert "| TADM, K=2 | 0.0 ± 0.0 † |" in table and "| TADM, K=1 | 100.0 ± 0.0 |" in table
    assert "† Time-outs dominate: more than half the programs timed out" in table
    assert "- HumanEval, TADM, K=2: 2 of 2 programs timed out at --code-timeout 2 s\n" in table
    results = json.loads((out / "results.json").read_text())
    assert results["timeout_notes"] == ["HumanEval, TADM, K=2: 2 of 2 programs timed out at --code-timeout 2 s"]
    assert {(c["method"], c["K"]): c["timeouts"] for c in results["cells"]} == {("baseline", 1): 0, ("tadm", 1): 0,
                                                                                  ("tadm", 2): 2}
    assert any("2 of 2 programs timed out at --code-timeout 2 s" in line for line in lines)
    unit = json.loads((out / "units" / "humaneval" / "tadm-K2-seed0.json").read_text())
    assert unit["spec"]["code_timeout"] == 2 and unit["records"][0]["detail"] == "timeout"


def test_code_tasks_on_a_sandbox_with_gaps_need_each_gap_accepted(data_dir, tmp_path, monkeypatch):
    from tadm.tasks import runner
    from tadm.tasks.sandbox import Containment

    monkeypatch.setattr(runner, "containment", lambda: Containment(False, 0, True))
    with pytest.raises(ValueError, match="^humaneval: this machine's code sandbox \\(seccomp\\) does not contain "
                                         "file-writes \\(the program can write wherever the user can"):
        config(data_dir, tmp_path, tasks="humaneval").check()
    with pytest.raises(ValueError, match="--allow-uncontained-code signals$"):
        config(data_dir, tmp_path, tasks="humaneval", allow_uncontained_code=["file-writes", "process-files"]).check()
    accepted = ["file-writes", "process-files", "signals"]
    config(data_dir, tmp_path, tasks="humaneval", allow_uncontained_code=accepted).check()


def test_bad_settings_are_errors(data_dir, tmp_path):
    with pytest.raises(ValueError, match="exactly one of --base"):
        run_fake(TaskRunConfig(tasks="gsm8k", data_dir=str(data_dir), out_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="K must be"):
        run_fake(config(data_dir, tmp_path, refresh=[0]))
    with pytest.raises(ValueError, match="--adapter, --split, --naive and --canvas-length apply"):
        run_fake(TaskRunConfig(model="m", naive=True, data_dir=str(data_dir), out_dir=str(tmp_path)))


@pytest.mark.parametrize("settings,message", [
    ({"base": "b", "adapter": "a", "split": "2:20"}, "give --adapter or --split, not both"),
    ({"model": "m", "seeds": []}, "seeds must be a non-empty list of integers >= 0, got \\[\\]"),
    ({"model": "m", "seeds": [0, -1]}, "seeds must be a non-empty list of integers >= 0"),
    ({"model": "m", "limit": 0}, "limit must be >= 1, got 0"),
    ({"model": "m", "judge": "gpt4"}, "unknown judge 'gpt4': use none, local, local:PATH"),
    ({"model": "m", "refresh": ["adaptive:tau=-1"]}, "^K: "),
])
def test_each_bad_setting_is_named_before_anything_runs(settings, message):
    with pytest.raises(ValueError, match=message):
        TaskRunConfig(tasks="gsm8k", **settings).check()


@pytest.mark.slow
def test_a_tiny_base_and_adapter_end_to_end(base_dir, adapter_dir, data_dir, tmp_path):
    """The real generators (tiny base, its adapter, naive reuse) through the runner: tables and stats."""
    cfg = config(data_dir, tmp_path / "out", base=str(base_dir), adapter=str(adapter_dir), seeds=[0], limit=2,
                 steps=2, canvas_length=8, max_gen_toks=8, device="cpu")
    cfg.tasks = "gsm8k,gpqa"
    result = run_tasks(cfg, log=lambda line: None)
    assert result.ran == 2 * 5
    for unit in result.units:
        assert unit["n"] == 2 and 0.0 <= unit["accuracy"] <= 1.0
        assert unit["stats"]["requests"] == 2 and unit["stats"]["layer_calls"]["total"] > 0
    stored = json.loads((tmp_path / "out" / "units" / "gpqa" / "naive-K2-seed0.json").read_text())
    assert stored["stats"]["settings"]["fusion_mode"] == "naive"
    assert stored["stats"]["settings"]["refresh_policy"]["interval"] == 2
    tadm = json.loads((tmp_path / "out" / "units" / "gpqa" / "tadm-K2-seed0.json").read_text())
    assert tadm["stats"]["settings"]["fusion_mode"] == "paired" and tadm["stats"]["settings"]["canvas_length"] == 8
    assert (tmp_path / "out" / "table.md").is_file()


def test_prompt_comparison_pairs_units_by_task_and_seed_and_counts_prompts():
    def unit(method, seed, correct, prompts, task="t", K=2):
        return {"task": task, "method": method, "K": K, "seed": seed, "correct": correct, "prompts": prompts}

    p = ["a", "a", "b", "c"]  # four items, three distinct prompts
    units = [unit("tadm", 0, [True, True, False, False], p), unit("naive", 0, [True, False, True, False], p),
             unit("tadm", 1, [True, True, True, True], p), unit("naive", 1, [False, False, False, True], p),
             unit("tadm", 2, [False], ["a"]), unit("naive", 5, [True], ["a"]), unit("naive", 0, [True] * 4, p, K=3)]
    s = prompt_comparison(units, 2)  # seeds 2 and 5 have no partner
    # a: tadm 4/4, naive 1/4 -> +0.75; b: tadm 1/2, naive 1/2 -> 0; c: tadm 1/2, naive 1/2 -> 0
    assert (s.units, s.ahead, s.behind, s.tied) == (3, 1, 0, 2)
    assert s.mean == pytest.approx(0.25) and s.sign_p == 1.0
    assert prompt_comparison(units, 3) is None
    assert prompt_comparison([unit("tadm", 0, None, None), unit("naive", 0, None, None)], 2) is None
