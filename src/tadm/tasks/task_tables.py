"""The two tables of the post-training results (sec. "TADM:Post-train"), from the units of a task run.

* the task table: one row per method (the base, i.e. DiffusionGemma, at K = 1; TADM at each K), accuracy per benchmark
  (mean ± standard deviation over seeds, in %), throughput (generated tokens over generation wall
  time, all benchmarks) and compute (denoising Transformer-layer calls per request, and relative to
  the first row);
* the naive-reuse comparison: per K, accuracy (mean over benchmarks of the seed-mean) and corruption
  (share of parsed judge verdicts flagged incoherent or repetition_loop, pooled) for naive reuse and TADM.

Written as ``table.md``, ``task_table.csv``, ``naive_table.csv``, ``cells.csv`` (every task x method
x K cell), ``results.json`` (the run's settings, cells and both tables) and, with more than one K,
``accuracy_vs_k.png`` (:func:`tadm.eval.plots.plot_task_accuracy_vs_refresh`).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tadm.eval.plots import PLOTS_SKIPPED, can_plot, plot_task_accuracy_vs_refresh
from tadm.eval.significance import PairedSummary, paired_summary, prompt_differences
from tadm.records import markdown_table, write_csv, write_json, write_text

__all__ = ["CELL_FIELDS", "cells", "naive_rows", "prompt_comparison", "task_rows", "timeout_notes", "write_tables"]

CELL_FIELDS = ("task", "method", "K", "seeds", "examples", "accuracy_mean", "accuracy_std", "timeouts",
               "tokens_per_second", "layer_calls_per_request", "generated_tokens", "seconds", "corruption",
               "null_share", "unparsed", "judged")
TIMEOUT_MARK = "†"  # on an accuracy of a code task where more than half the programs (over seeds) timed out


def _spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _judged(units: list[dict[str, Any]]) -> dict[str, Any]:
    summaries = [u["judge"] for u in units if u.get("judge")]
    if not summaries:
        return {"corruption": None, "null_share": None, "unparsed": None, "judged": 0}
    parsed = sum(s["parsed"] for s in summaries)
    share = lambda key: sum(s[key] for s in summaries) / parsed if parsed else math.nan  # noqa: E731
    return {"corruption": share("corrupted"), "null_share": share("null"),
            "unparsed": sum(s["unparsed"] for s in summaries), "judged": sum(s["total"] for s in summaries)}


def _cost(units: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(u["stats"]["generated_tokens"] for u in units)
    seconds = sum(u["stats"]["seconds"] for u in units)
    calls = sum(u["stats"]["layer_calls"].get("total", 0) for u in units)
    requests = sum(u["stats"]["requests"] for u in units)
    per_request = sum(u["stats"]["layer_calls_per_request"] * u["stats"]["requests"] for u in units)
    return {"generated_tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            "layer_calls": calls, "requests": requests,
            "layer_calls_per_request": per_request / requests if requests else 0.0}


def cells(units: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (task, method, K): accuracy over seeds, throughput, compute and corruption."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for unit in units:
        groups.setdefault((unit["task"], unit["method"], unit["K"]), []).append(unit)
    out = []
    for (task, method, K), group in groups.items():
        mean, std = _spread([u["accuracy"] for u in group])
        cost = _cost(group)
        out.append({"task": task, "method": method, "K": K, "seeds": len(group), "examples": group[0]["n"],
                    "accuracy_mean": mean, "accuracy_std": std, "timeouts": sum(u.get("timeouts", 0) for u in group),
                    **cost, **_judged(group)})
    return out


def _label(method: str, K: Any) -> str:
    return {"baseline": "Base", "tadm": "TADM", "naive": "naive reuse"}[method] + f", K={K}"


def _timeouts_dominate(cell: dict[str, Any]) -> bool:
    """More than half the cell's programs (over seeds) timed out: its accuracy measures the time limit."""
    return 2 * cell.get("timeouts", 0) > cell["examples"] * cell["seeds"]


def timeout_notes(all_cells: Sequence[dict[str, Any]], benches: Sequence[Any], code_timeout: Any = None) -> list[str]:
    """One line per cell where time-outs dominate (:func:`_timeouts_dominate`)."""
    titles = {b.name: b.title for b in benches}
    limit = f" at --code-timeout {code_timeout:g} s" if isinstance(code_timeout, (int, float)) else ""
    return [f"{titles.get(c['task'], c['task'])}, {_label(c['method'], c['K'])}: {c['timeouts']} of "
            f"{c['examples'] * c['seeds']} programs timed out{limit}" for c in all_cells if _timeouts_dominate(c)]


def task_rows(all_cells: list[dict[str, Any]], units: Sequence[dict[str, Any]], benches: Sequence[Any],
              rows: Sequence[Any]) -> list[dict[str, Any]]:
    """The task table: accuracy per benchmark, tokens/s and compute for each non-naive method."""
    table, first = [], None
    for method in [m for m in rows if m.name != "naive"]:
        mine = [u for u in units if u["method"] == method.name and u["K"] == method.K]
        cost = _cost(mine)
        first = first or cost["layer_calls"]
        row: dict[str, Any] = {"method": _label(method.name, method.K)}
        for bench in benches:
            cell = next(c for c in all_cells if (c["task"], c["method"], c["K"]) == (bench.name, method.name, method.K))
            row[bench.title] = cell["accuracy_mean"], cell["accuracy_std"]
        row.update({"tok/s": cost["tokens_per_second"], "layer calls/request": cost["layer_calls_per_request"],
                    "compute": cost["layer_calls"] / first if first else math.nan})
        table.append(row)
    return table


def prompt_comparison(units: Sequence[dict[str, Any]], K: int) -> PairedSummary | None:
    """TADM against naive reuse at ``K``, over distinct prompts (:mod:`tadm.eval.significance`).

    Per benchmark and distinct prompt, the mean correctness over the items with that prompt and over
    every seed both methods ran; units are (benchmark, prompt). None when no (benchmark, seed) has both
    methods with per-problem checks.
    """
    def runs(method: str, key: tuple[str, int]) -> list[tuple[Any, bool]]:
        u = by[method][key]
        return [((u["task"], p), c) for p, c in zip(u["prompts"], u["correct"])]

    by = {m: {(u["task"], u["seed"]): u for u in units if u["method"] == m and u["K"] == K and u.get("correct")
              and u.get("prompts")} for m in ("tadm", "naive")}
    keys = sorted(by["tadm"].keys() & by["naive"].keys())
    if not keys:
        return None
    d = prompt_differences([runs("tadm", k) for k in keys], [runs("naive", k) for k in keys])
    return paired_summary(d.values())


def naive_rows(all_cells: list[dict[str, Any]], units: Sequence[dict[str, Any]], Ks: Sequence[int]) -> list[dict]:
    """The naive-reuse comparison: per K, accuracy and corruption of naive reuse and of TADM, and the paired
    difference over distinct prompts with its 95 % interval and sign test."""
    table = []
    for K in Ks:
        row: dict[str, Any] = {"K": K}
        for method, title in (("naive", "naive"), ("tadm", "TADM")):
            accuracies = [c["accuracy_mean"] for c in all_cells if c["method"] == method and c["K"] == K]
            row[f"{title} accuracy"] = statistics.fmean(accuracies) if accuracies else None
            row.update(_judge_columns(title, _judged([u for u in units if u["method"] == method and u["K"] == K])))
        paired = prompt_comparison(units, K)
        row["prompts"] = paired.units if paired else None
        row["TADM - naive (pp, 95% CI)"] = (
            f"{100 * paired.mean:+.1f} [{100 * paired.low:+.1f}, {100 * paired.high:+.1f}]" if paired else None)
        row["prompts TADM / naive ahead"] = f"{paired.ahead} / {paired.behind}" if paired else None
        row["sign test p (prompts)"] = f"{paired.sign_p:.2g}" if paired else None
        table.append(row)
    return table


def _judge_columns(title: str, judged: dict[str, Any]) -> dict[str, Any]:
    """Corruption with the null share and the unparsed verdicts beside it; "no verdict parsed" when the judge
    answered but none of its answers parsed (None: not judged)."""
    if not judged["judged"]:
        return {f"{title} corruption": None, f"{title} null share": None, f"{title} unparsed": None}
    parsed = judged["judged"] - judged["unparsed"]
    return {f"{title} corruption": judged["corruption"] if parsed else "no verdict parsed",
            f"{title} null share": judged["null_share"] if parsed else None,
            f"{title} unparsed": f"{judged['unparsed']}/{judged['judged']}"}


def _fmt(value: Any, key: str = "") -> str:
    """A table entry: (mean, std) and accuracy/corruption in %, ratios with two decimals, others with one."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, tuple):
        return f"{100 * value[0]:.1f} ± {100 * value[1]:.1f}"
    if isinstance(value, float) and ("accuracy" in key or "corruption" in key or "share" in key):
        return f"{100 * value:.1f}"
    if isinstance(value, float):
        return f"{value:.2f}" if key == "compute" else f"{value:.1f}"
    return str(value)


def _markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)\n"
    head = list(rows[0])
    return markdown_table(head, [[_fmt(r.get(k), k) for k in head] for r in rows]) + "\n"


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """A row for CSV/JSON: a (mean, std) pair becomes two columns."""
    flat: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, tuple):
            flat[f"{key} mean"], flat[f"{key} std"] = value
        else:
            flat[key] = value
    return flat


def provenance_lines(provenance: dict[str, Any] | None, cells_: Sequence[dict[str, Any]]) -> list[str]:
    """The "How it was run" lines: command, machine, commit, wall time of this run and of all units."""
    if not provenance:
        return []
    machine = provenance.get("machine") or {}
    commit = provenance.get("commit")
    lines = ["", "## How it was run", ""]
    if provenance.get("command"):
        lines.append(f"- Command: `{provenance['command']}` (a rerun skips finished units)")
    lines.append(f"- Machine: {machine.get('processor', '?')}, {machine.get('cpu_count', '?')} CPUs, "
                 f"torch {machine.get('torch', '?')}, torch threads: {machine.get('torch_threads', '?')}"
                 + (f", {machine['gpu']}" if machine.get("gpu") else ", no GPU"))
    lines.append(f"- Commit: `{commit[:10] if commit else 'unknown (not a git checkout)'}`"
                 + (" with local changes" if provenance.get("dirty") else ""))
    if provenance.get("sandbox"):
        lines.append(f"- Code sandbox: {provenance['sandbox']}")
    if provenance.get("judge"):
        lines.append(f"- Judge: `{provenance['judge']}`" + (f" ({provenance['judge_note']})"
                                                             if provenance.get("judge_note") else ""))
    generation = sum(float(c.get("seconds") or 0.0) for c in cells_)
    lines.append(f"- Wall time: {provenance.get('wall_seconds', float('nan')):.0f} s for this invocation; "
                 f"{generation:.0f} s of generation over all units (some may come from earlier invocations)")
    return lines


def _tokens(bench: Any, units: Sequence[dict[str, Any]]) -> str:
    """The generation length ``bench``'s units used (a cap may have lowered the paper's)."""
    used = sorted({int(u["max_gen_toks"]) for u in units if u["task"] == bench.name and u.get("max_gen_toks")})
    if not used or used == [bench.max_gen_toks]:
        return f"{bench.max_gen_toks} tokens"
    return f"{'/'.join(map(str, used))} tokens, capped from {bench.max_gen_toks}"


def _marked(tasks: list[dict[str, Any]], all_cells: Sequence[dict[str, Any]],
            benches: Sequence[Any]) -> list[dict[str, Any]]:
    """The task rows with :data:`TIMEOUT_MARK` on the accuracies where time-outs dominate."""
    titles = {b.name: b.title for b in benches}
    flagged = {(titles[c["task"]], _label(c["method"], c["K"])) for c in all_cells
               if c["task"] in titles and _timeouts_dominate(c)}
    return [{k: (f"{_fmt(v, k)} {TIMEOUT_MARK}" if (k, row["method"]) in flagged else v) for k, v in row.items()}
            for row in tasks]


def _markdown_file(tasks: list[dict[str, Any]], naive: list[dict[str, Any]], benches: Sequence[Any],
                   units: Sequence[dict[str, Any]], all_cells: Sequence[dict[str, Any]], notes: list[str]) -> str:
    shots = ", ".join(f"{b.title} ({b.shots}-shot, {_tokens(b, units)}, {b.metric})" for b in benches)
    text = ("# Task evaluation (TADM:Post-train)\n\n"
            f"Benchmarks: {shots}. Accuracy in %, mean ± std over seeds; "
            "compute = denoising layer calls relative to the first row.\n\n## Accuracy, throughput and compute\n\n"
            + _markdown(_marked(tasks, all_cells, benches)))
    if notes:
        text += (f"\n{TIMEOUT_MARK} Time-outs dominate: more than half the programs timed out, so the accuracy "
                 "measures the time limit, not the code (raise --code-timeout):\n\n"
                 + "".join(f"- {note}\n" for note in notes))
    if naive:
        text += ("\n## Naive reuse vs TADM\n\nAccuracy (%): mean over benchmarks of the seed means; "
                 "corruption (%): share of parsed "
                 "judge verdicts flagged incoherent or repetition_loop, null share (%): parsed verdicts "
                 "with no flag true and at least one null, unparsed: verdicts that did not parse "
                 "('-': not judged). The paired columns count distinct prompts, not items or seeds: per "
                 "benchmark and prompt, TADM's mean correctness minus naive reuse's over the items with that "
                 "prompt and every seed; then the mean of those differences with its 95 % Student-t interval, "
                 "the prompts where each is ahead, and the two-sided exact sign test over untied prompts.\n\n"
                 + _markdown(naive))
    return text


def write_tables(units: Sequence[dict[str, Any]], benches: Sequence[Any], rows: Sequence[Any], out: Path, *,
                 config: dict[str, Any], provenance: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write both tables (Markdown, CSV), every cell (CSV) and everything (JSON) into ``out``.

    ``provenance`` (command, machine, commit, wall time) is written under the Markdown tables and in the JSON.
    """
    all_cells = cells(units)
    tasks = task_rows(all_cells, units, benches, rows)
    Ks = list(dict.fromkeys(m.K for m in rows if m.name == "naive"))
    naive = naive_rows(all_cells, units, Ks) if Ks else []
    out.mkdir(parents=True, exist_ok=True)
    files = {"markdown": out / "table.md", "task_csv": out / "task_table.csv", "cells_csv": out / "cells.csv",
             "json": out / "results.json"}
    notes = timeout_notes(all_cells, benches, config.get("code_timeout"))
    text = _markdown_file(tasks, naive, benches, units, all_cells, notes) + "\n".join(
        provenance_lines(provenance, all_cells))
    write_text(files["markdown"], text.rstrip("\n") + "\n")
    flat = [_flat(row) for row in tasks]
    write_csv(files["task_csv"], list(flat[0]) if flat else ["method"], flat)
    if naive:
        files["naive_csv"] = write_csv(out / "naive_table.csv", list(naive[0]), naive)
    write_csv(files["cells_csv"], CELL_FIELDS, all_cells)
    if len({c["K"] for c in all_cells}) > 1:
        if can_plot():
            files["plot"] = plot_task_accuracy_vs_refresh(all_cells, out / "accuracy_vs_k.png")
        else:
            warnings.warn(PLOTS_SKIPPED, stacklevel=2)
    write_json(files["json"], {"config": config, "provenance": provenance, "cells": all_cells, "task_table": flat,
                               "naive_table": naive, "timeout_notes": notes})
    return files
