"""Plots of a sweep (matplotlib, Agg backend, PNG): the quality-throughput trade-off and Gen PPL against K.

* :func:`plot_genppl_vs_throughput`: Gen PPL (y) against tokens/s (x), one curve per model (per
  model and T when the sweep has several T), each point labelled with its refresh interval K.
* :func:`plot_genppl_vs_refresh`: Gen PPL against K, one panel per T, one curve per model.

matplotlib is imported inside the functions, with the non-interactive Agg backend, so that
plotting works without a display and importing this module costs nothing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_genppl_vs_refresh", "plot_genppl_vs_throughput", "write_plots"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _usable(rows: Sequence[dict[str, Any]], *fields: str) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r.get("steps") is None or r.get("refresh") is None:
            continue  # the data row has no (T, K)
        values = [r.get(f) for f in fields]
        if all(v is not None and math.isfinite(float(v)) for v in values):
            out.append(r)
    return out


def _models(rows: Sequence[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r["model"] not in seen:
            seen.append(r["model"])
    return seen


def plot_genppl_vs_throughput(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Gen PPL vs tokens/s, one curve per model (and T), points labelled "K=k"; saved as PNG at ``path``."""
    plt = _pyplot()
    usable = _usable(rows, "gen_ppl", "tokens_per_second")
    steps = sorted({int(r["steps"]) for r in usable})
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for model in _models(usable):
        for T in steps:
            pts = sorted((r for r in usable if r["model"] == model and int(r["steps"]) == T),
                         key=lambda r: int(r["refresh"]))
            if not pts:
                continue
            label = model if len(steps) == 1 else f"{model} T={T}"
            xs = [float(r["tokens_per_second"]) for r in pts]
            ys = [float(r["gen_ppl"]) for r in pts]
            ax.plot(xs, ys, marker="o", label=label)
            for r, x, y in zip(pts, xs, ys):
                ax.annotate(f"K={r['refresh']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("throughput (tokens/s)")
    ax.set_ylabel("Gen PPL")
    ax.set_title("Gen PPL vs throughput")
    ax.grid(True, alpha=0.3)
    if usable:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png", dpi=120)
    plt.close(fig)
    return out


def plot_genppl_vs_refresh(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Gen PPL vs refresh interval K (log2 axis), one panel per T, one curve per model; PNG at ``path``."""
    plt = _pyplot()
    usable = _usable(rows, "gen_ppl")
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
        ax.set_xlabel("anchor refresh interval K")
        ax.set_ylabel("Gen PPL")
        ax.set_title(f"T = {T}")
        ax.grid(True, alpha=0.3)
        if usable:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png", dpi=120)
    plt.close(fig)
    return out


def write_plots(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Both plots into ``out_dir``: ``genppl_vs_throughput.png`` and ``genppl_vs_refresh.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_genppl_vs_throughput(rows, out / "genppl_vs_throughput.png"),
        plot_genppl_vs_refresh(rows, out / "genppl_vs_refresh.png"),
    ]
