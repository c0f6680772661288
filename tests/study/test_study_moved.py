"""``tadm study``: a finished study moved, or named by another path, keeps every unit (likelihood, staleness,
samples, scores, timing), units recorded with the model paths as named then still count, and a unit whose
spec really differs is redone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tadm.eval.pipeline as pipeline_mod
import tadm.study.report as report_mod
import tadm.study.runner as runner_mod
from tadm.eval.likelihood import packed_eval_blocks
from tadm.eval.pipeline import draw_reference
from tadm.study import load_study_config, run_study
from tadm.study.runner import open_study
from tests.study.test_study import write_config

QUIET = {"progress": False, "log": lambda m: None}
MODELS = [{"name": "tadm", "kind": "tadm"}, {"name": "ar", "kind": "ar"}]  # the AR is the in-domain evaluator
SMALL = {"staleness.eval_seeds": [0], "train.max_steps": 1, "train.eval_every": 1, "train.save_every": 1}
UNITS = ["likelihood tadm seed 0", "staleness tadm seed 0 eval-seed 0", "staleness tadm-naive seed 0 eval-seed 0",
         "likelihood ar seed 0", "sample tadm seed 0 T=4 K=1", "sample tadm seed 0 T=4 K=2", "score ar data",
         "score ar tadm seed 0 T=4 K=1", "score ar tadm seed 0 T=4 K=2", "throughput"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-model study (TADM + AR, one seed, one training step each)."""
    root = tmp_path_factory.mktemp("study")
    out = run_study(load_study_config(write_config(root / "s.yaml", root / "out", models=MODELS, seeds=[0], **SMALL)),
                    **QUIET)
    assert sorted(out.ran) == sorted(["tokenizer", "train tadm seed 0", "train ar seed 0", *UNITS])
    return root / "out"


def _copy(finished: Path, to: Path) -> Path:
    shutil.copytree(finished, to)
    return to


def _config(tmp_path: Path, out_dir: Path | str, **changes):
    return load_study_config(write_config(tmp_path / "s.yaml", Path(out_dir), models=MODELS, seeds=[0],
                                          **{**SMALL, **changes}))


def _nothing_recomputed(monkeypatch) -> None:
    def fail(what):
        return lambda *a, **k: pytest.fail(f"{what} again")
    monkeypatch.setattr(runner_mod, "train", fail("trained"))
    for name in ("evaluate_likelihood", "stale_anchor_nelbo", "cached_process_nelbo"):
        monkeypatch.setattr(runner_mod, name, fail(name))
    monkeypatch.setattr(pipeline_mod, "generate", fail("sampled"))
    monkeypatch.setattr(pipeline_mod, "load_evaluator", fail("evaluator loaded"))
    monkeypatch.setattr(pipeline_mod, "interleaved_throughput", fail("timed"))


def _unit_records(out_dir: Path) -> dict[str, str]:
    """Every evaluation unit's file (not the trained models) and its text."""
    files = [*out_dir.glob("evals/*/*.json"), *out_dir.glob("samples/*/*.json"), *out_dir.glob("scores/*/*.json"),
             out_dir / "throughput.json"]
    return {str(p.relative_to(out_dir)): p.read_text() for p in files}


def _as_named(value, out_dir: Path):
    """``value`` (a unit's spec) with its study-relative model paths written as ``str(out_dir / path)``: the form
    units had when each spec recorded the model directory as the study named it."""
    if isinstance(value, dict):
        return {k: _as_named(v, out_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_named(v, out_dir) for v in value]
    if isinstance(value, str) and value.startswith("models/") and value.endswith("/final"):
        return str(out_dir / value)
    return value


def test_a_moved_study_skips_every_unit(finished, tmp_path, monkeypatch):
    moved = _copy(finished, tmp_path / "scratch" / "study")
    moved.rename(tmp_path / "home-study")
    moved = tmp_path / "home-study"
    records = _unit_records(moved)
    _nothing_recomputed(monkeypatch)
    out = run_study(_config(tmp_path, moved), **QUIET)
    assert out.ran == [] and sorted(u for u in out.skipped if u in UNITS) == sorted(UNITS)
    # the same study named by a relative path from another working directory
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = run_study(_config(tmp_path, "../home-study"), **QUIET)
    assert out.ran == [] and sorted(u for u in out.skipped if u in UNITS) == sorted(UNITS)
    assert _unit_records(moved) == records
    # the tables show where the models are loaded from now, with their timings
    rows = [r for r in json.loads((moved / "results.json").read_text())["samples"] if r["model"] == "tadm"]
    assert {r["path"] for r in rows} == {str(Path("../home-study/models/tadm-s0/final"))}
    assert all(r["tokens_per_second"] > 0 and r["gen_ppl"] > 1 for r in rows)


def test_units_recorded_with_the_paths_as_named_still_count(finished, tmp_path, monkeypatch):
    study = _copy(finished, tmp_path / "study")
    for name, text in _unit_records(study).items():
        record = json.loads(text)
        (study / name).write_text(json.dumps({**record, "spec": _as_named(record["spec"], study)}))
    legacy = _unit_records(study)
    assert all(str(study / "models") in text for text in legacy.values())
    with monkeypatch.context() as patched:
        _nothing_recomputed(patched)
        out = run_study(_config(tmp_path, study), **QUIET)
    assert out.ran == [] and _unit_records(study) == legacy  # skipped, not rewritten
    rows = [r for r in json.loads((study / "results.json").read_text())["samples"] if r["model"] == "tadm"]
    assert rows and all(r["tokens_per_second"] > 0 for r in rows)  # the timings made then are the cells' timings
    # a unit redone now records its model relative to the study
    (study / "samples" / "tadm-s0" / "T4-K2.json").unlink()
    out = run_study(_config(tmp_path, study), stages=("sample",), **QUIET)
    assert out.ran == ["sample tadm seed 0 T=4 K=2"]
    redone = json.loads((study / "samples" / "tadm-s0" / "T4-K2.json").read_text())["spec"]
    assert redone["model"] == "models/tadm-s0/final"


def test_a_study_recorded_before_paths_were_relative_and_moved_since_keeps_its_units(finished, tmp_path,
                                                                                    monkeypatch):
    study = _copy(finished, tmp_path / "study")
    for name, text in _unit_records(study).items():  # as written under the path the study had then
        record = json.loads(text)
        (study / name).write_text(json.dumps({**record, "spec": _as_named(record["spec"], Path("/scratch/old"))}))
    legacy = _unit_records(study)
    assert all("/scratch/old/models/" in text for text in legacy.values())
    _nothing_recomputed(monkeypatch)
    out = run_study(_config(tmp_path, study), **QUIET)
    assert out.ran == [] and sorted(u for u in out.skipped if u in UNITS) == sorted(UNITS)
    rows = [r for r in json.loads((study / "results.json").read_text())["samples"] if r["model"] == "tadm"]
    assert rows and all(r["tokens_per_second"] > 0 for r in rows)


def test_units_whose_spec_differs_are_redone_in_a_moved_study(finished, tmp_path):
    moved = _copy(finished, tmp_path / "moved")
    # a record of another model at the same place is not this unit
    path = moved / "evals" / "ar-s0" / "likelihood.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "spec": {**record["spec"], "model": "/other/study/models/ar-s1/final"}}))
    out = run_study(_config(tmp_path, moved, **{"sampling.seed": 5}), **QUIET)
    assert sorted(out.ran) == sorted(["likelihood ar seed 0", "sample tadm seed 0 T=4 K=1",
                                      "sample tadm seed 0 T=4 K=2", "score ar tadm seed 0 T=4 K=1",
                                      "score ar tadm seed 0 T=4 K=2", "throughput"])
    assert json.loads(path.read_text())["spec"]["model"] == "models/ar-s0/final"


def test_without_matplotlib_the_report_is_written_and_the_plots_skipped(finished, tmp_path, monkeypatch):
    study = _copy(finished, tmp_path / "study")
    shutil.rmtree(study / "plots")
    monkeypatch.setattr(report_mod, "can_plot", lambda: False)
    with pytest.warns(UserWarning, match="plots skipped: matplotlib is not installed"):
        run_study(_config(tmp_path, study), stages=("report",), **QUIET)
    assert (study / "results.csv").is_file() and not (study / "plots").exists()
    assert "and k)." in (study / "report.md").read_text()  # the files listed are those written


def test_scores_made_against_the_first_blocks_are_redone_once_against_random_ones(finished, tmp_path):
    """The study's reference is the shared random draw of the held-out blocks; score units of a study made when it
    was the first blocks (no reference_order in their spec) are scored again once, and nothing else is redone."""
    study = _copy(finished, tmp_path / "study")
    cfg = _config(tmp_path, study)
    workspace = open_study(cfg, log=lambda m: None)
    texts, ids = workspace.reference()
    blocks = packed_eval_blocks(cfg.sampling.reference, workspace.tokenizer(), workspace.length(),
                                cache_dir=cfg.data.cache_dir, split="val", val_fraction=cfg.data.val_fraction, seed=0)
    assert len(blocks) > len(ids) == cfg.sampling.num_samples
    drawn_texts, drawn = draw_reference(blocks, len(ids), workspace.tokenizer())
    assert texts == drawn_texts and torch.equal(ids, drawn)
    assert not torch.equal(ids, blocks.get_batch(range(len(ids))))
    for path in study.glob("scores/*/*.json"):  # as an earlier tadm wrote them
        record = json.loads(path.read_text())
        assert record["spec"].pop("reference_order") == "random"
        path.write_text(json.dumps(record))
    out = run_study(cfg, **QUIET)
    assert sorted(out.ran) == ["score ar data", "score ar tadm seed 0 T=4 K=1", "score ar tadm seed 0 T=4 K=2"]
    assert run_study(cfg, **QUIET).ran == []
