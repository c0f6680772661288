"""The single-metric ``tadm eval`` subcommands with --json."""

from __future__ import annotations

import json

import pytest

from tadm.cli import main
from tadm.eval.likelihood import diffusion_nelbo, packed_eval_blocks
from tadm.eval.mauve import mauve_score
from tests.eval.test_evaluator import (
    FIXTURE,
    fixture_docs,
    save_ar_evaluator,
    tiny_ar_evaluator,
    tiny_diffusion,
    tiny_tokenizer,
)


@pytest.mark.slow
def test_likelihood_json_matches_the_api(tmp_path, capsys):
    model_dir = tmp_path / "mdlm"
    tiny_diffusion("mdlm").save_pretrained(model_dir)
    tiny_tokenizer().save(model_dir)
    argv = ["eval", "likelihood", "--model", str(model_dir), "--data", str(FIXTURE), "--seq-len", "32",
            "--max-blocks", "3", "--t-samples", "2", "--seed", "4", "--cache-dir", str(tmp_path / "cache"), "--json"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    blocks = packed_eval_blocks(FIXTURE, tiny_tokenizer(), 32, cache_dir=tmp_path / "cache")
    expected = diffusion_nelbo(tiny_diffusion("mdlm"), blocks, num_t_samples=2, max_blocks=3, seed=4)
    assert record["kind"] == "nelbo" and record["num_sequences"] == 3
    assert record["ppl"] == pytest.approx(expected.ppl, rel=1e-6)


@pytest.mark.slow
def test_throughput_json_reports_counted_and_analytic_calls(capsys):
    argv = ["eval", "throughput", "--model", "tadm-tiny", "--steps", "6", "--refresh", "1", "4", "--length", "8",
            "--generations", "1", "--warmup", "0", "--json"]
    assert main(argv) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["refresh_interval"] for r in records] == [1, 4]
    for r in records:
        assert r["layer_calls"]["total"] == r["analytic_layer_calls"] and r["tokens_per_second"] > 0
    assert records[1]["analytic_layer_calls"] == 6 * 1 + 2 * 2  # 1 denoiser layer per step, 2 anchor layers x 2


@pytest.mark.slow
def test_likelihood_and_throughput_print_a_line_and_a_table_without_json(tmp_path, capsys):
    model_dir = tmp_path / "mdlm"
    tiny_diffusion("mdlm").save_pretrained(model_dir)
    tiny_tokenizer().save(model_dir)
    argv = ["eval", "likelihood", "--model", f"small={model_dir}", "--data", f"slice={FIXTURE}", "--seq-len", "32",
            "--max-blocks", "3", "--seed", "4", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert line == (f"small on slice (all): perplexity <= {record['ppl']:.3f} ({record['nll']:.4f} nats/token over "
                    f"{record['num_tokens']} tokens, nelbo)")

    argv = ["eval", "throughput", "--model", "tadm-tiny", "--steps", "6,4", "--refresh", "4,1", "--length", "8",
            "--generations", "1", "--warmup", "0"]
    assert main(argv) == 0
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["T", "K", "tokens/s", "vs", "K=1", "layer", "calls", "analytic"]
    cells = [row.split() for row in rows]
    assert [c[:2] for c in cells] == [["6", "K=4"], ["6", "K=1"], ["4", "K=4"], ["4", "K=1"]]
    # each cell against K = 1 at its own T, whatever the order of -T and -K
    for cached, uncached in ((cells[0], cells[1]), (cells[2], cells[3])):
        assert uncached[3] == "1.00x"
        assert float(cached[3][:-1]) == pytest.approx(float(cached[2]) / float(uncached[2]), abs=0.006)
    assert [c[4:] for c in cells[:2]] == [["10", "10"], ["18", "18"]]  # counted = analytic (Eq. anchor-cache-compute)
    assert main(argv[:7] + ["4"] + argv[8:]) == 0  # no K = 1: no ratio
    assert capsys.readouterr().out.strip().splitlines()[1].split()[3] == "-"


@pytest.mark.slow
def test_mauve_json_matches_the_api(tmp_path, capsys):
    evaluator = save_ar_evaluator(tmp_path / "ar")
    argv = ["eval", "mauve", "--texts", str(FIXTURE), "--reference", str(FIXTURE), "--max-texts", "12",
            "--num-buckets", "2", "--evaluator", str(evaluator), "--max-tokens", "48", "--min-samples", "12", "--json"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["num_samples"] == record["num_reference"] == 12
    docs = fixture_docs(12)
    expected = mauve_score(docs, docs, tiny_ar_evaluator(), max_tokens=48, num_buckets=2, min_samples=12)
    assert record["mauve"] == pytest.approx(expected.mauve) and record["num_buckets"] == 2
    assert main(argv[:-1] + ["--num-buckets", "many"]) == 2
    assert "argument --num-buckets: must be 'auto' or an integer >= 1, got 'many'" in capsys.readouterr().err
    default_minimum = argv[: argv.index("--min-samples")] + ["--json"]
    assert main(default_minimum) == 2  # 12 texts < the default minimum of 50
    assert "MAUVE needs at least 50 samples and 50 reference texts, got 12 samples" in capsys.readouterr().err


def test_prepare_evaluator_reports_an_existing_copy(tmp_path, capsys):
    (tmp_path / "ready").mkdir()
    (tmp_path / "ready" / "config.json").write_text("{}")
    (tmp_path / "ready" / "tadm_evaluator.json").write_text('{"preset": "smollm2-135m"}')  # the marker tadm writes
    assert main(["eval", "prepare-evaluator", "--dest", str(tmp_path / "ready")]) == 0
    assert "already prepared" in capsys.readouterr().out


@pytest.mark.slow
def test_likelihood_zero_shot_table(tmp_path, capsys):
    mdlm_dir = tmp_path / "mdlm"
    tiny_diffusion("mdlm").save_pretrained(mdlm_dir)
    tiny_tokenizer().save(mdlm_dir)
    ar_dir = save_ar_evaluator(tmp_path / "ar")
    other = tmp_path / "other.txt"
    other.write_text(" ".join(fixture_docs()[-3:]))
    argv = ["eval", "likelihood", "--model", f"AR={ar_dir}", f"MDLM={mdlm_dir}", "--data", f"brown={FIXTURE}",
            str(other), "--seq-len", "32", "--max-blocks", "2", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| Model | brown | other.txt |"
    assert lines[2].startswith("| AR | ") and "≤" not in lines[2]  # exact perplexity
    assert lines[3].startswith("| MDLM | ≤ ") and lines[3].count("≤") == 2  # NELBO bounds
    assert main(argv + ["--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["data"], r["kind"]) for r in records] == [
        ("AR", "brown", "exact"), ("AR", "other.txt", "exact"), ("MDLM", "brown", "nelbo"), ("MDLM", "other.txt", "nelbo")]
    ar_brown = f"{records[0]['ppl']:.2f}"
    assert f"| AR | {ar_brown} |" in "\n".join(lines)


@pytest.mark.slow
def test_staleness_cli_json_plot_and_naive_variant(tmp_path, capsys):
    from tadm.eval.likelihood import stale_anchor_nelbo

    model_dir = tmp_path / "tadm"
    tiny_diffusion("tadm").save_pretrained(model_dir)
    tiny_tokenizer().save(model_dir)
    plot = tmp_path / "curve.png"
    argv = ["eval", "staleness", "--model", f"t={model_dir}", "--data", str(FIXTURE), "--split", "all", "--seq-len",
            "16", "-T", "4", "8", "--max-age", "2", "-K", "1", "2", "--max-blocks", "4", "--naive",
            "--cache-dir", str(tmp_path / "cache"), "--plot", str(plot), "--json"]
    assert main(argv) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in records] == ["t", "t (naive reuse)"]
    blocks = packed_eval_blocks(FIXTURE, tiny_tokenizer(), 16, cache_dir=tmp_path / "cache")
    expected = stale_anchor_nelbo(tiny_diffusion("tadm"), blocks, steps=(4, 8), max_age=2, max_blocks=4)
    assert records[0]["staleness"]["curves"]["8"] == pytest.approx(expected.curves[8], rel=1e-6)
    assert records[0]["cached"]["num_steps"] == 4 and set(records[0]["cached"]["bounds"]) == {"1", "2"}
    assert records[1]["staleness"]["fresh"] == records[0]["staleness"]["fresh"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(argv[:-1]) == 0  # the text table
    text = capsys.readouterr().out
    assert "uninformative anchor" in text and "T=8" in text and "cached process, discrete T=4" in text


@pytest.mark.parametrize("extra,message", [
    (["--max-age", "-1"], "argument --max-age: must be >= 0, got -1"),
    (["-T", "0"], "argument -T/--steps: must be >= 1, got 0"),
    (["-K", "0"], "argument -K/--refresh: anchor refresh interval K must be an integer >= 1, got 0"),
])
def test_staleness_cli_bad_numbers(extra, message, capsys):
    assert main(["eval", "staleness", "--model", "tadm-tiny", *extra]) == 2
    assert message in capsys.readouterr().err


def test_staleness_cli_refuses_a_model_without_anchor(tmp_path, capsys):
    model_dir = tmp_path / "mdlm"
    tiny_diffusion("mdlm").save_pretrained(model_dir)
    tiny_tokenizer().save(model_dir)
    assert main(["eval", "staleness", "--model", str(model_dir), "--data", str(FIXTURE)]) == 2
    err = capsys.readouterr().err
    assert "MDLM has no anchor network" in err and err.count("\n") == 1


def test_tasks_without_a_tokenizer_says_what_works_for_the_command(tmp_path, capsys):
    (tmp_path / "aime.jsonl").write_text('{"problem": "p", "answer": 1}\n')
    argv = ["eval", "tasks", "--model", "tadm-tiny", "--tasks", "aime", "--data-dir", str(tmp_path), "-K", "1",
            "--seeds", "0", "-T", "2", "--max-gen-toks", "2", "--device", "cpu", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tadm eval tasks: error: no tokenizer found for model 'tadm-tiny': --model takes the tokenizer "
                   "saved in or beside a checkpoint directory, and a builder name (random weights) has none; give a "
                   "trained checkpoint directory")
