"""Tables of the post-training recovery ablation on the split task, from ``laptop_task.py --variant`` runs.

For every pretraining seed ``runs/split2/seed-M`` and every post-training variant under its
``variants/NAME`` (``laptop_task.py --variant NAME``: one factor changed at a time with
``--posttrain-steps`` or ``--posttrain-set``, each listed on the results page), this reads the
evaluation units (base at K = 1, TADM and naive reuse at each K, three sampling seeds) and the KL
diagnosis (``kl.json``) and writes into ``--out``:

* ``variants.csv``: per variant, pretraining seed and K: accuracies, the recovered share of the
  naive-reuse loss ``(TADM - naive) / (base - naive)``, the KL to the fresh-anchor model, and the
  paired TADM - naive difference over distinct prompts (mean, 95 % interval, prompts ahead / behind,
  sign test and paired t-test; :mod:`tadm.eval.significance`);
* ``seeds.csv``: per variant and K with several pretraining seeds, the recovered share per seed and
  its mean with the 95 % Student-t interval over seeds;
* ``outcomes.json``: every unit's per-problem correctness as a string of 0/1 (the data under the tables);
* ``tables.md``: the same, as Markdown.

    python scripts/recovery_ablation.py --runs runs/split2 --out docs/results/posttrain-recovery-ablation-cpu
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tadm.cli import OneLineErrorParser
from tadm.eval.significance import mean_interval, paired_summary, prompt_differences, recovered_share
from tadm.records import git_commit, machine_info, write_csv, write_json, write_text

KS = (2, 3, 4)


def _units(eval_dir: Path) -> dict[tuple[str, int, int], dict[str, Any]]:
    """(method, K, sampling seed) -> the unit's records."""
    out = {}
    for path in sorted((eval_dir / "units" / "split").glob("*-K*-seed*.json")):
        unit = json.loads(path.read_text())
        spec = unit["spec"]
        out[spec["method"], int(spec["K"]), int(spec["seed"])] = unit
    return out


def _accuracy(units: dict, method: str, K: int) -> float | None:
    values = [u["accuracy"] for (m, k, _), u in units.items() if m == method and k == K]
    return statistics.fmean(values) if values else None


def _runs(units: dict, method: str, K: int) -> list[list[tuple[str, bool]]]:
    return [[(r["prompt"], bool(r["correct"])) for r in u["records"]]
            for (m, k, _), u in sorted(units.items()) if m == method and k == K]


def variant_rows(runs: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """One row per (variant, pretraining seed, K), and the outcome strings of every unit.

    Raises ValueError for a ``seed-*`` folder with variants whose name is not ``seed-N``."""
    rows, outcomes = [], {}
    for seed_dir in sorted(runs.glob("seed-*")):
        if (seed_dir / "variants").is_dir() and not seed_dir.name.removeprefix("seed-").isdigit():
            raise ValueError(f"{seed_dir}: not named seed-N (N the pretraining seed, an integer); rename or move it")
        for variant_dir in sorted((seed_dir / "variants").glob("*")):
            eval_dir = variant_dir / "eval"
            if not (eval_dir / "results.json").is_file():
                continue
            units = _units(eval_dir)
            for (m, k, s), u in units.items():
                outcomes[f"{seed_dir.name}/{variant_dir.name}/{m}-K{k}-seed{s}"] = "".join(
                    "1" if r["correct"] else "0" for r in u["records"])
            kl = json.loads((variant_dir / "kl.json").read_text())["by_K"] if (variant_dir / "kl.json").is_file() else {}
            base = _accuracy(units, "baseline", 1)
            for K in KS:
                naive, tadm = _accuracy(units, "naive", K), _accuracy(units, "tadm", K)
                if naive is None or tadm is None:
                    continue
                d = prompt_differences(_runs(units, "tadm", K), _runs(units, "naive", K))
                p = paired_summary(d.values())
                rows.append({
                    "variant": variant_dir.name, "pretraining_seed": int(seed_dir.name.split("-")[1]), "K": K,
                    "base_K1": base, "naive": naive, "tadm": tadm, "recovered": recovered_share(base, naive, tadm),
                    "kl_naive": kl.get(str(K), {}).get("kl_naive"), "kl_fused": kl.get(str(K), {}).get("kl_fused"),
                    "prompts": p.units, "diff_mean": p.mean, "diff_low": p.low, "diff_high": p.high,
                    "prompts_ahead": p.ahead, "prompts_behind": p.behind, "sign_p": p.sign_p, "t_p": p.t_p,
                })
    return rows, outcomes


def seed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant and K: the recovered share per pretraining seed, its mean and 95 % interval over seeds."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        for K in KS:
            mine = sorted((r for r in rows if r["variant"] == variant and r["K"] == K), key=lambda r: r["pretraining_seed"])
            if not mine:
                continue
            mean, low, high = mean_interval([r["recovered"] for r in mine])
            out.append({"variant": variant, "K": K, "seeds": len(mine),
                        "per_seed": " / ".join(f"{100 * r['recovered']:.0f}" for r in mine),
                        "mean": mean, "low": low, "high": high})
    return out


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}"


def markdown(rows: list[dict[str, Any]], seeds: list[dict[str, Any]], commit: dict[str, Any], *, command: str,
             machine: dict[str, Any], seconds: float) -> str:
    lines = ["| variant | seed | K | base K=1 | naive | TADM | recovered | KL naive / fused | prompts ahead / behind "
             "| TADM − naive, pp [95% CI] | sign p | t p |", "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['pretraining_seed']} | {r['K']} | {_pct(r['base_K1'])} | {_pct(r['naive'])} | "
            f"{_pct(r['tadm'])} | {_pct(r['recovered'], 0)} % | {r['kl_naive'] or math.nan:.3f} / "
            f"{r['kl_fused'] or math.nan:.3f} | {r['prompts_ahead']} / {r['prompts_behind']} of {r['prompts']} | "
            f"{100 * r['diff_mean']:+.1f} [{100 * r['diff_low']:+.1f}, {100 * r['diff_high']:+.1f}] | "
            f"{r['sign_p']:.2g} | {r['t_p']:.2g} |")
    lines += ["", "| variant | K | pretraining seeds | recovered per seed (%) | mean [95% CI over seeds] |", "|---|---|---|---|---|"]
    for s in seeds:
        interval = f" [{_pct(s['low'], 0)}, {_pct(s['high'], 0)}]" if s["seeds"] > 1 else ""
        lines.append(f"| {s['variant']} | {s['K']} | {s['seeds']} | {s['per_seed']} | {_pct(s['mean'], 0)} %{interval} |")
    state = f"`{str(commit.get('commit'))[:10]}`" + (" with local changes" if commit.get("dirty") else "")
    lines += ["", f"- Command: `{command}`", f"- Commit: {state}",
              f"- Machine: {machine.get('processor', '?')}, {machine.get('cpu_count', '?')} CPUs, torch {machine.get('torch', '?')}",
              f"- Wall time: {seconds:.1f} s to build these tables (the runs' own times are on the results page)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = OneLineErrorParser(prog="recovery_ablation.py", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/split2"))
    p.add_argument("--out", type=Path, default=Path("docs/results/posttrain-recovery-ablation-cpu"))
    args = p.parse_args(argv)
    if not args.runs.is_dir():
        p.error(f"--runs {args.runs}: no such folder")
    started = time.perf_counter()
    source = git_commit()  # before this run rewrites its own (tracked) output files
    try:
        rows, outcomes = variant_rows(args.runs)
    except ValueError as err:
        p.error(f"--runs {args.runs}: {err}")
    if not rows and any(args.runs.glob("seed-*/variants/*/eval/results.json")):
        p.error(f"--runs {args.runs}: no variant evaluated at K = {', '.join(map(str, KS))} (TADM and naive reuse); "
                f"run laptop_task.py --variant NAME with --refresh 1,{','.join(map(str, KS))}")
    if not rows:
        p.error(f"--runs {args.runs}: no evaluated variant (seed-*/variants/*/eval/results.json)")
    seeds = seed_rows(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "variants.csv", list(rows[0]), rows)
    write_csv(args.out / "seeds.csv", list(seeds[0]), seeds)
    write_json(args.out / "outcomes.json", outcomes)
    command = "python scripts/recovery_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_text(args.out / "tables.md", markdown(rows, seeds, source, command=command.strip(), machine=machine_info(),
                                                seconds=time.perf_counter() - started))
    print(f"{len(rows)} rows, {len(outcomes)} units -> {args.out}")


if __name__ == "__main__":
    main()
