"""Plots of a sweep (matplotlib, Agg backend, PNG): the quality-throughput trade-off and Gen PPL against K.

* :func:`plot_genppl_vs_throughput`: Gen PPL (y) against tokens/s (x), one curve per model (per
  model and T when the sweep has several T), each point labelled with its refresh interval K.
* :func:`plot_genppl_vs_refresh`: Gen PPL against K, one panel per T, one curve per model.
* :func:`plot_pareto`: quality (Gen PPL) against measured tokens/s for every (model, T, K), each
  point labelled "K, T", with the Pareto front of all points (faster and better) drawn through.
* :func:`plot_nelbo_vs_age`: the stale-anchor likelihood bound against the cache age k, one panel
  per T, one curve per model (the mean over seeds, with their range as error bars).
* :func:`plot_task_accuracy_vs_refresh`: task accuracy against K (``tadm eval tasks``), one panel per
  task, TADM and naive reuse as curves (mean ± std over seeds), the base at K = 1 as a line.

matplotlib is imported inside the functions, with the non-interactive Agg backend, so that
plotting works without a display and importing this module costs nothing.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tadm.eval.report import refresh_label, refresh_order, refresh_value

__all__ = ["PLOTS_SKIPPED", "can_plot", "pareto_front", "plot_genppl_vs_refresh", "plot_genppl_vs_throughput",
           "plot_nelbo_vs_age", "plot_pareto", "plot_task_accuracy_vs_refresh", "write_plots"]


# what a run that draws plots as a by-product says (as a warning) when it has to skip them
PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install 'tadm[eval]')"


def can_plot() -> bool:
    """Whether matplotlib (the eval extra) is installed: a run whose tables come first skips its plots with
    :data:`PLOTS_SKIPPED` when it is not, rather than failing after the work."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    # deferred: matplotlib is an optional dependency (the eval extra)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | os.PathLike[str]) -> Path:
    """Lay out ``fig``, write it as a 120-dpi PNG at ``path`` (creating the folder) and close it."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
    plt.close(fig)
    return out


def _usable(rows: Sequence[dict[str, Any]], *fields: str) -> list[dict[str, Any]]:
    """The rows with a (T, K) (not the data row) and a finite value in every one of ``fields``."""
    return [r for r in rows if r.get("steps") is not None and r.get("refresh") is not None
            and all(r.get(f) is not None and math.isfinite(float(r.get(f))) for f in fields)]


def _models(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["model"] for r in rows))


def plot_genppl_vs_throughput(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Gen PPL vs tokens/s, one curve per model (and T), points labelled "K=k"; saved as PNG at ``path``."""
    plt = _pyplot()
    usable = _usable(rows, "gen_ppl", "tokens_per_second")
    steps = sorted({int(r["steps"]) for r in usable})
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for model in _models(usable):
        for T in steps:
            pts = sorted((r for r in usable if r["model"] == model and int(r["steps"]) == T),
                         key=lambda r: refresh_order(r["refresh"]))
            if not pts:
                continue
            label = model if len(steps) == 1 else f"{model} T={T}"
            xs = [float(r["tokens_per_second"]) for r in pts]
            ys = [float(r["gen_ppl"]) for r in pts]
            ax.plot(xs, ys, marker="o", label=label)
            for r, x, y in zip(pts, xs, ys):
                ax.annotate(refresh_label(r["refresh"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="throughput (tokens/s)", ylabel="Gen PPL", title="Gen PPL vs throughput")
    ax.grid(True, alpha=0.3)
    if usable:
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_genppl_vs_refresh(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Gen PPL vs refresh interval K (log2 axis), one panel per T, one curve per model; PNG at ``path``.

    Rows of refresh policies other than a fixed K have no place on the K axis and are left out.
    """
    plt = _pyplot()
    usable = [r for r in _usable(rows, "gen_ppl") if isinstance(refresh_value(r["refresh"]), int)]
    steps = sorted({int(r["steps"]) for r in usable}) or [0]
    fig, axes = plt.subplots(1, len(steps), figsize=(4.2 * len(steps), 3.8), squeeze=False)
    for ax, T in zip(axes[0], steps):
        for model in _models(usable):
            pts = sorted((r for r in usable if r["model"] == model and int(r["steps"]) == T),
                         key=lambda r: int(r["refresh"]))
            if pts:
                ax.plot([int(r["refresh"]) for r in pts], [float(r["gen_ppl"]) for r in pts], marker="o", label=model)
        ax.set_xscale("log", base=2)
        ks = sorted({int(r["refresh"]) for r in usable if int(r["steps"]) == T})
        if ks:
            ax.set_xticks(ks, [str(k) for k in ks])
        ax.set(xlabel="anchor refresh interval K", ylabel="Gen PPL", title=f"T = {T}")
        ax.grid(True, alpha=0.3)
        if usable:
            ax.legend(fontsize=8)
    return _save(plt, fig, path)


def write_plots(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Both plots into ``out_dir``: ``genppl_vs_throughput.png`` and ``genppl_vs_refresh.png``."""
    out = Path(out_dir)  # _save creates it
    return [
        plot_genppl_vs_throughput(rows, out / "genppl_vs_throughput.png"),
        plot_genppl_vs_refresh(rows, out / "genppl_vs_refresh.png"),
    ]


def plot_nelbo_vs_age(records: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Increase of the T-ANELBO over the fresh anchor (%) against the cache age k; PNG at ``path``.

    ``records`` carry ``model`` and ``curves`` ({T: [nats/token at k = 0, 1, ...]}, as in
    ``StalenessResult.as_dict()``) and optionally ``seed`` (training seed) and ``eval_seed``: records of
    one model and seed are averaged, and the range over seeds is drawn as error bars around their mean.
    One panel per T, one curve per model.
    """
    plt = _pyplot()
    models = _models(records)
    steps = sorted({int(T) for r in records for T in r["curves"]}) or [0]
    fig, axes = plt.subplots(1, len(steps), figsize=(4.6 * len(steps), 3.9), squeeze=False)
    for ax, T in zip(axes[0], steps):
        for model in models:
            # one curve per training seed ("seed"), averaged over its evaluation seeds ("eval_seed") if any
            per_seed: dict[Any, list[list[float]]] = {}
            for n, r in enumerate(records):
                c = r["curves"].get(T, r["curves"].get(str(T)))
                if r["model"] == model and c:
                    per_seed.setdefault(r.get("seed", n), []).append([100.0 * (v / c[0] - 1.0) for v in c])
            curves = [[sum(vals) / len(vals) for vals in zip(*group)] for group in per_seed.values()]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            ages = list(range(n))
            mean = [sum(c[k] for c in curves) / len(curves) for k in ages]
            low = [mean[k] - min(c[k] for c in curves) for k in ages]
            high = [max(c[k] for c in curves) - mean[k] for k in ages]
            label = model if len(curves) == 1 else f"{model} ({len(curves)} seeds)"
            ax.errorbar(ages, mean, yerr=[low, high], marker="o", markersize=3, capsize=2, label=label)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set(xlabel="cache age k (reverse steps since the refresh)", ylabel="NELBO increase over k = 0 (%)",
               title=f"T = {T}: t' = t + k / {T}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_task_accuracy_vs_refresh(cells: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Accuracy (%) against K per task: one curve per method (``tadm``, ``naive``), the base as a dashed line.

    Only fixed intervals (an int K) have a place on the K axis; other refresh policies are in the tables.

    ``cells`` are :func:`tadm.tasks.task_tables.cells` rows (task, method, K, accuracy_mean, accuracy_std).
    """
    plt = _pyplot()
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.8 * len(tasks), 3.6), squeeze=False)
    styles = {"tadm": ("TADM (fusion)", "o", "C0"), "naive": ("naive reuse", "s", "C3")}
    for ax, task in zip(axes[0], tasks):
        mine = [c for c in cells if c["task"] == task]
        for method, (label, marker, color) in styles.items():
            points = sorted((c["K"], 100 * c["accuracy_mean"], 100 * c["accuracy_std"]) for c in mine
                            if c["method"] == method and isinstance(c["K"], int))
            if points:
                ks, means, stds = zip(*points)
                ax.errorbar(ks, means, yerr=stds, marker=marker, color=color, capsize=3, label=label)
        for c in mine:
            if c["method"] == "baseline":
                ax.axhline(100 * c["accuracy_mean"], color="0.4", linestyle="--", label="base, K = 1")
        ax.set_xscale("log", base=2)
        ks = sorted({c["K"] for c in mine if isinstance(c["K"], int)})
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set(xlabel="refresh interval K", ylabel="accuracy (%)", title=task)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (speed, loss) that no other point beats on both (higher speed, lower loss),
    sorted by speed."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def plot_pareto(
    rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], *, metric: str = "gen_ppl",
    title: str = "Gen PPL vs measured tokens/s",
) -> Path:
    """``metric`` (lower is better) against tokens/s, a marker per model, each point labelled "K=k T=t";
    the Pareto front over all points is the dashed line. PNG at ``path``."""
    plt = _pyplot()
    usable = _usable(rows, metric, "tokens_per_second")
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    markers = "osD^vP*Xh"
    for n, model in enumerate(_models(usable)):
        pts = [r for r in usable if r["model"] == model]
        xs = [float(r["tokens_per_second"]) for r in pts]
        ys = [float(r[metric]) for r in pts]
        ax.scatter(xs, ys, marker=markers[n % len(markers)], label=model, s=28)
        for r, x, y in zip(pts, xs, ys):
            ax.annotate(f"{refresh_label(r['refresh']).replace('=', '')} T{r['steps']}", (x, y),
                        textcoords="offset points", xytext=(3, 3), fontsize=6.5)
    if usable:
        points = [(float(r["tokens_per_second"]), float(r[metric])) for r in usable]
        front = pareto_front(points)
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "--", color="grey", linewidth=1,
                label="Pareto front")
        ax.legend(fontsize=8)
    ax.set(xscale="log", yscale="log")
    # deferred: matplotlib is an optional dependency (the eval extra)
    from matplotlib.ticker import FormatStrFormatter

    for axis in (ax.xaxis, ax.yaxis):  # plain numbers rather than 2 x 10^1 on the log axes
        axis.set_major_formatter(FormatStrFormatter("%g"))
        axis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set(xlabel="measured throughput (tokens / median generation time, tokens/s)",
           ylabel=metric.replace("_", " ").replace("gen ppl", "Gen PPL") + " (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    return _save(plt, fig, path)
