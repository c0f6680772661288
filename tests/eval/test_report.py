"""Result files, the paper-layout Markdown tables and the plots, from hand-written rows."""

from __future__ import annotations

import json
import math

import pytest

from tadm.eval.plots import write_plots
from tadm.eval.report import RESULT_FIELDS, cell_key, markdown_report, read_results, write_results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(model, T, K, gen_ppl, tps, calls, rel, mauve=0.5, entropy=5.3):
    return {"model": model, "steps": T, "refresh": K, "gen_ppl": gen_ppl, "tokens_per_second": tps,
            "layer_calls": calls, "compute_relative": rel, "mauve": mauve, "entropy": entropy, "length": 1024}


# Paper Table 2 (T = 128): ADLM 2304 calls (1.50x), 320.62 tok/s; TADM K=2 1536 (1.00x), 445.23 tok/s (1.39x)
ROWS = [
    {"model": "data", "steps": None, "refresh": None, "gen_ppl": 14.8, "entropy": 5.44, "mauve": None},
    row("adlm", 128, 1, 52.5, 320.62, 2304, 1.5, mauve=0.140, entropy=5.52),
    row("tadm", 128, 1, 38.36, 347.69, 2304, 1.5, mauve=0.135, entropy=5.425),
    row("tadm", 128, 2, 41.56, 445.23, 1536, 1.0, mauve=0.084, entropy=5.433),
    row("tadm", 256, 2, 29.86, 222.28, 3072, 1.0),
]


def test_markdown_table_2_and_4_layouts():
    text = markdown_report(ROWS, throughput_baseline="adlm")
    lines = text.splitlines()
    # the refresh-interval sweep is the paper's Table 4 (tab:TADM-refresh-interval-sweep); Table 5 is the ADLM
    # cache-reuse table
    assert [line for line in lines if line.startswith("#")] == [
        "# Evaluation sweep", "## Quality, compute and throughput (paper Table 2 layout)",
        "## Refresh-interval sweep (paper Table 4 layout)"]
    assert "Table 5" not in text
    nested = markdown_report(ROWS, level=3).splitlines()
    assert [line for line in nested if line.startswith("##")] == [
        "### Quality, compute and throughput (paper Table 2 layout)", "### Refresh-interval sweep (paper Table 4 layout)"]
    header = next(line for line in lines if line.startswith("| Method |"))
    assert header.count("T=128") == 5 and header.count("T=256") == 5
    tadm2 = next(line for line in lines if line.startswith("| tadm (K=2) |"))
    cells = [c.strip() for c in tadm2.strip("|").split("|")]
    # Method | MAUVE x2 | Gen PPL x2 | Entropy x2 | Compute x2 | Throughput x2
    assert cells == ["tadm (K=2)", "0.084", "0.500", "41.56", "29.86", "5.433", "5.300",
                     "1536 (1.00x)", "3072 (1.00x)", "445.23 (1.39x)", "222.28"]  # no ADLM row at T=256
    data = next(line for line in lines if line.startswith("| Data |"))
    assert "14.80" in data and "5.440" in data
    t5 = [line for line in lines if line.startswith("| tadm (K=1) |")][1]
    assert [c.strip() for c in t5.strip("|").split("|")] == ["tadm (K=1)", "0.135", "38.36", "5.425", "347.69",
                                                             "-", "-", "-", "-"]
    plain = next(line for line in markdown_report(ROWS).splitlines() if line.startswith("| tadm (K=2) |"))
    assert [c.strip() for c in plain.strip("|").split("|")][-2:] == ["445.23", "222.28"]  # no baseline: plain tok/s


def test_results_round_trip_and_csv(tmp_path):
    rows = [dict(ROWS[1], mauve=math.nan)]
    json_path, csv_path = write_results(tmp_path, {"seed": 0}, rows, {"python": "3"})
    settings, back = read_results(tmp_path)
    assert settings == {"seed": 0} and back[0]["mauve"] is None  # NaN is stored as null
    assert cell_key(back[0]) == ("adlm", 128, 1)
    lines = csv_path.read_text().splitlines()
    assert lines[0].split(",") == list(RESULT_FIELDS) and len(lines) == 2
    assert json.loads(json_path.read_text())["machine"] == {"python": "3"}
    assert read_results(tmp_path / "nothing") is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a tadm sweep results file"):
        read_results(tmp_path / "bad")


@pytest.mark.slow
def test_plots_are_png(tmp_path):
    paths = write_plots(ROWS, tmp_path)
    assert [p.name for p in paths] == ["genppl_vs_throughput.png", "genppl_vs_refresh.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000
