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

With ``--held-out`` the runs are ``laptop_task.py --hold-out`` runs (``scripts/held_out_recovery.sh``): models
that never read the held-out totals, evaluated on the held-out prompts (``eval-held-out/``) and on every total
(``eval/``). Every row then names its prompt set (``prompts_set``): ``held-out`` (the held-out prompts, their
own evaluation), ``all totals`` (the old evaluation set, every total) and ``trained totals`` (the same
evaluation restricted to the totals that training read). The KL columns are measured on the held-out prompts
(``kl-held-out.json``) for the first and on every total (``kl.json``) for the other two. The script checks that
no training prompt of any run is a held-out one, copies the held-out prompts to ``split.jsonl`` and writes
``runs.json``: per run, the pretraining and post-training records (losses, final KD, seconds, commit), the
pretraining probe, the stage times, each evaluation's command, commit, machine and wall time, and the
driver's log.

    python scripts/recovery_ablation.py --runs runs/split2 --out docs/results/posttrain-recovery-ablation-cpu
    python scripts/recovery_ablation.py --runs runs/held-out --held-out \
        --out docs/results/posttrain-recovery-ablation-cpu/held-out
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


HELD_OUT_SETS = (  # (prompt set, evaluation folder, KL file, which totals of that evaluation)
    ("held-out", "eval-held-out", "kl-held-out.json", "all"),
    ("all totals", "eval", "kl.json", "all"),
    ("trained totals", "eval", "kl.json", "trained"),
)


def _units(eval_dir: Path, keep: set[int] | None = None) -> dict[tuple[str, int, int], dict[str, Any]]:
    """(method, K, sampling seed) -> the unit's records; with ``keep``, only the records whose gold total is in it
    (and the unit's accuracy over those)."""
    out = {}
    for path in sorted((eval_dir / "units" / "split").glob("*-K*-seed*.json")):
        unit = json.loads(path.read_text())
        if keep is not None:
            unit["records"] = [r for r in unit["records"] if int(r["gold"]) in keep]
            unit["accuracy"] = statistics.fmean(bool(r["correct"]) for r in unit["records"])
        spec = unit["spec"]
        out[spec["method"], int(spec["K"]), int(spec["seed"])] = unit
    return out


def _accuracy(units: dict, method: str, K: int) -> float | None:
    values = [u["accuracy"] for (m, k, _), u in units.items() if m == method and k == K]
    return statistics.fmean(values) if values else None


def _runs(units: dict, method: str, K: int) -> list[list[tuple[str, bool]]]:
    return [[(r["prompt"], bool(r["correct"])) for r in u["records"]]
            for (m, k, _), u in sorted(units.items()) if m == method and k == K]


def variant_rows(runs: Path, eval_name: str = "eval", kl_name: str = "kl.json", keep: set[int] | None = None,
                 prompts_set: str | None = None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """One row per (variant, pretraining seed, K), and the outcome strings of every unit.

    ``eval_name`` and ``kl_name`` are the evaluation folder and KL file of each variant; ``keep``, the gold totals
    to count (default: all); ``prompts_set``, a name put first in every row and outcome key (``--held-out``).
    Raises ValueError for a ``seed-*`` folder with variants whose name is not ``seed-N``."""
    rows, outcomes = [], {}
    for seed_dir in sorted(runs.glob("seed-*")):
        if (seed_dir / "variants").is_dir() and not seed_dir.name.removeprefix("seed-").isdigit():
            raise ValueError(f"{seed_dir}: not named seed-N (N the pretraining seed, an integer); rename or move it")
        for variant_dir in sorted((seed_dir / "variants").glob("*")):
            eval_dir = variant_dir / eval_name
            if not (eval_dir / "results.json").is_file():
                continue
            units = _units(eval_dir, keep)
            prefix = "" if prompts_set is None else f"{prompts_set}/"
            for (m, k, s), u in units.items():
                outcomes[f"{prefix}{seed_dir.name}/{variant_dir.name}/{m}-K{k}-seed{s}"] = "".join(
                    "1" if r["correct"] else "0" for r in u["records"])
            kl_path = variant_dir / kl_name
            kl = json.loads(kl_path.read_text())["by_K"] if kl_path.is_file() else {}
            base = _accuracy(units, "baseline", 1)
            for K in KS:
                naive, tadm = _accuracy(units, "naive", K), _accuracy(units, "tadm", K)
                if naive is None or tadm is None:
                    continue
                d = prompt_differences(_runs(units, "tadm", K), _runs(units, "naive", K))
                p = paired_summary(d.values())
                rows.append({
                    **({} if prompts_set is None else {"prompts_set": prompts_set}),
                    "variant": variant_dir.name, "pretraining_seed": int(seed_dir.name.split("-")[1]), "K": K,
                    "base_K1": base, "naive": naive, "tadm": tadm, "recovered": recovered_share(base, naive, tadm),
                    "kl_naive": kl.get(str(K), {}).get("kl_naive"), "kl_fused": kl.get(str(K), {}).get("kl_fused"),
                    "prompts": p.units, "diff_mean": p.mean, "diff_low": p.low, "diff_high": p.high,
                    "prompts_ahead": p.ahead, "prompts_behind": p.behind, "sign_p": p.sign_p, "t_p": p.t_p,
                })
    return rows, outcomes


def seed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (prompt set,) variant and K: the recovered share per pretraining seed, its mean and 95 % interval over
    seeds."""
    out = []
    for group in dict.fromkeys((r.get("prompts_set"), r["variant"]) for r in rows):
        for K in KS:
            mine = sorted((r for r in rows if (r.get("prompts_set"), r["variant"]) == group and r["K"] == K),
                          key=lambda r: r["pretraining_seed"])
            if not mine:
                continue
            shares = [r["recovered"] for r in mine]
            # a seed whose naive reuse lost nothing has no share (NaN), and then neither has the mean
            mean, low, high = (math.nan,) * 3 if any(math.isnan(x) for x in shares) else mean_interval(shares)
            out.append({**({} if group[0] is None else {"prompts_set": group[0]}), "variant": group[1], "K": K,
                        "seeds": len(mine), "per_seed": " / ".join(_pct(r["recovered"], 0) for r in mine),
                        "mean": mean, "low": low, "high": high})
    return out


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _json_or_none(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def held_out_rows(runs: Path) -> tuple[list[dict[str, Any]], dict[str, str], list[dict[str, Any]], dict[str, Any]]:
    """Rows and outcomes of every prompt set of :data:`HELD_OUT_SETS`, the held-out records, and ``runs.json``.

    Raises ValueError when a run has no held-out prompts, the runs hold different ones, or a training prompt of a
    run is a held-out one."""
    held_records, provenance = None, {}
    for seed_dir in sorted(runs.glob("seed-*")):
        held_path = seed_dir / "data" / "held-out" / "split.jsonl"
        if not (seed_dir / "variants").is_dir():
            continue
        if not held_path.is_file():
            raise ValueError(f"{seed_dir}: no {held_path.relative_to(seed_dir)}; "
                             "was it run with laptop_task.py --hold-out?")
        records = _read_jsonl(held_path)
        if held_records is not None and records != held_records:
            raise ValueError(f"{held_path}: other held-out prompts than the first run's")
        held_records = records
        held_prompts = {r["problem"] for r in records}
        leaked = sum(r["problem"] in held_prompts for r in _read_jsonl(seed_dir / "data" / "train.jsonl"))
        if leaked:
            raise ValueError(f"{seed_dir / 'data' / 'train.jsonl'}: {leaked} training problems have a held-out prompt")
        probe = _json_or_none(seed_dir / "eval-pretrained" / "units" / "split" / "baseline-K1-seed0.json")
        provenance[seed_dir.name] = {
            "pretrain": _json_or_none(seed_dir / "base" / "pretrain.json"),
            "probe": None if probe is None else {"problems": probe["n"], "correct": probe["correct"],
                                                 "accuracy": probe["accuracy"]},
            "training_problems_with_a_held_out_prompt": leaked,
            "variants": {v.name: {
                "posttrain": _json_or_none(v / "adapter" / "posttrain.json"),
                "timings": _json_or_none(v / "timings.json"),
                **{name: (_json_or_none(v / name / "results.json") or {}).get("provenance")
                   for name in ("eval", "eval-held-out")},
                **{name: _json_or_none(v / name) for name in ("kl.json", "kl-held-out.json")},
            } for v in sorted((seed_dir / "variants").glob("*"))},
        }
    if held_records is None:
        raise ValueError("no run with variants (seed-*/variants/*)")
    held = {int(r["answer"]) for r in held_records}
    rows, outcomes = [], {}
    for name, eval_name, kl_name, which in HELD_OUT_SETS:
        keep = None
        if which == "trained":
            totals = {int(r["answer"]) for d in sorted(runs.glob("seed-*/data/split.jsonl")) for r in _read_jsonl(d)}
            keep = totals - held
        more_rows, more = variant_rows(runs, eval_name, kl_name, keep, prompts_set=name)
        rows += more_rows
        outcomes.update(more)
    log = runs / "driver.log"
    extra = {"driver_log": log.read_text().splitlines()} if log.is_file() else {}
    return rows, outcomes, held_records, {"held_out_totals": sorted(held), **extra, "runs": provenance}


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}"


def markdown(rows: list[dict[str, Any]], seeds: list[dict[str, Any]], commit: dict[str, Any], *, command: str,
             machine: dict[str, Any], seconds: float) -> str:
    sets = "prompts_set" in rows[0]
    lines = [("| prompts " if sets else "") + "| variant | seed | K | base K=1 | naive | TADM | recovered "
             "| KL naive / fused | prompts ahead / behind | TADM − naive, pp [95% CI] | sign p | t p |", "|" + "---|" * (12 + sets)]
    for r in rows:
        lines.append(
            (f"| {r['prompts_set']} " if sets else "") +
            f"| {r['variant']} | {r['pretraining_seed']} | {r['K']} | {_pct(r['base_K1'])} | {_pct(r['naive'])} | "
            f"{_pct(r['tadm'])} | {_pct(r['recovered'], 0)} % | {r['kl_naive'] or math.nan:.3f} / "
            f"{r['kl_fused'] or math.nan:.3f} | {r['prompts_ahead']} / {r['prompts_behind']} of {r['prompts']} | "
            f"{100 * r['diff_mean']:+.1f} [{100 * r['diff_low']:+.1f}, {100 * r['diff_high']:+.1f}] | "
            f"{r['sign_p']:.2g} | {r['t_p']:.2g} |")
    lines += ["", ("| prompts " if sets else "") + "| variant | K | pretraining seeds | recovered per seed (%) "
              "| mean [95% CI over seeds] |", "|" + "---|" * (5 + sets)]
    for s in seeds:
        interval = f" [{_pct(s['low'], 0)}, {_pct(s['high'], 0)}]" if s["seeds"] > 1 else ""
        lines.append((f"| {s['prompts_set']} " if sets else "") +
                     f"| {s['variant']} | {s['K']} | {s['seeds']} | {s['per_seed']} | "
                     f"{_pct(s['mean'], 0)} %{interval} |")
    state = f"`{str(commit.get('commit'))[:10]}`" + (" with local changes" if commit.get("dirty") else "")
    lines += ["", f"- Command: `{command}`", f"- Commit: {state}",
              f"- Machine: {machine.get('processor', '?')}, {machine.get('cpu_count', '?')} CPUs, torch {machine.get('torch', '?')}",
              f"- Wall time: {seconds:.1f} s to build these tables (the runs' own times are "
              + ("in `runs.json`)" if sets else "on the results page)")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = OneLineErrorParser(prog="recovery_ablation.py", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/split2"))
    p.add_argument("--out", type=Path, default=Path("docs/results/posttrain-recovery-ablation-cpu"))
    p.add_argument("--held-out", action="store_true",
                   help="laptop_task.py --hold-out runs: rows per prompt set (held-out, all totals, trained totals), "
                        "split.jsonl and runs.json")
    args = p.parse_args(argv)
    if not args.runs.is_dir():
        p.error(f"--runs {args.runs}: no such folder")
    started = time.perf_counter()
    source = git_commit()  # before this run rewrites its own (tracked) output files
    held, provenance = None, None
    try:
        if args.held_out:
            rows, outcomes, held, provenance = held_out_rows(args.runs)
        else:
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
    if held is not None:
        write_text(args.out / "split.jsonl", "".join(json.dumps(r) + "\n" for r in held))
        write_json(args.out / "runs.json", provenance)
    command = "python scripts/recovery_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_text(args.out / "tables.md", markdown(rows, seeds, source, command=command.strip(), machine=machine_info(),
                                                seconds=time.perf_counter() - started))
    print(f"{len(rows)} rows, {len(outcomes)} units -> {args.out}")


if __name__ == "__main__":
    main()
