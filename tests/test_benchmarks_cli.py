"""The benchmark scripts' arguments: bad values end in one line, before any model is built; and their arithmetic."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tadm.nn import tadm_tiny

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """A benchmark script as a module (as tests/test_gpu_campaign.py loads gpu_campaign.py)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_profile_sampling_divides_by_the_steps_the_loop_ran(monkeypatch):
    ps = load("profile_sampling")
    clock = iter([0.0, 1.0])  # the profiled run takes one second of wall time
    monkeypatch.setattr(ps, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    args = argparse.Namespace(sampler="remdm-loop", steps=4, batch_size=1, length=8, refresh=1, profile_steps=16,
                              dtype="float32")
    model = tadm_tiny().eval()
    assert ps.run_steps(model, args, torch.device("cpu"), full_output=False) == 4
    clock = iter([0.0, 1.0])
    times = ps.breakdown(model, args, torch.device("cpu"), full_output=False)
    assert times["total (wall)"] == pytest.approx(1000.0 / 4)  # 4 steps ran, not --profile-steps 16


BAD_INPUTS = [
    ("bench_gpu", ["--device", "cuda"], "device 'cuda' requested but CUDA is not available"),
    ("bench_gpu", ["--length", "0"], "--length: must be >= 1, got 0"),
    ("bench_gpu", ["--steps", "0"], "--steps/-T: must be >= 1, got 0"),
    ("bench_gpu", ["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    ("bench_gpu", ["--warmup", "-1"], "--warmup: must be >= 0, got -1"),
    ("bench_gpu", ["--compile", "default", "--warmup", "0"], "--compile needs --warmup >= 1"),
    ("bench_gpu", ["--batch-sizes", "0"], "--batch-sizes: must be >= 1, got 0"),
    ("bench_gpu", ["--sampler", "bogus"], "--sampler: invalid choice: 'bogus'"),
    ("bench_gpu", ["--peak-tflops", "0"], "--peak-tflops: must be a finite number > 0"),
    ("profile_sampling", ["--device", "cuda"], "device 'cuda' requested but CUDA is not available"),
    ("profile_sampling", ["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    ("profile_sampling", ["--profile-steps", "0"], "--profile-steps: must be >= 1, got 0"),
    ("profile_sampling", ["--steps", "x"], "--steps/-T: expected an integer, got 'x'"),
    ("profile_sampling", ["--sampler", "bogus"], "--sampler: invalid choice: 'bogus'"),
    ("bench_staleness", ["--device", "cuda"], "device 'cuda' requested but CUDA is not available"),
    ("bench_staleness", ["--max-age", "0"], "--max-age: must be >= 1, got 0"),
    ("bench_staleness", ["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    ("bench_staleness", ["--length", "-3"], "--length: must be >= 1, got -3"),
    ("bench_train", ["--device", "cuda"], "device 'cuda' requested but CUDA is not available"),
    ("bench_train", ["--seq-len", "0"], "--seq-len: must be >= 1, got 0"),
    ("bench_train", ["--steps", "0"], "--steps: must be >= 1, got 0"),
    ("bench_train", ["--threads", "-1"], "--threads: must be >= 0, got -1"),
]


@pytest.mark.parametrize("script, argv, needle", BAD_INPUTS)
def test_bad_input_is_one_line_before_any_model(script, argv, needle, capsys, monkeypatch):
    module = load(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CUDA request on a machine without one
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("script, argv, needle", [
    ("paper_size_step", ["--device", "cuda"], "device 'cuda' requested but CUDA is not available"),
    ("paper_size_step", ["--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    ("paper_size_step", ["--preset", "posttrain-tiny"], "--preset: invalid choice: 'posttrain-tiny'"),
])
def test_paper_size_step_bad_input_is_one_line(script, argv, needle, capsys, monkeypatch):
    test_bad_input_is_one_line_before_any_model(script, argv, needle, capsys, monkeypatch)


@pytest.mark.parametrize("preset", ["tadm-tiny", "mdlm-tiny"])
def test_paper_size_step_runs_any_pretraining_preset_without_warnings(preset, capsys):
    module = load("paper_size_step")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Converting a tensor with requires_grad=True to a scalar"
        module.main(["--preset", preset])
    out = capsys.readouterr().out
    assert f"{preset}: {preset}," in out and "one optimisation step:" in out and "loss " in out, out


def _study_yaml(tmp_path: Path, out_dir: Path) -> Path:
    """The study-tiny preset with its out_dir moved to ``out_dir`` and its token cache beside it."""
    text = (Path(__file__).resolve().parents[1] / "src/tadm/configs/studies/study-tiny.yaml").read_text()
    lines = [f"out_dir: {out_dir}" if line.startswith("out_dir:") else line for line in text.splitlines()]
    lines = [line.replace("data: {", f"data: {{cache_dir: {tmp_path / 'cache'}, ", 1) for line in lines]
    path = tmp_path / "study.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("argv, needle", [
    (["--seeds", "a"], "--seeds: expected an integer, got 'a'"),
    (["--match", "4,0"], "--match: must be >= 1, got 0"),
    (["--num-samples", "0"], "--num-samples: must be >= 1, got 0"),
    (["--models", "tadm,"], "--models: expected comma-separated model names"),
    (["--models", "nope"], "--models nope: not in study study-tiny"),
    (["--seeds", "7"], "--seeds 7: model tadm of study study-tiny has seeds 0, 1"),
    ([], "model tadm seed 0 is not trained"),
])
def test_adaptive_refresh_bad_input_is_one_line(argv, needle, tmp_path, capsys):
    module = load("adaptive_refresh")
    config = _study_yaml(tmp_path, tmp_path / "untrained")
    with pytest.raises(SystemExit) as exit_:
        module.main([str(config), *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and needle in lines[0], err
    if not argv:
        assert f"train the study first: tadm study {config} --stages train" in lines[0]


@pytest.mark.slow
def test_adaptive_refresh_reruns_follow_the_settings_and_the_table_only_what_was_asked(tmp_path, capsys):
    study_yaml = _study_yaml(tmp_path, tmp_path / "study")
    text = study_yaml.read_text().replace("seeds: [0, 1]", "seeds: [0]")
    study_yaml.write_text("\n".join(line for line in text.splitlines() if "kind: adlm" not in line
                                    and "kind: mdlm" not in line) + "\n")
    train = subprocess.run([sys.executable, "-m", "tadm", "study", str(study_yaml), "--stages", "train",
                            "--no-progress"], capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    module = load("adaptive_refresh")
    small = ["--seeds", "0", "--steps", "8", "--match", "2", "--calibration-samples", "2", "--bisection-steps", "1"]
    out = tmp_path / "out"

    def run(*argv: str) -> list[dict]:
        assert module.main([str(study_yaml), *small, "--out", str(out), *argv]) == 0
        capsys.readouterr()
        return json.loads((out / "results.json").read_text())["rows"]

    rows = run("--models", "tadm", "--num-samples", "2")
    assert [(r["model"], r["kind"], r["match_K"], r["num_samples"]) for r in rows] == [
        ("tadm", "adaptive", 2, 2), ("tadm", "fixed", 1, 2), ("tadm", "fixed", 2, 2)]
    # other settings into the same cells: the samples are made again (and scored again), not reused
    rows = run("--models", "tadm", "--num-samples", "3", "--seed", "5")
    assert {r["num_samples"] for r in rows} == {3} and all(r["gen_ppl_ar"] is not None for r in rows)
    cell = json.loads((tmp_path / "study" / "adaptive" / "tadm-s0" / "samples-T8-fixed-K2.json").read_text())
    assert cell["settings"]["seed"] == 5 and len(cell["token_ids"]) == 3
    assert "3 sequences generated" in (out / "table.md").read_text()
    # another model into the same cells: its rows only
    rows = run("--models", "tadm-fresh", "--num-samples", "3", "--seed", "5")
    assert {r["model"] for r in rows} == {"tadm-fresh"} and len(rows) == 3
    assert "| tadm |" not in (out / "table.md").read_text()
