"""Result files of an evaluation sweep and their Markdown tables in the paper's layout.

A sweep directory holds

* ``results.json``: ``{"settings": ..., "machine": ..., "rows": [...]}``, the resolved settings
  (seeds included), a description of the machine, and one row per finished cell;
* ``results.csv``: the same rows, one line each (columns :data:`RESULT_FIELDS`);
* ``table.md``: :func:`markdown_report`, the paper's Table 2 layout (MAUVE, Gen PPL, entropy,
  compute (x MDLM) and throughput, one column per T) and Table 4 layout (the refresh-interval
  sweep, tab:TADM-refresh-interval-sweep: per T, MAUVE, Gen PPL, entropy, tok/s, one row per model
  and refresh interval K).

Both result files are rewritten atomically after every cell, so an interrupted sweep loses at most
the cell it was working on.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tadm.records import machine_info, markdown_table, write_csv, write_json

__all__ = ["DATA_MODEL", "format_mauve", "format_number", "format_tps", "RESULT_FIELDS", "cell_key", "markdown_report",
           "read_results", "write_results", "zero_shot_markdown"]

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
DATA_MODEL = "data"  # the row of the held-out reference text itself

RESULT_FIELDS = (
    "model", "path", "steps", "refresh", "sampler", "length", "num_samples", "seed", "mauve", "mauve_num_samples",
    "mauve_num_reference", "mauve_buckets", "mauve_note", "gen_ppl", "gen_ppl_nll", "gen_ppl_tokens", "entropy",
    "layer_calls", "layer_calls_counted", "baseline_layer_calls", "compute_relative", "tokens_per_second",
    "tokens_per_second_min", "tokens_per_second_max", "throughput_generations", "throughput_batch_size",
    "sampling_seconds", "cell_seconds",
)


def refresh_value(value: Any) -> int | str | None:
    """A row's ``refresh``: the interval K of a fixed policy (an int, also when read back from CSV as
    ``"4"``), or the name of another refresh policy (``"adaptive-tau0.3"``); None for the data row."""
    if value is None or value == "":
        return None
    text = str(value)
    return int(text) if text.lstrip("-").isdigit() else text


def refresh_order(value: Any) -> tuple[int, int, str]:
    """Sort key: fixed intervals by K first, then named policies by name."""
    value = refresh_value(value)
    return (0, value, "") if isinstance(value, int) else (1, 0, str(value))


def refresh_label(value: Any) -> str:
    """``K=4`` for a fixed interval, the policy's name otherwise."""
    value = refresh_value(value)
    return f"K={value}" if isinstance(value, int) else str(value)


def cell_key(row: dict[str, Any]) -> tuple[str, int | None, int | str | None]:
    """(model, T, K) of a result row; the data row has T = K = None; K names a non-fixed policy."""
    steps = row.get("steps")
    return (str(row["model"]), None if steps is None else int(steps), refresh_value(row.get("refresh")))


def write_results(
    out_dir: str | os.PathLike[str],
    settings: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    machine: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.csv`` into ``out_dir`` (atomically); return both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"settings": settings, "machine": machine or machine_info(), "rows": list(rows)}
    json_path, csv_path = out / RESULTS_JSON, out / RESULTS_CSV
    write_json(json_path, payload, indent=2)
    write_csv(csv_path, RESULT_FIELDS, rows)
    return json_path, csv_path


def read_results(out_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """(settings, rows) of an earlier sweep in ``out_dir``, or None if it holds no results.json."""
    path = Path(out_dir) / RESULTS_JSON
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
        return dict(payload["settings"]), list(payload["rows"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a tadm sweep results file ({err}); move it away or use another --out") from err


# ----------------------------------------------------------------------------------------- tables
def format_number(value: Any, digits: int) -> str:
    """``value`` to ``digits`` decimals; "-" for a missing or non-finite value."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{float(value):.{digits}f}"


def format_mauve(row: dict[str, Any]) -> str:
    """MAUVE with its counts: "0.612 [64, 6 cl.]"; "n<50" when it was refused; plain when counts are unknown."""
    if row.get("mauve") is None:
        minimum = re.search(r"at least (\d+)", row.get("mauve_note") or "")
        return f"n<{minimum.group(1)}" if minimum else "-"
    value = format_number(row.get("mauve"), 3)
    if row.get("mauve_buckets") is None:
        return value
    return f"{value} [{row.get('mauve_num_samples')}, {row.get('mauve_buckets')} cl.]"


def format_tps(row: dict[str, Any], digits: int = 2) -> str:
    """Tokens/s (tokens over the median generation time) with the [slowest-fastest] generation's when known."""
    tps = row.get("tokens_per_second")
    if tps is None:
        return "-"
    low, high = row.get("tokens_per_second_min"), row.get("tokens_per_second_max")
    if low is None or high is None:
        return format_number(tps, digits)
    return f"{format_number(tps, digits)} [{format_number(low, 1)}-{format_number(high, 1)}]"


def _ordered(rows: Sequence[dict[str, Any]]) -> tuple[list[tuple[str, int | str]], list[int]]:
    """Distinct (model, K) in first-seen model order then K (named policies last), and the sorted T values."""
    models = list(dict.fromkeys(r["model"] for r in rows if r["model"] != DATA_MODEL))
    pairs = sorted({(r["model"], refresh_value(r["refresh"])) for r in rows if r["model"] != DATA_MODEL},
                   key=lambda p: (models.index(p[0]), refresh_order(p[1])))
    steps = sorted({int(r["steps"]) for r in rows if r["model"] != DATA_MODEL})
    return pairs, steps


_TABLE2_METRICS = [("mauve", "MAUVE ↑"), ("gen_ppl", "Gen PPL ↓"), ("entropy", "Entropy ↑"),
                   ("compute", "Compute ↓"), ("throughput", "Throughput ↑")]


def _metric_cell(row: dict[str, Any] | None, name: str, base_tps: float | None) -> str:
    """One sweep cell: MAUVE, Gen PPL, entropy, "calls (ratio x)" or "tok/s (ratio x)" against ``base_tps``."""
    if row is None:
        return "-"
    if name == "mauve":
        return format_mauve(row)
    if name in ("gen_ppl", "entropy"):
        return format_number(row.get(name), 2 if name == "gen_ppl" else 3)
    if name == "compute":
        calls, rel = row.get("layer_calls"), row.get("compute_relative")
        return "-" if calls is None else f"{int(calls)} ({format_number(rel, 2)}x)"
    tps = row.get("tokens_per_second")
    if tps is None:
        return "-"
    return f"{format_number(tps, 2)} ({float(tps) / base_tps:.2f}x)" if base_tps else format_number(tps, 2)


def _table2(index: dict[tuple, dict[str, Any]], pairs: list[tuple[str, Any]], steps: list[int],
            base_tps: dict[int, float | None]) -> str:
    """Table 2 layout: one column per (metric, T), a Data row first when the sweep has one."""
    header = ["Method"] + [f"{label} T={T}" for _, label in _TABLE2_METRICS for T in steps]
    body = []
    data = index.get((DATA_MODEL, None, None))
    if data is not None:
        span = [format_number(data.get("mauve"), 2), format_number(data.get("gen_ppl"), 2),
                format_number(data.get("entropy"), 3), "-", "-"]
        body.append(["Data"] + [span[i] for i in range(len(_TABLE2_METRICS)) for _ in steps])
    for model, K in pairs:
        cells = [_metric_cell(index.get((model, T, K)), n, base_tps[T]) for n, _ in _TABLE2_METRICS for T in steps]
        body.append([f"{model} ({refresh_label(K)})"] + cells)
    return markdown_table(header, body)


def _table4(index: dict[tuple, dict[str, Any]], pairs: list[tuple[str, Any]], steps: list[int]) -> str:
    """Table 4 layout (the refresh-interval sweep): per T, MAUVE / Gen PPL / entropy / tok/s for each (model, K)."""
    header = ["Method (K)"] + [f"{label} T={T}" for T in steps
                               for label in ("MAUVE ↑", "Gen PPL ↓", "Entropy ↑", "Tok/s ↑")]
    body = []
    for model, K in pairs:
        cells = []
        for T in steps:
            row = index.get((model, T, K))
            cells += [_metric_cell(row, name, None) for name in ("mauve", "gen_ppl", "entropy")]
            cells.append("-" if row is None else format_tps(row))
        body.append([f"{model} ({refresh_label(K)})"] + cells)
    return markdown_table(header, body)


def markdown_report(
    rows: Sequence[dict[str, Any]],
    *,
    throughput_baseline: str | None = None,
    title: str = "Evaluation sweep",
    notes: Sequence[str] = (),
    level: int = 2,
) -> str:
    """Markdown tables of sweep rows in the paper's Table 2 and Table 4 layouts, under headings of ``level``.

    Compute is printed as "calls (ratio x)" relative to the baseline of each row
    (``compute_relative``, normalised to MDLM). Throughput is printed as "tok/s (ratio x)" relative
    to ``throughput_baseline``'s K = 1 row at the same T when that model is in the sweep (the
    paper normalises to ADLM), else as plain tok/s.
    """
    index = {cell_key(r): r for r in rows}
    pairs, steps = _ordered(rows)
    base_tps: dict[int, float | None] = {}
    for T in steps:  # model names are strings, so no row matches a throughput_baseline of None
        value = index.get((throughput_baseline, T, 1), {}).get("tokens_per_second")
        base_tps[T] = float(value) if value else None
    parts = [f"# {title}", ""] + list(notes) + ([""] if notes else [])
    heading = "#" * level
    parts += [f"{heading} Quality, compute and throughput (paper Table 2 layout)", "",
              _table2(index, pairs, steps, base_tps), ""]
    parts += [f"{heading} Refresh-interval sweep (paper Table 4 layout)", "", _table4(index, pairs, steps), ""]
    return "\n".join(parts)


def zero_shot_markdown(records: Sequence[dict[str, Any]]) -> str:
    """Perplexities in the layout of the paper's zero-shot table: one row per model, one column per dataset.

    ``records`` carry ``model``, ``data``, ``ppl`` and ``kind``; NELBO bounds are marked with "≤".
    """
    models = list(dict.fromkeys(r["model"] for r in records))
    datasets = list(dict.fromkeys(r["data"] for r in records))
    index = {(r["model"], r["data"]): r for r in records}
    body = []
    for model in models:
        cells = []
        for data in datasets:
            r = index.get((model, data))
            cells.append("-" if r is None else ("≤ " if r.get("kind") == "nelbo" else "") + format_number(r.get("ppl"), 2))
        body.append([model] + cells)
    return markdown_table(["Model"] + datasets, body)
