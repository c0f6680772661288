"""Sweeps: result files, the paper-layout table, both plots, resuming, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import tadm.eval.sweep as sweep_mod
from tadm.cli import main
from tadm.eval.sweep import SweepConfig, load_model_and_tokenizer, parse_model_specs, resolve_sampler, run_sweep
from tests.eval.test_evaluator import FIXTURE, save_ar_evaluator, tiny_diffusion, tiny_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sweep-world")
    model_dir = root / "tadm"
    tiny_diffusion("tadm", max_seq_len=32).save_pretrained(model_dir)
    tiny_tokenizer().save(model_dir)
    return {"model": model_dir, "evaluator": save_ar_evaluator(root / "evaluator"), "root": root}


def config(world, out: Path, **overrides) -> SweepConfig:
    settings = dict(models={"tadm": str(world["model"])}, steps=[8], refresh=[1, 2], num_samples=4, length=16,
                    sampler="remdm-cap", batch_size=2, evaluator=str(world["evaluator"]), reference=str(FIXTURE),
                    reference_split="all", mauve_num_buckets=2, mauve_min_samples=2, throughput_generations=5,
                    throughput_warmup=0,
                    cache_dir=str(world["root"] / "cache"), out_dir=str(out))
    return SweepConfig(**{**settings, **overrides})


def test_sweep_writes_results_table_and_plots(world, tmp_path, monkeypatch):
    loads = []
    real_load = sweep_mod.load_evaluator
    monkeypatch.setattr(sweep_mod, "load_evaluator", lambda *a, **k: loads.append(a) or real_load(*a, **k))
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
    assert payload["settings"]["seeds"]["sampling"] == 0 and payload["settings"]["resolved_baseline_layers"] == 12
    assert payload["settings"]["evaluator_info"]["backend"] == "tadm"
    assert {"torch", "python", "cpu_count"} <= set(payload["machine"])
    assert files["csv"].read_text().splitlines()[0].startswith("model,path,steps,refresh")
    assert len(files["csv"].read_text().splitlines()) == 1 + 3


def test_interrupted_sweep_resumes_and_skips_finished_cells(world, tmp_path, monkeypatch):
    cfg = config(world, tmp_path / "resume", throughput_generations=0, reference=None)
    real = sweep_mod.evaluate_cell
    calls: list[tuple[int, int]] = []

    def interrupt_second(ctx, T, K):
        if calls:
            raise KeyboardInterrupt
        calls.append((T, K))
        return real(ctx, T, K)

    monkeypatch.setattr(sweep_mod, "evaluate_cell", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, progress=False, log=lambda m: None)
    saved = json.loads((tmp_path / "resume" / "results.json").read_text())["rows"]
    assert [(r["steps"], r["refresh"]) for r in saved] == [(8, 1)]

    counted: list[tuple[int, int]] = []

    def counting(ctx, T, K):
        counted.append((T, K))
        return real(ctx, T, K)

    monkeypatch.setattr(sweep_mod, "evaluate_cell", counting)
    out = run_sweep(cfg, progress=False, log=lambda m: None)
    assert counted == [(8, 2)] and out.evaluated == [("tadm", 8, 2)]
    assert sorted((r["steps"], r["refresh"]) for r in out.rows) == [(8, 1), (8, 2)]
    assert out.rows[0]["gen_ppl"] == saved[0]["gen_ppl"]  # the finished cell is kept, not recomputed

    # nothing left: no cell runs and the evaluator is not even loaded
    monkeypatch.setattr(sweep_mod, "load_evaluator", lambda *a, **k: pytest.fail("evaluator loaded"))
    again = run_sweep(cfg, progress=False, log=lambda m: None)
    assert counted == [(8, 2)] and again.evaluated == []
    assert again.files["plot_refresh"].read_bytes()[:8] == PNG_MAGIC

    # other settings must not silently mix with the saved cells
    with pytest.raises(ValueError, match="other settings.*num_samples: 4 there, 8 now"):
        run_sweep(config(world, tmp_path / "resume", throughput_generations=0, reference=None, num_samples=8),
                  progress=False, log=lambda m: None)


def test_cli_sweep_runs_and_resumes(world, tmp_path, capsys):
    argv = ["eval", "sweep", "--models", f"tadm={world['model']}", "-T", "4", "-K", "1", "4", "--samples", "2",
            "--length", "8", "--reference", "none", "--throughput-generations", "5", "--throughput-warmup", "0",
            "--evaluator", str(world["evaluator"]), "--out", str(tmp_path / "cli"), "--no-progress"]
    assert main(argv) == 0
    assert "2 cells run now" in capsys.readouterr().out
    assert main(argv) == 0
    assert "0 cells run now" in capsys.readouterr().out
    assert (tmp_path / "cli" / "table.md").is_file()


def test_bad_input(world, tmp_path):
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_model_specs(["just-a-path"])
    with pytest.raises(ValueError, match="given twice"):
        parse_model_specs(["a=x", "a=y"])
    with pytest.raises(ValueError, match="unknown sampler 'ddim'; valid: auto, mdlm"):
        config(world, tmp_path, sampler="ddim")
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        config(world, tmp_path, num_samples=0)
    with pytest.raises(ValueError, match="throughput_generations must be 0 \\(skip\\) or >= 5.*got 2"):
        config(world, tmp_path, throughput_generations=2)
    assert resolve_sampler("auto", 128, 1024) == "remdm-cap" and resolve_sampler("auto", 1024, 1024) == "remdm-loop"
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


def test_too_few_samples_get_no_mauve_and_say_why(world, tmp_path):
    messages: list[str] = []
    out = run_sweep(config(world, tmp_path / "few", mauve_min_samples=50, throughput_generations=0, refresh=[1]),
                    progress=False, log=messages.append)
    assert any("MAUVE is not computed: 4 samples per cell < the minimum of 50" in m for m in messages)
    row = next(r for r in out.rows if r["model"] == "tadm")
    assert row["mauve"] is None and "at least 50 samples" in row["mauve_note"]
    assert "n<50" in out.files["table"].read_text()


def test_references_are_whole_blocks_decoded_like_samples(world, tmp_path):
    from tadm.eval.gen_ppl import decode_samples

    cfg = config(world, tmp_path / "ref")
    tok = tiny_tokenizer()
    texts, ids = sweep_mod._reference(cfg, tok, 16, lambda m: None)
    assert ids.shape[1] == 16 and texts == decode_samples(ids, tok)  # framing included, as in the samples
