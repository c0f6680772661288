"""benchmarks/gpu_campaign.py: its plan, its bad inputs, and every stage end to end at tiny sizes on CPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_campaign.py"


def _run(*args: str, env_out: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = None
    if env_out is not None:
        import os

        env = {**os.environ, "OUT": str(env_out), "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_the_plan_names_every_stage_and_its_minutes():
    run = _run("--plan")
    assert run.returncode == 0
    spec = importlib.util.spec_from_file_location("gpu_campaign", SCRIPT)
    campaign = importlib.util.module_from_spec(spec)
    sys.modules["gpu_campaign"] = campaign  # dataclasses look their module up
    spec.loader.exec_module(campaign)
    for stage in campaign.STAGES.values():
        assert f"| {stage.key} | {stage.plan} | {stage.minutes:.1f} |" in run.stdout
        assert stage.minutes < 9  # each fits a 10-minute command with room for the start
    assert sum(s.minutes for s in campaign.STAGES.values()) <= 30
    for stage in campaign.OPTIONAL_STAGES.values():  # named to run; not part of the 8 files of --stage all
        assert f"| {stage.key} (optional, run with --stage {stage.key}) | {stage.plan} |" in run.stdout
        assert stage.minutes < 9 and stage.key not in campaign.STAGES


@pytest.mark.parametrize("args, needle", [
    (["--stage", "f", "--device", "cpu"], "unknown stage 'f'; valid: a, b, c, d or all, and the optional e"),
    (["--device", "cuda:7"], "cuda:7"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--stage", "all", "b", "--device", "cpu"], "--stage all runs every stage; give it alone"),
    (["--budget-minutes", "-1", "--device", "cpu"], "--budget-minutes must be > 0, got -1.0"),
    (["--goals", "--stage", "a", "--device", "cpu"], "--goals runs stages b and c itself; drop --stage a"),
])
@pytest.mark.slow
def test_bad_input_is_one_line(args, needle):
    run = _run(*args)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in run.stderr, run.stderr


# The stages stop themselves at their time budget (--budget-minutes); the tests give them one no run can reach, so
# that what they check (every cell measured) does not depend on the machine's speed or load.
UNREACHABLE_BUDGET = ["--budget-minutes", "10000"]


@pytest.mark.slow
def test_every_stage_runs_end_to_end_at_tiny_sizes_on_cpu(tmp_path):
    run = _run("--device", "cpu", "--tiny", *UNREACHABLE_BUDGET, "--results", str(tmp_path / "results"),
               env_out=tmp_path / "out", timeout=3600)
    assert run.returncode == 0, run.stderr[-3000:]
    for folder in (tmp_path / "results", tmp_path / "out"):
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        assert files == [f"stage-{k}.{e}" for k in "abcd" for e in ("json", "md")], files  # 8 files come back
    for key in "abcd":
        data = json.loads((tmp_path / "out" / f"stage-{key}.json").read_text())
        assert data["complete"] is True and data["invocations"][0]["commit"], key
    b = json.loads((tmp_path / "out" / "stage-b.json").read_text())["cells"]
    assert "profile" in b and any(k.startswith("batch/") for k in b)
    assert all("tokens_per_second" in c for k, c in b.items() if k.startswith("eager-autocast/"))
    c = json.loads((tmp_path / "out" / "stage-c.json").read_text())["cells"]
    methods = {v["method"] for k, v in c.items() if k.startswith("B1/")}
    assert methods == {"base (transformers generate)", "tadm K=1", "tadm K=2", "tadm K=3", "naive K=2", "naive K=3"}
    calls = {v["method"]: v["decoder_layer_calls"] for k, v in c.items() if k.startswith("B1/")}
    assert calls["tadm K=1"] == calls["base (transformers generate)"] > calls["tadm K=2"] > calls["tadm K=3"]
    assert c["posttrain step"]["loss"] > 0
    # a second run finds every stage complete and measures nothing again
    again = _run("--device", "cpu", "--tiny", *UNREACHABLE_BUDGET, "--results", str(tmp_path / "results"), "--stage",
                 "b", "c", timeout=3600)
    assert again.returncode == 0 and again.stdout.count("complete in") == 2


@pytest.mark.slow
def test_goals_measure_only_the_goal_cells_and_a_full_run_continues_from_them(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    run = _run("--goals", "--device", "cpu", "--tiny", *UNREACHABLE_BUDGET, "--results", str(results), env_out=out,
               timeout=3600)
    assert run.returncode == 0, run.stderr[-3000:]
    b = json.loads((out / "stage-b.json").read_text())
    c = json.loads((out / "stage-c.json").read_text())
    assert not b["complete"] and not c["complete"]
    # tiny sizes: T in {8, 16}, K in {1, 2, 4}; the goals are TADM at the largest T, K = 1 and the largest K
    assert sorted(b["cells"]) == [f"{v}/tadm/B1/T16/K{K}" for v in ("bf16-weights", "compiled") for K in (1, 4)]
    assert sorted(c["cells"]) == ["B1/base (transformers generate)", "B1/tadm K=1", "B1/tadm K=2", "B1/tadm K=3"]
    page = (out / "goals.md").read_text()
    assert "tiny rehearsal" in page and page.count("| met |") + page.count("| missed |") == 9, page
    k4 = b["cells"]["compiled/tadm/B1/T16/K4"]
    assert f"{k4['tokens_per_second']:,.1f}" in page
    # the full stages keep the goal cells (same settings) and measure only the others
    again = _run("--device", "cpu", "--tiny", *UNREACHABLE_BUDGET, "--results", str(results), "--stage", "b", "c",
                 timeout=3600)
    assert again.returncode == 0, again.stderr[-3000:]
    b2 = json.loads((results / "stage-b.json").read_text())
    c2 = json.loads((results / "stage-c.json").read_text())
    assert b2["complete"] and c2["complete"] and len(b2["invocations"]) == 2
    assert b2["cells"]["compiled/tadm/B1/T16/K4"] == k4
    assert c2["cells"]["B1/tadm K=2"] == c["cells"]["B1/tadm K=2"]
    assert "naive K=2" in {v.get("method") for v in c2["cells"].values() if isinstance(v, dict)}


def _load_campaign():
    spec = importlib.util.spec_from_file_location("gpu_campaign", SCRIPT)
    campaign = importlib.util.module_from_spec(spec)
    sys.modules["gpu_campaign"] = campaign  # dataclasses look their module up
    spec.loader.exec_module(campaign)
    return campaign


def test_stage_d_keeps_the_study_and_its_cache_under_a_relative_results_folder(tmp_path, monkeypatch):
    campaign = _load_campaign()
    calls, real_run = [], subprocess.run

    def fake_run(command, **kwargs):  # stands in for the study: writes where its out_dir override says
        if "study" not in command:
            return real_run(command, **kwargs)  # git, for the records
        calls.append(command)
        options = dict(a.split("=", 1) for a in command if "=" in a and not a.startswith("-"))
        out_dir = Path(options["out_dir"])
        assert out_dir.is_absolute(), command
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.md").write_text("# the study's report\n")
        (out_dir / "results.json").write_text('{"rows": 1}')
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(campaign.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    assert campaign.main(["--stage", "d", "--device", "cpu", "--tiny", "--results", "rel/results"]) == 0
    results = tmp_path / "rel" / "results"
    assert len(calls) == 2
    for command in calls:
        options = dict(a.split("=", 1) for a in command if "=" in a and not a.startswith("-"))
        assert Path(options["out_dir"]) == results / "study"
        assert Path(options["data.cache_dir"]).is_relative_to(results)
    assert "# the study's report" in (results / "stage-d.md").read_text()
    assert json.loads((results / "stage-d.json").read_text())["cells"]["results"] == {"rows": 1}


@pytest.mark.parametrize("args", [["--device", "cpu"], ["--goals", "--device", "cpu"], ["--stage", "c", "--device", "cpu"]])
def test_full_sizes_on_the_cpu_are_refused_up_front_with_the_plans_memory_figure(tmp_path, monkeypatch, capsys, args):
    """Stage c at full size would build DiffusionGemma-26B-A4B in float32 on the CPU (over 100 GB) and die of memory."""
    campaign = _load_campaign()
    ran: list[str] = []  # the stages stand-ins: nothing of this size is ever built here
    monkeypatch.setattr(campaign, "STAGES", {key: dataclasses.replace(stage, run=lambda ctx, key=key: ran.append(key))
                                             for key, stage in campaign.STAGES.items()})
    monkeypatch.delenv("OUT", raising=False)
    assert campaign.main([*args, "--results", str(tmp_path / "results")]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and not out and not ran and not (tmp_path / "results").exists(), (out, err)
    assert lines[0].startswith("gpu_campaign: error: stage c builds DiffusionGemma-26B-A4B at full size")
    needed = re.search(r"which needs about (\d+) GB on cpu \(float32 weights (\d+) GB; tadm posttrain plan's", lines[0])
    assert needed and int(needed[1]) >= int(needed[2]) >= 100 and "--tiny" in lines[0], lines[0]


@pytest.mark.slow
def test_the_optional_mdlm_owt_stage_rehearses_the_recipe_at_tiny_size_on_cpu(tmp_path):
    run = _run("--device", "cpu", "--tiny", "--stage", "e", *UNREACHABLE_BUDGET, "--results",
               str(tmp_path / "results"), env_out=tmp_path / "out", timeout=3600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["stage-e.json", "stage-e.md"]
    data = json.loads((tmp_path / "out" / "stage-e.json").read_text())
    assert data["complete"] is True and data["parameters"]["split"] == [1, 2, 1]
    cells = data["cells"]
    calls = {v["method"]: v["layer_calls"] for k, v in cells.items() if k.startswith("B1/")}
    assert calls["tadm K=1"] > calls["tadm K=2"] > calls["tadm K=3"] == calls["naive K=3"]
    step = cells["posttrain"]
    assert step["steps"] == 3 and len(step["losses"]) == 3 and step["seconds_per_step"] > 0
    page = (tmp_path / "out" / "stage-e.md").read_text()
    assert "tadm's MDLM sampler, canvas 32, 8 steps" in page and "Post-training (on-policy MDLM rollouts" in page
