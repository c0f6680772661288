"""Sweeps: result files, the paper-layout table, both plots, resuming, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import tadm.eval.sweep as sweep_mod
from tadm.cli import main
import tadm.eval.pipeline as pipeline_mod
from tadm.eval.gen_ppl import decode_samples
from tadm.eval.likelihood import packed_eval_blocks
from tadm.eval.pipeline import SamplerSection, SamplingSettings, draw_reference
from tadm.eval.sweep import SweepConfig, parse_model_specs, run_sweep
from tadm.specs import load_model_and_tokenizer
from tests.eval.test_evaluator import FIXTURE, save_ar_evaluator, tiny_diffusion, tiny_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sweep-world")
    model_dir = root / "tadm"
    tiny_diffusion("tadm", max_seq_len=32).save_pretrained(model_dir)
    tiny_tokenizer().save(model_dir)
    return {"model": model_dir, "evaluator": save_ar_evaluator(root / "evaluator"), "root": root}


SAMPLING = dict(steps=[8], refresh=[1, 2], num_samples=4, batch_size=2, reference="FIXTURE", reference_split="all",
                mauve_num_buckets=2, mauve_min_samples=2, throughput_generations=5, throughput_warmup=0, device="cpu")


def config(world, out: Path, sampler: str = "remdm-cap", evaluator: str | None = None, **overrides) -> SweepConfig:
    settings = {**SAMPLING, "reference": str(FIXTURE), "evaluators": [evaluator or str(world["evaluator"])]}
    settings.update({k: v for k, v in overrides.items() if k in SAMPLING or k == "reference"})
    sampling = SamplingSettings(**settings, sampler=SamplerSection(name=sampler))
    rest = {k: v for k, v in overrides.items() if k not in settings}
    return SweepConfig(models={"tadm": str(world["model"])}, sampling=sampling, length=16,
                       cache_dir=str(world["root"] / "cache"), out_dir=str(out), **rest)


@pytest.mark.slow
def test_sweep_writes_results_table_and_plots(world, tmp_path, monkeypatch):
    loads = []
    real_load = pipeline_mod.load_evaluator
    monkeypatch.setattr(pipeline_mod, "load_evaluator", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    out = run_sweep(config(world, tmp_path / "sweep"), progress=False, log=lambda m: None)
    assert len(loads) == 1  # one evaluator for every cell and the reference
    cells = [r for r in out.rows if r["model"] == "tadm"]
    assert sorted((r["steps"], r["refresh"]) for r in cells) == [(8, 1), (8, 2)]
    assert out.rows[0]["model"] == "data"  # the held-out reference row comes first
    for r in cells:
        assert r["layer_calls"] == r["layer_calls_counted"] == 8 * 1 + -(-8 // r["refresh"]) * 2
        assert r["compute_relative"] == pytest.approx(r["layer_calls"] / (8 * 12))  # no MDLM in the sweep: 12 layers
        assert r["gen_ppl"] > 1 and 0 < r["entropy"] <= math.log(16) + 1e-9 and 0 <= r["mauve"] <= 1
        assert r["tokens_per_second"] > 0 and r["sampler"] == "remdm-cap"
        assert r["tokens_per_second_min"] <= r["tokens_per_second"] <= r["tokens_per_second_max"]
        assert r["mauve_num_samples"] == r["mauve_num_reference"] == 4 and r["mauve_buckets"] == 2
    files = out.files
    for key in ("json", "csv", "table", "plot_throughput", "plot_refresh"):
        assert files[key].is_file() and files[key].stat().st_size > 0, key
    for key in ("plot_throughput", "plot_refresh"):
        assert files[key].read_bytes()[:8] == PNG_MAGIC
    table = files["table"].read_text()
    assert "| tadm (K=1) |" in table and "| tadm (K=2) |" in table and "| Data |" in table
    assert "[4, 2 cl.]" in table  # MAUVE with its sample and cluster counts
    assert "Gen PPL ↓ T=8" in table and "Compute ↓ T=8" in table and "Tok/s ↑ T=8" in table
    payload = json.loads(files["json"].read_text())
    assert payload["settings"]["sampling"]["seed"] == 0 and payload["settings"]["resolved_baseline_layers"] == 12
    assert payload["settings"]["sampling"]["evaluators"] == [str(world["evaluator"])]
    assert {"torch", "python", "cpu_count"} <= set(payload["machine"])
    assert all(r["commit"] is not None or r["model"] == "data" for r in out.rows)  # every unit's provenance
    for kind in ("samples", "scores"):
        assert any((tmp_path / "sweep" / kind).rglob("*.json")), kind  # the study's unit layout
    assert files["csv"].read_text().splitlines()[0].startswith("model,path,steps,refresh")
    assert len(files["csv"].read_text().splitlines()) == 1 + 3
    assert "of 5 timed generations of batch 1 after 0 warm-up" in table
    # resumed without timing: the stored timings stay, described by the settings they were made with
    again = run_sweep(config(world, tmp_path / "sweep", throughput_generations=0), progress=False, log=lambda m: None)
    kept = [r for r in again.rows if r["model"] == "tadm"]
    assert [r["tokens_per_second"] for r in kept] == [r["tokens_per_second"] for r in cells]
    assert {r["throughput_generations"] for r in kept} == {5}
    assert "of 5 timed generations of batch 1 after 0 warm-up" in again.files["table"].read_text()
    # ... but not once the cells' sampling changed: those timings are of other samples
    other = run_sweep(config(world, tmp_path / "sweep", sampler="remdm-loop", throughput_generations=0),
                      progress=False, log=lambda m: None)
    resampled = [r for r in other.rows if r["model"] == "tadm"]
    assert len(resampled) == 2 and all(r["sampler"] == "remdm-loop" for r in resampled)
    assert all(r["tokens_per_second"] is None and r["throughput_generations"] is None for r in resampled)
    assert "Throughput: not timed." in other.files["table"].read_text()
    # without matplotlib the tables are written and the plots skipped with a warning
    monkeypatch.setattr(sweep_mod, "can_plot", lambda: False)
    with pytest.warns(UserWarning, match=r"plots skipped: matplotlib is not installed \(pip install 'tadm\[eval\]'\)"):
        plain = run_sweep(config(world, tmp_path / "sweep", throughput_generations=0), progress=False,
                          log=lambda m: None)
    assert set(plain.files) == {"json", "csv", "table"} and plain.files["table"].is_file()


@pytest.mark.slow
def test_interrupted_sweep_resumes_and_skips_finished_cells(world, tmp_path, monkeypatch):
    cfg = config(world, tmp_path / "resume", throughput_generations=0, reference=None)
    real, real_load = pipeline_mod.generate, pipeline_mod.load_evaluator
    generated: list[int] = []

    def interrupt_second_cell(model, sampler, **kwargs):
        if len(generated) == 2:  # two batches of two make the first cell
            raise KeyboardInterrupt
        generated.append(kwargs["policy"].interval)
        return real(model, sampler, **kwargs)

    monkeypatch.setattr(pipeline_mod, "generate", interrupt_second_cell)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, progress=False, log=lambda m: None)
    assert sorted(p.name for p in (tmp_path / "resume" / "samples" / "tadm").iterdir()) == ["T8-K1.json"]

    generated.clear()
    monkeypatch.setattr(pipeline_mod, "generate", lambda *a, **k: generated.append(k["policy"].interval) or real(*a, **k))
    out = run_sweep(cfg, progress=False, log=lambda m: None)
    assert generated == [2, 2]  # only the missing cell, two batches
    assert "sample tadm T=8 K=2" in out.evaluated and "sample tadm T=8 K=1" not in out.evaluated
    assert sorted((r["steps"], r["refresh"]) for r in out.rows) == [(8, 1), (8, 2)]

    # nothing left: no cell runs and the evaluator is not even loaded
    monkeypatch.setattr(pipeline_mod, "load_evaluator", lambda *a, **k: pytest.fail("evaluator loaded"))
    again = run_sweep(cfg, progress=False, log=lambda m: None)
    assert again.evaluated == [] and [r["gen_ppl"] for r in again.rows] == [r["gen_ppl"] for r in out.rows]
    assert again.files["plot_refresh"].read_bytes()[:8] == PNG_MAGIC

    # other settings never mix with the saved units: their cells are sampled again
    monkeypatch.setattr(pipeline_mod, "load_evaluator", real_load)
    generated.clear()
    more = run_sweep(config(world, tmp_path / "resume", throughput_generations=0, reference=None, num_samples=6),
                     progress=False, log=lambda m: None)
    assert len(generated) == 6 and all(r["num_samples"] == 6 for r in more.rows)


def test_a_sweep_folder_of_the_earlier_layout_is_refused_in_one_line(world, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.json").write_text(json.dumps({"settings": {}, "rows": [{"model": "tadm", "steps": 8}]}))
    with pytest.raises(ValueError, match="earlier layout.*sweep into a new --out"):
        run_sweep(config(world, old), progress=False, log=lambda m: None)


@pytest.mark.slow
def test_cli_sweep_runs_and_resumes(world, tmp_path, capsys):
    argv = ["eval", "sweep", "--models", f"tadm={world['model']}", "-T", "4", "-K", "1", "4", "--samples", "2",
            "--length", "8", "--reference", "none", "--throughput-generations", "5", "--throughput-warmup", "0",
            "--evaluator", str(world["evaluator"]), "--out", str(tmp_path / "cli"), "--no-progress"]
    assert main(argv) == 0
    assert "units run now" in capsys.readouterr().out
    assert main(argv) == 0
    assert "(0 units run now)" in capsys.readouterr().out
    assert (tmp_path / "cli" / "table.md").is_file()


@pytest.mark.slow
def test_bad_input(world, tmp_path):
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_model_specs(["just-a-path"])
    with pytest.raises(ValueError, match="given twice"):
        parse_model_specs(["a=x", "a=y"])
    with pytest.raises(ValueError, match="sweep.sampler.name 'ddim' is unknown; valid: auto, mdlm"):
        config(world, tmp_path, sampler="ddim")
    with pytest.raises(ValueError, match="sweep.num_samples must be a non-empty list of integers >= 1"):
        config(world, tmp_path, num_samples=0)
    with pytest.raises(ValueError, match="throughput_generations must be 0 \\(skip\\) or >= 5.*got 2"):
        config(world, tmp_path, throughput_generations=2)
    with pytest.raises(ValueError, match="sweep.refresh must include K = 1"):
        config(world, tmp_path, refresh=[2, "adaptive:tau=0.2"])
    auto = SamplerSection()
    assert auto.resolve(128, 1024) == "remdm-cap" and auto.resolve(1024, 1024) == "remdm-loop"
    # a tokenizer of another vocabulary than the model's
    other = tmp_path / "other-tok"
    from tadm.training.tokenization import train_bpe_tokenizer
    from tests.eval.test_evaluator import fixture_docs

    train_bpe_tokenizer(fixture_docs(5), vocab_size=300, save_dir=other)
    with pytest.raises(ValueError, match="vocabulary mismatch.*300.*320"):
        load_model_and_tokenizer(str(world["model"]), other)
    with pytest.raises(FileNotFoundError, match="no tokenizer found.*--tokenizer"):
        load_model_and_tokenizer("tadm-tiny")
    # a missing evaluator stops the sweep before any cell runs, with the one-line hint
    with pytest.raises(FileNotFoundError, match="prepare-evaluator"):
        run_sweep(config(world, tmp_path / "noeval", evaluator=str(tmp_path / "missing")), progress=False,
                  log=lambda m: None)


@pytest.mark.slow
def test_too_few_samples_get_no_mauve_and_say_why(world, tmp_path):
    messages: list[str] = []
    out = run_sweep(config(world, tmp_path / "few", mauve_min_samples=50, throughput_generations=0, refresh=[1]),
                    progress=False, log=messages.append)
    assert any("MAUVE is not computed: 4 samples per cell < the minimum of 50" in m for m in messages)
    row = next(r for r in out.rows if r["model"] == "tadm")
    assert row["mauve"] is None and "at least 50 samples" in row["mauve_note"]
    assert "n<50" in out.files["table"].read_text()


def test_references_are_random_whole_blocks_decoded_like_samples(world, tmp_path):
    """The reference is num_samples blocks drawn from all held-out blocks by a permutation seeded with 0 (as ReMDM
    shuffles its validation loader with a seed), not the first blocks (a few documents in corpus order)."""
    cfg = config(world, tmp_path / "ref")
    tok = tiny_tokenizer()
    texts, ids = sweep_mod._reference(cfg, tok, 16, lambda m: None)
    assert ids.shape == (4, 16) and texts == decode_samples(ids, tok)  # framing included, as in the samples
    blocks = packed_eval_blocks(str(FIXTURE), tok, 16, cache_dir=world["root"] / "cache", split="all")
    drawn = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))[:4].tolist()
    assert len(blocks) > 100 and torch.equal(ids, blocks.get_batch(drawn))
    assert max(drawn) > len(blocks) // 2 and not torch.equal(ids, blocks.get_batch(range(4)))  # spread over the split
    assert torch.equal(sweep_mod._reference(cfg, tok, 16, lambda m: None)[1], ids)  # the same blocks every time
    few_texts, few = draw_reference(blocks, 3, tok)
    assert torch.equal(few, ids[:3]) and few_texts == texts[:3]  # a smaller reference is a prefix of the same draw


@pytest.mark.slow
def test_units_scored_against_the_first_blocks_are_rescored_once(world, tmp_path):
    """Score and data units made when the reference was the first blocks (no reference_order in their spec) are
    scored again against the random draw, once; their samples are kept."""
    quiet = {"progress": False, "log": lambda m: None}
    cfg = config(world, tmp_path / "old", refresh=[1], throughput_generations=0)
    run_sweep(cfg, **quiet)
    units = sorted((tmp_path / "old" / "scores").glob("*/*.json"))
    assert [p.name for p in units] == ["data.json", "tadm-T8-K1.json"]
    for path in units:  # as an earlier tadm wrote them
        record = json.loads(path.read_text())
        assert record["spec"].pop("reference_order") == "random"
        path.write_text(json.dumps(record))
    again = run_sweep(cfg, **quiet)
    assert sorted(u.split()[-1] for u in again.evaluated) == ["K=1", "data"]  # scores only, no sample
    assert all(json.loads(p.read_text())["spec"]["reference_order"] == "random" for p in units)
    assert run_sweep(cfg, **quiet).evaluated == []


def test_the_reference_spec_records_only_settings_other_than_those_of_earlier_units(world, tmp_path):
    """Units made before the reference count and held-out share were recorded (count = num_samples, share 0.02)
    keep their spec; any other value is recorded, so those units are not reused for it."""
    assert config(world, tmp_path).reference_spec() == {}
    assert config(world, tmp_path, num_reference=4).reference_spec() == {}  # = num_samples: the same reference
    assert config(world, tmp_path, num_reference=3).reference_spec() == {"num_reference": 3}
    assert config(world, tmp_path, reference_val_fraction=0.05).reference_spec() == {}  # split "all": no held-out share
    held_out = config(world, tmp_path, reference_split="val", reference_val_fraction=0.05, num_reference=60)
    assert held_out.reference_spec() == {"num_reference": 60, "reference_val_fraction": 0.05}
    assert config(world, tmp_path, reference_split="val", reference_val_fraction=0.02).reference_spec() == {}


@pytest.mark.slow
def test_changed_mauve_clusters_or_reference_count_rescore_and_keep_the_samples(world, tmp_path):
    quiet = {"progress": False, "log": lambda m: None}
    out = tmp_path / "rescore"

    def sweep(**changes):
        result = run_sweep(config(world, out, refresh=[1], throughput_generations=0, **changes), **quiet)
        return result, next(r for r in result.rows if r["model"] == "tadm")

    first, row = sweep(mauve_num_buckets="auto")
    assert row["mauve_buckets"] == 2 and row["mauve_num_reference"] == 4
    unit = json.loads(next(out.glob("scores/*/tadm-T8-K1.json")).read_text())["spec"]
    assert not {"mauve_num_buckets", "num_reference"} & set(unit)  # the defaults leave the spec as it always was
    assert sweep(mauve_num_buckets="auto")[0].evaluated == []
    three, row = sweep(mauve_num_buckets=3)
    assert [u.split()[-3:] for u in three.evaluated] == [["tadm", "T=8", "K=1"]]  # the score only, not the samples
    assert row["mauve_buckets"] == 3
    fewer, row = sweep(mauve_num_buckets=3, num_reference=3)
    assert sorted(u.split()[-1] for u in fewer.evaluated) == ["K=1", "data"]
    assert row["mauve_num_reference"] == 3
    assert sweep(mauve_num_buckets=3, num_reference=3)[0].evaluated == []
