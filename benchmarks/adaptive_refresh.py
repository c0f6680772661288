"""Adaptive vs fixed anchor refresh at matched compute, on the models a staleness study trained.

For each model (e.g. TADM and TADM trained with fresh anchors, each training seed) and each target
interval K in ``--match``, the adaptive policy's threshold tau is calibrated by bisection so that
its mean number of anchor refreshes per generation equals fixed K's ceil(T / K) on calibration
sequences (a generator seed disjoint from the evaluation's). Then the same evaluation sequences
are generated with fixed K = 1, fixed K and adaptive tau(K), one sequence at a time (batch 1: the
drift, and so each refresh decision, is per sequence), and scored like the study: Gen PPL under
each evaluator, unigram entropy, MAUVE against held-out text (features of the in-domain AR
evaluator), counted layer calls. Every cell is a JSON file under ``<study out_dir>/adaptive/``
and is skipped when it exists, so the run resumes.

    python benchmarks/adaptive_refresh.py study-brown-cpu --models tadm,tadm-fresh --seeds 0,1 \\
        --steps 128 --match 4,8 --out docs/results/adaptive-refresh-cpu

The stale-anchor likelihood (``tadm eval staleness``) is defined for data-independent refresh
steps (Theorem 1's t'(i)); an adaptive schedule depends on the sampled canvases, so it is not
reported here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from tadm.cli import OneLineErrorParser
from tadm.cli.common import int_list, positive_int, seed_list, seed_value
from tadm.config import ConfigError
from tadm.eval.entropy import mean_entropy
from tadm.eval.evaluator import load_evaluator
from tadm.eval.gen_ppl import decode_samples, gen_ppl
from tadm.eval.mauve import mauve_from_features, mauve_sample_problem
from tadm.eval.pipeline import REFERENCE_ORDER
from tadm.records import git_commit, machine_info
from tadm.sampling import AdaptiveRefresh, FixedRefresh, generate
from tadm.study import load_study_config
from tadm.study.runner import open_study

torch.set_num_threads(1)  # batch-1 generation of a tiny model: one thread is fastest and shares the cores


def _generate(study, model, T, policy, num, seed):
    _, sampler = study.cfg.sampling.sampler.build(model, T, study.length())
    generator = torch.Generator().manual_seed(seed)
    rows, refreshes, calls = [], [], []
    start = time.perf_counter()
    for _ in range(num):
        out = generate(model, sampler, batch_size=1, seq_len=study.length(), num_steps=T, generator=generator,
                       device=study.device, policy=policy)
        rows.extend(out.tokens.cpu().tolist())
        refreshes.append(out.layer_calls.anchor_refreshes)
        calls.append(out.layer_calls.total)
    return rows, refreshes, calls, time.perf_counter() - start


def _calibrate(study, model, T, K, num, seed, iterations):
    """tau whose mean refreshes on the calibration sequences is closest to ceil(T / K)."""
    target = math.ceil(T / K)
    lo, hi, best = 0.0, 1.0, None
    for _ in range(iterations):
        tau = (lo + hi) / 2
        mean = statistics.mean(_generate(study, model, T, AdaptiveRefresh(tau), num, seed)[1])
        if best is None or abs(mean - target) < abs(best[1] - target):
            best = (tau, mean)
        if mean > target:
            lo = tau  # too many refreshes: raise the threshold
        else:
            hi = tau
    return best


def _read(path):
    return json.loads(path.read_text()) if path.exists() else None


def _current(path, settings):
    """The cell at ``path`` if it was made with ``settings`` (a cell from other settings, or none, is redone)."""
    saved = _read(path)
    return saved if saved is not None and saved.get("settings") == json.loads(json.dumps(settings)) else None


def _write(path, record):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def _names(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated model names, got {value!r} (an empty item)")
    return names


def main(argv=None) -> int:
    p = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="study YAML or preset whose models are evaluated (trained already)")
    p.add_argument("--models", type=_names, default="tadm,tadm-fresh")
    p.add_argument("--seeds", type=seed_list, default="0,1", help="training seeds of the models, comma-separated")
    p.add_argument("--steps", "-T", type=positive_int, default=128)
    p.add_argument("--match", type=int_list(1), default="4,8",
                   help="fixed intervals K whose compute the adaptive policy matches")
    p.add_argument("--num-samples", type=positive_int, default=64)
    p.add_argument("--calibration-samples", type=positive_int, default=16)
    p.add_argument("--bisection-steps", type=positive_int, default=8)
    p.add_argument("--seed", type=seed_value, default=0,
                   help="evaluation generator seed (calibration uses seed + 1000)")
    p.add_argument("--cells-dir", default=None, help="where cell files go (default: <study out_dir>/adaptive)")
    p.add_argument("--out", default=None, help="directory for results.json and table.md (default: the cells' dir)")
    args = p.parse_args(argv)

    try:
        cfg = load_study_config(args.config)
        study = open_study(cfg, log=print)
    except (ConfigError, ValueError) as err:
        p.error(str(err))
    cells_dir = Path(args.cells_dir) if args.cells_dir else Path(cfg.out_dir) / "adaptive"
    T, matches, seeds, names = args.steps, args.match, args.seeds, args.models
    by_name = {m.name: m for m in cfg.models}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        p.error(f"--models {','.join(unknown)}: not in study {cfg.name} (has {', '.join(by_name)})")
    for name in names:
        for seed in seeds:
            if seed not in cfg.seeds_of(by_name[name]):
                p.error(f"--seeds {seed}: model {name} of study {cfg.name} has seeds "
                        f"{', '.join(map(str, cfg.seeds_of(by_name[name])))}")
            if not study.layout.final_dir(name, seed).is_dir():
                p.error(f"model {name} seed {seed} is not trained ({study.layout.final_dir(name, seed)} does not "
                        f"exist); train the study first: tadm study {args.config} --stages train")
    started = time.perf_counter()

    # 1. samples: fixed K = 1, fixed K and calibrated adaptive per model and seed
    sample_files = []  # the cells asked for, in order: the scores and the table use these only
    for name in names:
        for seed in seeds:
            model = study.model(by_name[name], seed)
            policies = [("fixed", 1, FixedRefresh(1))]
            for K in matches:
                policies.append(("fixed", K, FixedRefresh(K)))
                cal_path = cells_dir / f"{name}-s{seed}" / f"calibration-T{T}-K{K}.json"
                cal_settings = {"calibration_samples": args.calibration_samples,
                                "bisection_steps": args.bisection_steps, "seed": args.seed + 1000}
                cal = _current(cal_path, cal_settings)
                if cal is None:
                    tau, mean = _calibrate(study, model, T, K, args.calibration_samples, args.seed + 1000,
                                           args.bisection_steps)
                    cal = {"tau": tau, "calibration_mean_refreshes": mean, "target_refreshes": math.ceil(T / K),
                           "settings": cal_settings}
                    _write(cal_path, cal)
                    print(f"[adaptive] {name} s{seed} T={T}: tau={tau:.4f} matches K={K} "
                          f"({mean:.2f} refreshes vs {math.ceil(T / K)})", flush=True)
                policies.append(("adaptive", K, AdaptiveRefresh(cal["tau"])))
            for kind, K, policy in policies:
                path = cells_dir / f"{name}-s{seed}" / f"samples-T{T}-{kind}-K{K}.json"
                if path not in sample_files:  # fixed K = 1 comes twice when --match has 1
                    sample_files.append(path)
                settings = {"num_samples": args.num_samples, "seed": args.seed, "policy": policy.config()}
                if _current(path, settings) is not None:
                    continue
                for stale in path.parent.glob(path.name.replace("samples-", "score-*-")):
                    stale.unlink()  # scores of the samples replaced below
                rows, refreshes, calls, seconds = _generate(study, model, T, policy, args.num_samples, args.seed)
                _write(path, {"model": name, "seed": seed, "steps": T, "policy": policy.config(),
                              "label": policy.label(), "match_K": K, "kind": kind, "token_ids": rows,
                              "refreshes": refreshes, "layer_calls": calls, "seconds": seconds, "settings": settings})
                print(f"[adaptive] sampled {name} s{seed} {policy.label()}: mean refreshes "
                      f"{statistics.mean(refreshes):.2f}, {seconds:.1f}s", flush=True)

    # 2. scores under each evaluator (MAUVE with the first evaluator's features)
    sp = cfg.sampling
    ref_texts, ref_ids = study.reference()
    sample_files.sort()
    mauve_evaluator = "ar" if "ar" in sp.evaluators else sp.evaluators[0]  # in-domain features when there are some
    for n_ev, ev_name in enumerate(sp.evaluators):
        # a score made against another reference (the first held-out blocks, before REFERENCE_ORDER) is made again
        todo = [f for f in sample_files if not _scored_against_the_reference(
            _read(f.with_name(f.name.replace("samples-", f"score-{ev_name}-"))))]
        if not todo:
            continue
        evaluator = load_evaluator(study.evaluator_spec(ev_name), device=study.device)
        use_mauve = ev_name == mauve_evaluator
        ref = gen_ppl(ref_texts, evaluator, batch_size=sp.eval_batch_size, features=use_mauve)
        for f in todo:
            saved = _read(f)
            texts = decode_samples(saved["token_ids"], study.tokenizer())
            ppl = gen_ppl(texts, evaluator, batch_size=sp.eval_batch_size, features=use_mauve)
            record = {"gen_ppl": ppl.gen_ppl, "data_gen_ppl": ref.gen_ppl, "entropy": mean_entropy(saved["token_ids"]),
                      "mauve": None, **REFERENCE_ORDER}
            if use_mauve and mauve_sample_problem(len(texts), len(ref.features), sp.mauve_min_samples) is None:
                record["mauve"] = mauve_from_features(ref.features, ppl.features,
                                                      min_samples=sp.mauve_min_samples).mauve
            _write(f.with_name(f.name.replace("samples-", f"score-{ev_name}-")), record)
            print(f"[adaptive] scored {f.parent.name}/{f.name} with {ev_name}: Gen PPL {ppl.gen_ppl:.2f}", flush=True)

    # 3. table
    rows = []
    for f in sample_files:
        saved = _read(f)
        row = {k: saved[k] for k in ("model", "seed", "steps", "kind", "match_K", "label", "seconds")}
        row.update(num_samples=len(saved["token_ids"]), mean_refreshes=statistics.mean(saved["refreshes"]),
                   mean_layer_calls=statistics.mean(saved["layer_calls"]),
                   min_refreshes=min(saved["refreshes"]), max_refreshes=max(saved["refreshes"]))
        if saved["kind"] == "adaptive":
            row["tau"] = saved["policy"]["tau"]
        for ev_name in sp.evaluators:
            score = _read(f.with_name(f.name.replace("samples-", f"score-{ev_name}-"))) or {}
            row[f"gen_ppl_{ev_name}"] = score.get("gen_ppl")
            if score.get("mauve") is not None:
                row["mauve"] = score["mauve"]
            row["entropy"] = score.get("entropy", row.get("entropy"))
        rows.append(row)
    out_dir = Path(args.out) if args.out else cells_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / "results.json", {"command": " ".join(["python", "benchmarks/adaptive_refresh.py", *sys.argv[1:]]),
                                      "rows": rows, "seconds_this_invocation": time.perf_counter() - started})
    lines = _table(rows, sp.evaluators)

    machine, commit = machine_info(), git_commit()
    header = ["# Adaptive vs fixed refresh at matched compute: table", "",
              f"- Command: `{' '.join(['python', 'benchmarks/adaptive_refresh.py', *sys.argv[1:]])}`",
              f"- Machine: {machine.get('processor', '?')}, {machine.get('cpu_count', '?')} CPUs, torch "
              f"{machine.get('torch', '?')}, {torch.get_num_threads()} thread(s)",
              f"- Wall time: {(time.perf_counter() - started) / 60:.1f} min (this invocation)",
              f"- Commit: `{(commit.get('commit') or 'unknown')[:10]}`", ""]
    (out_dir / "table.md").write_text("\n".join(header + lines) + "\n")
    print("\n".join(lines))
    return 0


def _scored_against_the_reference(score) -> bool:
    """A score record made against the study's reference as it is drawn now (:data:`REFERENCE_ORDER`)."""
    return isinstance(score, dict) and all(score.get(k) == v for k, v in REFERENCE_ORDER.items())


def _table(rows, evaluators):
    def mean_sd(values):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.2f}"
        return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"

    head = ["model", "policy", "refreshes / gen", "layer calls / gen"] + [f"Gen PPL ({e})" for e in evaluators]
    head += ["entropy", "MAUVE"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["match_K"], r["kind"]), []).append(r)
    order = sorted(groups, key=lambda g: (g[0], g[1], g[2] != "fixed"))
    for model, K, kind in order:
        g = groups[(model, K, kind)]
        label = f"fixed K={K}" if kind == "fixed" else f"adaptive (matches K={K}; tau {mean_sd([r['tau'] for r in g])})"
        cells = [model, label, mean_sd([r["mean_refreshes"] for r in g]), mean_sd([r["mean_layer_calls"] for r in g])]
        cells += [mean_sd([r.get(f"gen_ppl_{e}") for r in g]) for e in evaluators]
        cells += [mean_sd([r.get("entropy") for r in g]), mean_sd([r.get("mauve") for r in g])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    counts = "/".join(str(n) for n in sorted({r["num_samples"] for r in rows}))
    lines.append(f"Mean ± standard deviation over training seeds ({len({r['seed'] for r in rows})}); "
                 f"per seed: one generator seed, {counts} sequences generated one at a time.")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
