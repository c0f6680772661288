"""``tadm study``: config validation, an end-to-end tiny study, skipping finished units, resuming, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import tadm.study.runner as runner_mod
from tadm.cli import main
from tadm.config import ConfigError
from tadm.study import list_study_presets, load_study_config, model_experiment_config, run_study

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = {
    "name": "unit-test",
    "seeds": [0, 1],
    "models": [
        {"name": "tadm", "kind": "tadm"},
        {"name": "fresh", "kind": "tadm-fresh", "seeds": [0]},
        {"name": "adlm", "kind": "adlm", "seeds": [0]},
        {"name": "mdlm", "kind": "mdlm", "seeds": [0]},
        {"name": "ar", "kind": "ar", "seeds": [0]},
    ],
    "size": {"hidden_size": 16, "num_heads": 2, "anchor_layers": 2, "denoiser_layers": 1, "cond_dim": 16},
    "data": {"source": str(FIXTURE), "tokenizer": "bpe", "tokenizer_vocab_size": 258, "seq_len": 16,
             "val_fraction": 0.1},
    "objective": {"refresh_intervals": [1, 2], "step_budgets": [4, 8]},
    "optim": {"lr": 3.0e-3, "warmup_steps": 1},
    "train": {"max_steps": 3, "global_batch_size": 4, "micro_batch_size": 4, "eval_every": 3, "eval_batches": 1,
              "save_every": 3, "log_every": 1, "ema": 0.0, "precision": "fp32", "device": "cpu"},
    "staleness": {"steps": [4], "max_age": 2, "refresh": [1, 2], "t_samples": 1, "batch_size": 4, "max_blocks": 4,
                  "eval_seeds": [0, 1]},
    "sampling": {"steps": [4], "refresh": [1, 2], "num_samples": 4, "batch_size": 4, "evaluators": ["ar"],
                 "mauve_min_samples": 2, "throughput_generations": 5, "throughput_warmup": 0, "device": "cpu"},
}


def write_config(path: Path, out_dir: Path, **changes) -> Path:
    cfg = json.loads(json.dumps(TINY))
    cfg["out_dir"] = str(out_dir)
    for key, value in changes.items():
        section, _, name = key.partition(".")
        if name:
            cfg[section][name] = value
        else:
            cfg[section] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    config = write_config(root / "study.yaml", root / "out")
    out = run_study(load_study_config(config), progress=False, log=lambda m: None)
    return {"root": root, "config": config, "out": out, "dir": root / "out"}


@pytest.mark.slow
def test_study_runs_end_to_end_and_writes_every_file(finished):
    d, out = finished["dir"], finished["out"]
    for name in ("report.md", "results.json", "results.csv", "staleness.csv", "study.json", "throughput.json"):
        assert (d / name).is_file() and (d / name).stat().st_size > 0, name
    for name in ("nelbo_vs_cache_age.png", "genppl_vs_tokens_per_s_ar.png"):
        assert (d / "plots" / name).read_bytes()[:8] == PNG_MAGIC
    for run in ("tadm-s0", "tadm-s1", "fresh-s0", "adlm-s0", "mdlm-s0", "ar-s0"):
        assert (d / "models" / run / "final" / "model.safetensors").is_file()
        assert (d / "evals" / run / "likelihood.json").is_file()
    # anchored models get stale curves per evaluation seed, TADMs also with naive reuse
    for what in ("staleness-e0", "staleness-e1", "staleness-naive-e0"):
        assert (d / "evals" / "tadm-s1" / f"{what}.json").is_file()
    assert not (d / "evals" / "mdlm-s0" / "staleness-e0.json").exists()
    # sampling: first training seed only; MDLM (no anchor) only at K = 1
    assert sorted(p.name for p in (d / "samples" / "tadm-s0").iterdir()) == ["T4-K1.json", "T4-K2.json"]
    assert sorted(p.name for p in (d / "samples" / "mdlm-s0").iterdir()) == ["T4-K1.json"]
    assert not (d / "samples" / "tadm-s1").exists() and not (d / "samples" / "ar-s0").exists()
    results = json.loads((d / "results.json").read_text())
    assert results["invocations"][0]["machine"]["cpu_count"] and "commit" in results["invocations"][0]
    # rows carry the training seed and the evaluation seed apart
    assert sorted((r["seed"], r["eval_seed"]) for r in results["staleness"] if r["model"] == "tadm") == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(r["seed"] for r in results["likelihood"] if r["model"] == "tadm") == [0, 1]
    assert {r["model"]: r["bound"] for r in results["likelihood"]}["ar"] == "exact"
    assert "(exact NLL)" in (d / "report.md").read_text()
    fresh_s1 = json.loads((d / "evals" / "tadm-s1" / "staleness-e0.json").read_text())["staleness"]["fresh"]
    assert next(r for r in results["staleness"] if r["model"] == "tadm" and r["seed"] == 1
                and r["eval_seed"] == 0)["fresh"] == fresh_s1
    cells = [r for r in results["samples"] if r["model"] == "tadm"]
    assert {(r["steps"], r["refresh"]) for r in cells} == {(4, 1), (4, 2)}
    for r in cells:
        assert r["gen_ppl"] > 1 and r["tokens_per_second"] > 0 and r["mauve_buckets"] == 2
        assert r["layer_calls"] == 4 * 1 + -(-4 // r["refresh"]) * 2 == r["layer_calls_counted"]
    report = (d / "report.md").read_text()
    for heading in ("## Models", "## Stale-anchor likelihood, T = 4", "## Cached reverse process",
                    "paper Table 2 layout", "paper Table 4 layout", "## Degradation from K = 1"):
        assert heading in report, heading
    assert "| tadm-naive |" in report and "| adlm (K=2) |" in report
    assert len(out.ran) > 20 and out.skipped == []


@pytest.mark.slow
def test_fresh_point_of_every_curve_is_the_validation_nelbo(finished):
    d = finished["dir"]
    for run in ("tadm-s0", "adlm-s0", "fresh-s0"):
        fresh = json.loads((d / "evals" / run / "likelihood.json").read_text())["result"]["nll"]
        curve = json.loads((d / "evals" / run / "staleness-e0.json").read_text())["staleness"]
        assert curve["curves"]["4"][0] == curve["fresh"] == fresh


@pytest.mark.slow
def test_second_invocation_skips_every_unit(finished, monkeypatch):
    monkeypatch.setattr("tadm.training.trainer.train", lambda *a, **k: pytest.fail("trained again"))
    monkeypatch.setattr("tadm.eval.evaluator.load_evaluator", lambda *a, **k: pytest.fail("evaluator loaded"))
    monkeypatch.setattr("tadm.sampling.generate", lambda *a, **k: pytest.fail("sampled again"))
    out = run_study(load_study_config(finished["config"]), progress=False, log=lambda m: None)
    assert out.ran == [] and len(out.skipped) == len(finished["out"].ran)
    assert (finished["dir"] / "report.md").is_file()
    manifest = json.loads((finished["dir"] / "study.json").read_text())
    assert len(manifest["invocations"]) >= 2


@pytest.mark.slow
def test_changed_evaluation_settings_redo_only_those_units(finished, tmp_path):
    config = write_config(tmp_path / "s.yaml", finished["dir"], **{"sampling.seed": 5})
    out = run_study(load_study_config(config), progress=False, log=lambda m: None,
                    stages=("train", "likelihood", "sample"))
    assert sorted(out.ran) == sorted(["sample tadm seed 0 T=4 K=1", "sample tadm seed 0 T=4 K=2",
                                      "sample fresh seed 0 T=4 K=1", "sample fresh seed 0 T=4 K=2",
                                      "sample adlm seed 0 T=4 K=1", "sample adlm seed 0 T=4 K=2",
                                      "sample mdlm seed 0 T=4 K=1"])


@pytest.mark.slow
def test_refresh_policy_entries_sample_time_and_report(finished, tmp_path):
    """sampling.refresh may name policies: a schedule equal to K = 2 gives K = 2's tokens; adaptive is counted."""
    import shutil

    work = tmp_path / "out"
    shutil.copytree(finished["dir"], work)
    schedule = {"policy": "schedule", "steps": [4, 2]}  # T = 4: refreshes at i = 4, 2, as K = 2 does
    adaptive = {"policy": "adaptive", "tau": 0.3, "max_interval": 2}
    config = write_config(tmp_path / "s.yaml", work, **{"sampling.refresh": [1, 2, schedule, adaptive]})
    out = run_study(load_study_config(config), progress=False, log=lambda m: None,
                    stages=("sample", "score", "throughput", "report"))
    assert "sample tadm seed 0 T=4 K=schedule-steps4_2" in out.ran
    assert "sample mdlm seed 0 T=4 K=schedule-steps4_2" not in out.ran  # no anchor: K = 1 only
    samples = work / "samples" / "tadm-s0"
    same = [json.loads((samples / name).read_text())["token_ids"]
            for name in ("T4-K2.json", "T4-Kschedule-steps4_2.json")]
    assert same[0] == same[1]
    rows = {r["refresh"]: r for r in json.loads((work / "results.json").read_text())["samples"]
            if r["model"] == "tadm"}
    assert rows["schedule-steps4_2"]["layer_calls"] == rows[2]["layer_calls"] == 4 + 2 * 2
    calls = rows["adaptive-max_interval2-tau0.3"]["layer_calls"]
    assert rows[2]["layer_calls"] <= calls <= rows[1]["layer_calls"]
    assert rows["adaptive-max_interval2-tau0.3"]["tokens_per_second"] > 0
    report = (work / "report.md").read_text()
    assert "| tadm (adaptive-max_interval2-tau0.3) |" in report and "K=1→2" in report


@pytest.mark.slow
def test_changed_training_settings_are_refused(finished, tmp_path):
    config = write_config(tmp_path / "s.yaml", finished["dir"], **{"optim.lr": 1.0e-3})
    with pytest.raises(ConfigError, match="trained with other settings.*optim.lr: 0.003 there, 0.001 now"):
        run_study(load_study_config(config), progress=False, log=lambda m: None)


@pytest.mark.slow
def test_watch_settings_do_not_make_a_trained_unit_stale(finished, tmp_path):
    # other loggers, and a unit trained before train.loggers existed (its record has train.tensorboard), still count
    marker = next((finished["dir"] / "models").glob("*/study_unit.json"))
    record = json.loads(marker.read_text())
    original = marker.read_text()
    train = record["spec"]["config"]["train"]
    train.pop("loggers", None), train.pop("wandb_project", None)
    train["tensorboard"] = False
    marker.write_text(json.dumps(record))
    try:
        config = write_config(tmp_path / "s.yaml", finished["dir"], **{"train.loggers": ["jsonl", "tensorboard"]})
        out = run_study(load_study_config(config), stages=["train"], progress=False, log=lambda m: None)
        assert out.ran == [] and len(out.skipped) >= 1
    finally:
        marker.write_text(original)


@pytest.mark.slow
def test_interrupted_study_continues(tmp_path, monkeypatch):
    config = write_config(tmp_path / "s.yaml", tmp_path / "out",
                          models=[{"name": "tadm", "kind": "tadm"}, {"name": "ar", "kind": "ar"}], seeds=[0],
                          **{"sampling.throughput_generations": 0})
    real = runner_mod._Study.score_all
    monkeypatch.setattr(runner_mod._Study, "score_all", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        run_study(load_study_config(config), progress=False, log=lambda m: None)
    monkeypatch.setattr(runner_mod._Study, "score_all", real)
    out = run_study(load_study_config(config), progress=False, log=lambda m: None)
    assert all(u.startswith("score") for u in out.ran) and len(out.ran) == 3  # 2 cells + the data row
    assert "train tadm seed 0" in out.skipped and "sample tadm seed 0 T=4 K=2" in out.skipped


def test_derived_training_configs_share_size_data_and_budget(tmp_path):
    cfg = load_study_config(write_config(tmp_path / "s.yaml", tmp_path / "out"))
    configs = {m.name: model_experiment_config(cfg, m, 0) for m in cfg.models}
    assert configs["tadm"].model.overrides["anchor_layers"] == 2 and configs["mdlm"].model.overrides["num_layers"] == 3
    assert configs["ar"].model.overrides["num_layers"] == 3 and configs["adlm"].model.arch == "adlm"
    assert configs["fresh"].objective.refresh_intervals == [1] and configs["tadm"].objective.refresh_intervals == [1, 2]
    assert configs["tadm"].objective.gamma == 0 and configs["adlm"].objective.gamma == pytest.approx(3e-3)
    assert len({(c.train.max_steps, c.train.global_batch_size, c.data.seq_len, c.data.source)
                for c in configs.values()}) == 1
    assert configs["tadm"].train.out_dir.endswith("models/tadm-s0")
    one = model_experiment_config(cfg, cfg.models[0], 1)
    assert one.train.seed == 1 and one.train.out_dir.endswith("tadm-s1")


@pytest.mark.parametrize("changes,message", [
    ({"models": [{"name": "x", "kind": "sedd"}]}, "models\\[0\\].kind 'sedd' is unknown; valid: tadm, tadm-fresh"),
    ({"models": [{"name": "a", "kind": "tadm"}, {"name": "a", "kind": "mdlm"}]}, "models\\[1\\].name 'a' is given twice"),
    ({"models": [{"name": "a", "kind": "tadm", "overrides": ["optim.lr"]}]}, "must look like section.key=value"),
    ({"models": [{"name": "a", "kind": "tadm", "overrides": ["optim.lr=-1"]}, {"name": "r", "kind": "ar"}]},
     "model 'a': optim.lr must be a finite number > 0, got -1"),
    ({"models": [{"name": "t", "kind": "tadm"}]}, "names 'ar' \\(the in-domain AR\\) but no model has kind 'ar'"),
    ({"staleness.max_age": -1}, "staleness.max_age must be >= 0, got -1"),
    ({"staleness.steps": [0]}, "staleness.steps must be a non-empty list of integers >= 1"),
    ({"sampling.refresh": [1, 0]}, "sampling.refresh\\[1\\]: anchor refresh interval K must be an integer >= 1, got 0"),
    ({"sampling.refresh": [2, 4]}, "sampling.refresh must include K = 1"),
    ({"sampling.refresh": [1, 2, 2]}, "sampling.refresh: the same refresh policy is listed twice: 1, 2, 2"),
    ({"sampling.refresh": [1, {"policy": "adaptive", "tau": -0.1}]}, "sampling.refresh\\[1\\]: .*tau"),
    ({"sampling.refresh": [1, {"policy": "sometimes"}]}, "unknown refresh policy 'sometimes'"),
    ({"sampling.refresh": [1, {"tau": 0.1}]}, "refresh mapping needs a 'policy' key"),
    ({"sampling.throughput_generations": 3}, "throughput_generations must be 0 \\(skip\\) or >= 5"),
    ({"sampling.sampler": {"name": "auto", "nucleus": "top"}}, "sampling.sampler.nucleus 'top' is unknown"),
    ({"sampling.nucleus": "top"}, "sampling.sampler.nucleus 'top' is unknown"),
    ({"size.num_heads": 3}, "size.hidden_size \\(16\\) must be divisible by size.num_heads \\(3\\)"),
    ({"name": " "}, "name must not be empty"),
    ({"seeds": []}, "seeds must be a non-empty list of integers >= 0, got \\[\\]"),
    ({"models": []}, "models is empty: list at least one"),
    ({"models": [{"name": "a b", "kind": "tadm"}]}, "models\\[0\\].name 'a b' must be a non-empty name of letters"),
    ({"models": [{"name": "a", "kind": "tadm", "seeds": [-1]}]}, "models\\[0\\].seeds must be a non-empty list"),
    ({"staleness.refresh": [1, 1]}, "staleness.refresh: the same refresh policy is listed twice: 1, 1"),
    ({"staleness.refresh": [0]}, "staleness.refresh: anchor refresh interval K must be an integer >= 1, got 0"),
    ({"staleness.eval_seeds": []}, "staleness.eval_seeds must be a non-empty list"),
    ({"staleness.discrete_steps": 0}, "staleness.discrete_steps must be >= 1, got 0"),
    ({"staleness.t_samples": 0}, "staleness.t_samples must be >= 1, got 0"),
    ({"sampling.model_seeds": [-2]}, "sampling.model_seeds must be a non-empty list of integers >= 0"),
])
@pytest.mark.slow
def test_bad_configs_name_the_value(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        load_study_config(write_config(tmp_path / "s.yaml", tmp_path / "out", **changes))


def test_unknown_keys_and_missing_files(tmp_path):
    path = write_config(tmp_path / "s.yaml", tmp_path / "out")
    with pytest.raises(ConfigError, match="hidden_sise"):
        load_study_config(path, ["size.hidden_sise=3"])
    with pytest.raises(FileNotFoundError, match="neither a file nor a shipped study preset"):
        load_study_config(tmp_path / "nope.yaml")


def test_cli_errors_are_one_line(tmp_path, capsys):
    path = write_config(tmp_path / "s.yaml", tmp_path / "out", models=[{"name": "x", "kind": "gpt"}])
    assert main(["study", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kind 'gpt' is unknown" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("name", list_study_presets())
def test_every_shipped_study_preset_loads_and_has_its_command(name):
    from tadm.study.config import study_preset_path

    cfg = load_study_config(name)
    assert cfg.name and cfg.models
    assert f"tadm study {name}" in study_preset_path(name).read_text()


@pytest.mark.slow
def test_adaptive_refresh_benchmark_runs_on_a_finished_study(finished, tmp_path):
    """benchmarks/adaptive_refresh.py reads the study's models through open_study and writes its table."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "adaptive_refresh.py"
    run = subprocess.run(
        [sys.executable, str(script), str(finished["config"]), "--models", "tadm", "--seeds", "0", "--steps", "4",
         "--match", "2", "--num-samples", "3", "--calibration-samples", "2", "--bisection-steps", "2",
         "--cells-dir", str(tmp_path / "cells"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    table = (tmp_path / "out" / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| tadm |")]
    assert [row.split(" | ")[1] for row in rows] == ["fixed K=1", "fixed K=2", rows[2].split(" | ")[1]]
    assert rows[2].split(" | ")[1].startswith("adaptive (matches K=2")
    assert "3 sequences generated one at a time" in table
    # scores made against the first held-out blocks (records without reference_order) are made again, once
    scores = sorted((tmp_path / "cells").glob("*/score-*.json"))
    assert scores and all(json.loads(f.read_text())["reference_order"] == "random" for f in scores)
    old = scores[0]
    old.write_text(json.dumps({k: v for k, v in json.loads(old.read_text()).items() if k != "reference_order"}))
    for expected in (1, 0):
        again = subprocess.run(run.args, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and again.stdout.count("[adaptive] scored") == expected, again.stdout[-2000:]
