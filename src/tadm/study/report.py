"""The study's results: ``results.json`` / ``.csv``, ``report.md`` and plots, rebuilt from the unit files.

``report.md`` holds, in order:

1. the setup: data, tokenizer, model size, token budget, seeds, machine, commit and wall times;
2. the trained models: parameters, tokens seen, training time, fresh validation NELBO (AR: exact
   NLL), and the bound with an uninformative anchor (computed on a fully masked canvas);
3. the stale-anchor likelihood: the increase of the T-ANELBO over the fresh anchor at each cache
   age k, per step budget T: one value per training seed (averaged over its evaluation seeds), then
   their mean ± half their range (the run-to-run noise);
4. stale- against fresh-trained TADM paired by training seed (same initialisation and data order):
   per measure, the mean difference with its 95 % interval over seeds, the paired t-test and the
   sign test (:mod:`tadm.eval.significance`);
5. the discrete-time bound of the cached process of Algorithm 1 per refresh interval K;
6. per evaluator, the sampling sweep in the layouts of the paper's Table 2 (metric x T) and
   Table 4 (refresh-interval sweep: per T, MAUVE / Gen PPL / entropy / tok/s per model and K);
7. the degradation from K = 1 to the largest K per model, in Gen PPL and in likelihood, side by
   side, with the seed range.

Plots (``plots/``): NELBO increase against cache age (one line per model, one panel per T) and,
per evaluator, Gen PPL against measured tokens/s with the Pareto front (points labelled K, T).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tadm.eval.pipeline import REFERENCE_SEED, Cell, Run, cell_rows, data_row, throughput_note
from tadm.eval.plots import PLOTS_SKIPPED, can_plot, plot_nelbo_vs_age, plot_pareto
from tadm.eval.report import format_number, markdown_report
from tadm.eval.significance import paired_summary
from tadm.protocol import LayerSplit
from tadm.records import markdown_table, provenance_note, read_json, write_csv, write_json, write_text
from tadm.study.config import IN_DOMAIN_EVALUATOR, MODEL_KINDS, StudyConfig

__all__ = ["collect_results", "write_report"]

SAMPLE_FIELDS = (
    "evaluator", "model", "kind", "seed", "steps", "refresh", "sampler", "num_samples", "gen_ppl", "gen_ppl_nll",
    "entropy", "mauve", "mauve_num_samples", "mauve_num_reference", "mauve_buckets", "mauve_note",
    "tokens_per_second", "tokens_per_second_min", "tokens_per_second_max", "layer_calls", "layer_calls_counted",
    "compute_relative",
)
STALENESS_FIELDS = ("model", "kind", "seed", "eval_seed", "steps", "age", "nelbo", "increase")


def _mean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _spread(values: Sequence[float]) -> float | None:
    """Half the range of ``values`` (None for fewer than two)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return (max(values) - min(values)) / 2.0 if len(values) > 1 else None


def _seed_means(rows: Sequence[dict[str, Any]], value: Callable[[dict[str, Any]], float | None]) -> dict[int, float]:
    """One number per training seed: ``value(row)`` averaged over that seed's rows (its evaluation seeds); a row
    whose value is missing or not finite is left out, and a seed with no value left is absent."""
    per_seed: dict[int, list[float]] = {}
    for r in rows:
        v = value(r)
        if v is not None and math.isfinite(v):
            per_seed.setdefault(r["seed"], []).append(v)
    return {seed: sum(v) / len(v) for seed, v in per_seed.items()}


def _pm(mean: float | None, spread: float | None, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
    if mean is None:
        return "-"
    text = f"{mean * scale:+.{digits}f}{suffix}" if suffix == "%" else f"{mean * scale:.{digits}f}{suffix}"
    return text if spread is None else f"{text} ± {spread * scale:.{digits}f}"


def _percent(per_seed: dict[int, float], digits: int = 2) -> str:
    """Mean over training seeds ± half their range, in percent ("-" for no seed)."""
    values = list(per_seed.values())
    return _pm(_mean(values), _spread(values), digits, 100.0, "%") if values else "-"


def _age_increase(rows: Sequence[dict[str, Any]], T: int, age: int) -> dict[int, float]:
    """Per training seed: the T-ANELBO increase at cache age ``age`` over age 0 for step budget T."""
    return _seed_means([r for r in rows if str(T) in r["curves"]],
                       lambda r: r["curves"][str(T)][age] / r["curves"][str(T)][0] - 1.0)


def _k_change(res: dict[str, Any], label: str, field: str, ev: str, T: int, K: int) -> dict[int, float]:
    """Per sampled training seed: the relative change of ``field`` (Gen PPL, entropy) from K = 1 to K."""
    out = {}
    for seed in {r["seed"] for r in res["samples"] if r["model"] == label}:
        pick = {r["refresh"]: r for r in res["samples"]
                if r["model"] == label and r["evaluator"] == ev and r["steps"] == T and r["seed"] == seed}
        if 1 in pick and K in pick and pick[1].get(field) and pick[K].get(field) is not None:
            out[seed] = pick[K][field] / pick[1][field] - 1.0
    return out


# ---------------------------------------------------------------------------------------- collect
def _split(cfg: StudyConfig, kind: str) -> Any:
    """Shared / anchor / denoiser Transformer layers of a study model (MDLM: one stack, no anchor)."""
    s = cfg.size
    if MODEL_KINDS[kind][0] in ("tadm", "adlm"):
        return LayerSplit(shared=0, anchor=s.anchor_layers, denoiser=s.denoiser_layers)
    return LayerSplit(shared=0, anchor=0, denoiser=s.anchor_layers + s.denoiser_layers)


def collect_results(cfg: StudyConfig, layout: Any, run: Run, cells: Sequence[Cell]) -> dict[str, Any]:
    """Every finished unit's numbers, as plain lists of rows (missing units are simply absent); ``run`` and
    ``cells`` are the study's pipeline run and sampling cells."""
    models, likelihood, staleness, cached, samples = [], [], [], [], []
    for m in cfg.models:
        for seed in cfg.seeds_of(m):
            marker = read_json(layout.run_dir(m.name, seed) / "study_unit.json")
            if marker is not None:
                models.append({"model": m.name, "kind": m.kind, "seed": seed, "num_parameters": marker["num_parameters"],
                               "tokens_seen": marker["tokens_seen"], "steps": marker["step"],
                               "train_seconds": marker["wall_time_s"], "train_val_nelbo": marker["val_nelbo"]})
            lik = read_json(layout.eval_file(m.name, seed, "likelihood"))
            if lik is not None:
                result = lik["result"]
                likelihood.append({**result, "bound": result.get("kind"), "eval_seed": result.get("seed"),
                                   "model": m.name, "kind": m.kind, "seed": seed})
            for naive in (False, True):
                label = f"{m.name}-naive" if naive else m.name
                for eval_seed in cfg.staleness.eval_seeds:
                    st = read_json(layout.eval_file(m.name, seed, f"staleness{'-naive' if naive else ''}-e{eval_seed}"))
                    if st is None:
                        continue
                    # the unit's own "seed" is the evaluation seed: the training seed must win
                    unit = {"model": label, "kind": m.kind, "seed": seed, "eval_seed": eval_seed}
                    staleness.append({**st["staleness"], **unit})
                    cached.append({**st["cached"], **unit})
    baseline_layers = next((cfg.size.anchor_layers + cfg.size.denoiser_layers for m in cfg.models
                            if m.kind == "mdlm"), 12)
    kind = {m.name: m.kind for m in cfg.models}
    data_rows = []
    for ev in cfg.sampling.evaluators:
        data = data_row(run, ev)
        if data is not None:
            data_rows.append(data)
        rows = cell_rows(run, cells, ev, split_of=lambda cell: _split(cfg, kind[cell.label.removesuffix("-naive")]),
                         baseline_layers=baseline_layers)
        samples += [{**r, "kind": kind[r["model"].removesuffix("-naive")]} for r in rows]
    return {"models": models, "likelihood": likelihood, "staleness": staleness, "cached": cached,
            "samples": samples, "data": data_rows, "baseline_layers": baseline_layers}


def _largest_fixed(cfg: StudyConfig) -> int:
    """The largest fixed refresh interval K among the sampling policies (1 when there is none else)."""
    return max([p.fixed_interval for p in cfg.sampling.policies() if p.fixed_interval is not None] or [1])


# ------------------------------------------------------------------------------------------ tables
def _model_table(cfg: StudyConfig, res: dict[str, Any]) -> str:
    body = []
    for m in cfg.models:
        runs = [r for r in res["models"] if r["model"] == m.name]
        if not runs:
            body.append([m.name, m.kind] + ["-"] * 6)
            continue
        lik = [r for r in res["likelihood"] if r["model"] == m.name]
        nll = list(_seed_means(lik, lambda r: r["nll"]).values())
        kind = "exact NLL" if lik and lik[0]["bound"] == "exact" else "NELBO"
        blank = [r for r in res["staleness"] if r["model"] == m.name and r.get("uninformative") is not None]
        uninf = list(_seed_means(blank, lambda r: r["uninformative"] / r["fresh"] - 1.0).values())
        body.append([
            m.name, m.kind, f"{runs[0]['num_parameters'] / 1e6:.2f}M", f"{runs[0]['tokens_seen'] / 1e6:.2f}M",
            f"{_mean([r['train_seconds'] for r in runs]) / 60:.1f} min x {len(runs)}",
            f"{_pm(_mean(nll), _spread(nll), 4)} ({kind})" if nll else "-",
            f"{_pm(_mean(nll) and math.exp(_mean(nll)), None, 1)}" if nll else "-",
            (f"{format_number(_mean([r['uninformative'] for r in blank]), 4)} "
             f"({_pm(_mean(uninf), _spread(uninf), 1, 100.0, '%')})") if uninf else "-",
        ])
    header = ["model", "kind", "parameters", "tokens / run", "training", "val nats/token (mean ± half-range)",
              "perplexity (bound)", "uninformative anchor"]
    return markdown_table(header, body)


def _staleness_table(cfg: StudyConfig, res: dict[str, Any], T: int) -> str:
    ages = list(range(1, cfg.staleness.max_age + 1))
    body = []
    for label in dict.fromkeys(r["model"] for r in res["staleness"]):
        rows = [r for r in res["staleness"] if r["model"] == label]
        body.append([label, str(len({r["seed"] for r in rows}))] + [_percent(_age_increase(rows, T, k)) for k in ages])
    return markdown_table(["model", "seeds"] + [f"k={k}" for k in ages], body)


def _per_seed_table(cfg: StudyConfig, res: dict[str, Any]) -> str:
    """One row per anchored model and training seed: the numbers behind the means, averaged over evaluation seeds."""
    age, kmax = cfg.staleness.max_age, max(cfg.staleness.refresh)
    header = ["model", "seed", "fresh NELBO", "uninformative anchor"]
    header += [f"k={age}, T={T}" for T in cfg.staleness.steps] + [f"cached K={kmax}"]
    body = []
    for label in dict.fromkeys(r["model"] for r in res["staleness"]):
        for seed in sorted({r["seed"] for r in res["staleness"] if r["model"] == label}):
            rows = [r for r in res["staleness"] if r["model"] == label and r["seed"] == seed]
            cached = [r for r in res["cached"] if r["model"] == label and r["seed"] == seed]
            fresh = _mean([r["fresh"] for r in rows])
            blank = [r["uninformative"] / r["fresh"] - 1.0 for r in rows if r.get("uninformative") is not None]
            cells = [label, str(seed), format_number(fresh, 4), _pm(_mean(blank), None, 1, 100.0, "%") if blank else "-"]
            cells += [_percent(_age_increase(rows, T, age)) for T in cfg.staleness.steps]
            inc = [r["increase"][str(kmax)] for r in cached if r.get("increase") and str(kmax) in r["increase"]]
            cells.append(_pm(_mean(inc), None, 2, 100.0, "%") if inc else "-")
            body.append(cells)
    return markdown_table(header, body)


def _cached_table(cfg: StudyConfig, res: dict[str, Any]) -> str:
    Ks = cfg.staleness.refresh
    body = []
    for label in dict.fromkeys(r["model"] for r in res["cached"]):
        rows = [r for r in res["cached"] if r["model"] == label]
        cells = [label]
        for K in Ks:
            values = list(_seed_means(rows, lambda r: r["bounds"].get(str(K))).values())
            incs = _seed_means(rows, lambda r: (r.get("increase") or {}).get(str(K)))
            if not values:
                cells.append("-")
            elif K == 1 or not incs:
                cells.append(format_number(_mean(values), 4))
            else:
                cells.append(f"{format_number(_mean(values), 4)} ({_percent(incs)})")
        body.append(cells)
    return markdown_table(["model"] + [f"K={K}" for K in Ks], body)


def _degradation_table(cfg: StudyConfig, res: dict[str, Any]) -> str:
    """Per model: Gen PPL change K=1 -> K=max per evaluator and T, and the likelihood increase at the largest age."""
    kmax = _largest_fixed(cfg)
    age = cfg.staleness.max_age
    header = ["model"]
    for ev in cfg.sampling.evaluators:
        for T in cfg.sampling.steps:
            header.append(f"Gen PPL ({_ev_label(ev)}) K=1→{kmax}, T={T}")
    for T in cfg.staleness.steps:
        header.append(f"NELBO k=0→{age}, T={T}")
    body = []
    labels = list(dict.fromkeys([r["model"] for r in res["samples"]] + [r["model"] for r in res["staleness"]]))
    for label in labels:
        cells = [label] + [_percent(_k_change(res, label, "gen_ppl", ev, T, kmax), 1)
                           for ev in cfg.sampling.evaluators for T in cfg.sampling.steps]
        stale = [r for r in res["staleness"] if r["model"] == label]
        body.append(cells + [_percent(_age_increase(stale, T, age)) for T in cfg.staleness.steps])
    return markdown_table(header, body)


# ------------------------------------------------------------------------------- paired by training seed
def _paired_measures(cfg: StudyConfig, res: dict[str, Any]) -> list[tuple[str, Callable[[str], dict[int, float]]]]:
    """(name, model label -> {training seed: value}) for every measure of degradation with K or cache age."""
    age, kmax = cfg.staleness.max_age, max(cfg.staleness.refresh)
    Kmax = _largest_fixed(cfg)

    def nelbo_increase(T: int) -> Callable[[str], dict[int, float]]:
        return lambda label: _age_increase([r for r in res["staleness"] if r["model"] == label], T, age)

    def cached_increase(label: str) -> dict[int, float]:
        return _seed_means([r for r in res["cached"] if r["model"] == label],
                           lambda r: (r.get("increase") or {}).get(str(kmax)))

    def sample_ratio(field: str, ev: str, T: int) -> Callable[[str], dict[int, float]]:
        return lambda label: _k_change(res, label, field, ev, T, Kmax)

    measures = [(f"NELBO increase at k = {age}, T = {T}", nelbo_increase(T)) for T in cfg.staleness.steps]
    measures.append((f"cached-process bound, K = {kmax} over K = 1", cached_increase))
    for ev in cfg.sampling.evaluators:
        for T in cfg.sampling.steps:
            measures.append((f"Gen PPL ({_ev_label(ev)}) K = 1 → {Kmax}, T = {T}", sample_ratio("gen_ppl", ev, T)))
            measures.append((f"unigram entropy K = 1 → {Kmax}, T = {T}", sample_ratio("entropy", ev, T)))
    return measures


def _paired_table(cfg: StudyConfig, res: dict[str, Any]) -> str | None:
    """Stale- against fresh-trained TADM, paired by training seed (same initialisation and data order)."""
    stale = [m.name for m in cfg.models if m.kind == "tadm"]
    fresh = [m.name for m in cfg.models if m.kind == "tadm-fresh"]
    body = []
    for a, b in ((a, b) for a in stale for b in fresh):
        for name, per_seed in _paired_measures(cfg, res):
            va, vb = per_seed(a), per_seed(b)
            seeds = sorted(va.keys() & vb.keys())
            if not seeds:
                continue
            s = paired_summary([va[k] - vb[k] for k in seeds])
            body.append([name, f"{a} − {b}", str(len(seeds)), _pm(_mean([va[k] for k in seeds]), None, 2, 100.0, "%"),
                         _pm(_mean([vb[k] for k in seeds]), None, 2, 100.0, "%"),
                         f"{100 * s.mean:+.2f} [{100 * s.low:+.2f}, {100 * s.high:+.2f}]" if s.units > 1
                         else f"{100 * s.mean:+.2f}",
                         f"{s.behind} / {s.ahead} / {s.tied}", f"{s.t_p:.3g}" if math.isfinite(s.t_p) else "-",
                         f"{s.sign_p:.3g}"])
    if not body:
        return None
    header = ["measure", "pair", "seeds", "stale-trained", "fresh-trained", "difference (pp, 95% CI)",
              "seeds lower / higher / tied", "paired t p", "sign p"]
    return markdown_table(header, body)


def _invocation_table(invocations: Sequence[dict[str, Any]]) -> str:
    """The invocations that ran at least one unit: when, at which commit, and how long each stage took."""
    body = []
    for inv in invocations:
        if not inv.get("ran") and inv.get("ran") is not None:
            continue
        seconds = inv.get("seconds") or {}
        stages = ", ".join(f"{k} {v / 60:.1f}" for k, v in seconds.items() if k != "total" and v >= 1.0)
        commit = (inv.get("commit") or "unknown")[:10] + (" (local changes)" if inv.get("dirty") else "")
        total = seconds.get("total")
        body.append([str(inv.get("started", "?")), commit, stages or "-",
                     "cut off" if inv.get("ran") is None else f"{inv['ran']} units",
                     "-" if total is None else f"{total / 60:.1f}"])
    return markdown_table(["started", "commit", "stages (min)", "units", "total (min)"], body)


def _ev_label(ev: str) -> str:
    return "in-domain AR" if ev == IN_DOMAIN_EVALUATOR else Path(ev).name


def _sweep_rows(res: dict[str, Any], ev: str) -> list[dict[str, Any]]:
    """Sampling rows of one evaluator in the shape of ``markdown_report``: per (model, T, K), Gen PPL, entropy,
    MAUVE, tok/s and its slowest and fastest are each the mean over the sampled training seeds."""
    rows: list[dict[str, Any]] = [dict(r) for r in res["data"] if r["evaluator"] == ev]
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in res["samples"]:
        if r["evaluator"] == ev:
            groups.setdefault((r["model"], r["steps"], r["refresh"]), []).append(r)
    for (model, T, K), group in groups.items():
        row = dict(group[0])
        for key in ("gen_ppl", "entropy", "mauve", "tokens_per_second", "tokens_per_second_min",
                    "tokens_per_second_max"):
            values = [g.get(key) for g in group if g.get(key) is not None]
            row[key] = _mean(values) if values else None
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- write
def _staleness_long(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in res["staleness"]:
        for T, curve in r["curves"].items():
            for k, value in enumerate(curve):
                out.append({"model": r["model"], "kind": r["kind"], "seed": r["seed"], "eval_seed": r["eval_seed"],
                            "steps": int(T), "age": k, "nelbo": value, "increase": value / curve[0] - 1.0})
    return out


def _write_data_files(cfg: StudyConfig, res: dict[str, Any], invocations: list, root: Path) -> dict[str, Path]:
    """``results.json`` (everything), ``results.csv`` (sampling cells), ``staleness.csv`` and the plots."""
    files = {"json": write_json(root / "results.json", {"config": cfg.to_dict(), "invocations": invocations, **res}),
             "csv": write_csv(root / "results.csv", SAMPLE_FIELDS, res["samples"]),
             "staleness_csv": write_csv(root / "staleness.csv", STALENESS_FIELDS, _staleness_long(res))}
    if not can_plot():
        warnings.warn(PLOTS_SKIPPED, stacklevel=2)
        return files
    plots = root / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    if res["staleness"]:
        files["plot_staleness"] = plot_nelbo_vs_age(res["staleness"], plots / "nelbo_vs_cache_age.png")
    for ev in cfg.sampling.evaluators:
        rows = [r for r in res["samples"] if r["evaluator"] == ev and r.get("tokens_per_second") is not None]
        if rows:
            files[f"plot_pareto_{ev}"] = plot_pareto(_sweep_rows({"samples": rows, "data": []}, ev),
                                                     plots / f"genppl_vs_tokens_per_s_{Path(ev).name}.png",
                                                     title=f"Gen PPL under {_ev_label(ev)} vs measured tokens/s")
    return files


def _setup_lines(cfg: StudyConfig, invocations: list) -> list[str]:
    """Title, command, data, size, training, machine and wall time, the invocations, and a dirty-tree note."""
    last = invocations[-1] if invocations else {}
    machine = last.get("machine", {})
    total = sum(inv.get("seconds", {}).get("total", 0.0) for inv in invocations)
    s = cfg.size
    note = provenance_note(invocations)
    return [
        f"# Staleness study `{cfg.name}`",
        "",
        *([note, ""] if note else []),
        f"- Command: `{last.get('command') or 'tadm study ' + cfg.name}` (re-run it to continue; finished units are skipped).",
        f"- Data: `{cfg.data.source}`, tokenizer `{cfg.data.tokenizer}`"
        + (f" ({cfg.data.tokenizer_vocab_size} tokens)" if cfg.data.tokenizer == "bpe" else "")
        + f", sequences of {cfg.data.seq_len} tokens; held-out split {cfg.data.val_fraction:g} of the documents.",
        f"- Size of every model: d = {s.hidden_size}, {s.num_heads} heads, {s.anchor_layers} anchor + "
        f"{s.denoiser_layers} denoiser blocks (MDLM and AR: {s.anchor_layers + s.denoiser_layers} blocks).",
        f"- Training: {cfg.train.max_steps} steps of {cfg.train.global_batch_size} sequences "
        f"({cfg.train.max_steps * cfg.train.global_batch_size * cfg.data.seq_len / 1e6:.2f}M tokens) per run, "
        f"lr {cfg.optim.lr:g} ({cfg.optim.lr_schedule}), EMA {cfg.train.ema:g}; training seeds {cfg.seeds}; "
        f"stale anchors from K in {cfg.objective.refresh_intervals}, T in {cfg.objective.step_budgets}.",
        f"- Machine: {machine.get('processor', '?')}, {machine.get('cpu_count', '?')} CPUs, torch "
        f"{machine.get('torch', '?')}" + (f", {machine['gpu']}" if machine.get("gpu") else "")
        + f"; wall time {total / 60:.1f} min recorded over {len(invocations)} invocation(s) (an invocation cut "
        "off records the stages it finished; the invocations that ran units are listed below).",
        "",
        _invocation_table(invocations),
        "",
    ]


def _likelihood_lines(cfg: StudyConfig, res: dict[str, Any]) -> list[str]:
    """The models, the stale-anchor likelihood per T, per training seed, and the cached-process bound."""
    lines = ["## Models", "", _model_table(cfg, res), "",
             "Validation: the fresh-anchor NELBO (AR: exact NLL) on the first "
             f"{cfg.staleness.max_blocks} held-out blocks, {cfg.staleness.t_samples} t draws per block, with the first "
             f"evaluation seed ({cfg.staleness.eval_seeds[0]}); ± is half the range of the per-training-seed values. "
             "*Uninformative anchor*: the same bound with the anchor computed on a fully masked canvas "
             "(t' = 1), relative to the fresh one: how much the anchor carries that the denoiser cannot recover alone; "
             f"each training seed's value is averaged over the evaluation seeds {list(cfg.staleness.eval_seeds)}.",
             ""]
    for T in cfg.staleness.steps:
        lines += [f"## Stale-anchor likelihood, T = {T}", "",
                  f"Increase of the continuous-time T-ANELBO over the fresh anchor when the anchor is k steps old "
                  f"(t' = t + k/{T}, z_t' drawn from z_t by Eq. 12, the same t draws and masks for every k). "
                  "Mean over training seeds (each averaged over its evaluation seeds) ± half the range of the "
                  "per-training-seed values.", "", _staleness_table(cfg, res, T), ""]
    if res["staleness"]:
        lines += ["## Per training seed", "",
                  "The anchored models one training seed at a time (each number averaged over the evaluation seeds): "
                  "the fresh bound, the uninformative-anchor gap, the increase at the largest cache age, and the "
                  "cached-process bound at the largest K over K = 1.", "", _per_seed_table(cfg, res), ""]
    paired = _paired_table(cfg, res)
    if paired:
        lines += ["## Stale- against fresh-trained TADM, paired by training seed", "",
                  "One training seed gives both recipes the same initialisation and data order, so each seed is "
                  "one paired unit. Per measure: the mean over seeds of each recipe, the mean difference "
                  "(stale − fresh, in points) with its 95 % Student-t interval over seeds, the seeds where "
                  "stale-trained TADM is lower / higher / tied (lower degradation is better), the two-sided paired "
                  "t-test and the exact sign test over seeds.", "", paired, ""]
    if res["cached"]:
        discrete = cfg.staleness.discrete_steps or min(cfg.staleness.steps)
        lines += [f"## Cached reverse process, discrete-time bound (T = {discrete})", "",
                  "Nats/token of the discrete-time bound of Algorithm 1's cached process (t'(i) = time of the most "
                  "recent refresh), mean over training seeds (each averaged over its evaluation seeds); in "
                  "parentheses its increase over K = 1, mean over training seeds ± half the range of the "
                  "per-training-seed values where several were run.", "", _cached_table(cfg, res), ""]
    return lines


def _sampling_lines(cfg: StudyConfig, res: dict[str, Any]) -> list[str]:
    """Per evaluator, the sampling sweep in the paper's Table 2 and Table 4 layouts; then the degradation table."""
    adlm = next((m.name for m in cfg.models if m.kind == "adlm"), None)
    lines: list[str] = []
    for ev in cfg.sampling.evaluators:
        rows = _sweep_rows(res, ev)
        if not any(r["model"] != "data" for r in rows):
            continue
        table = markdown_report(rows, throughput_baseline=adlm, title="x", level=3).split("\n", 2)[2]
        seeds = sorted({r["seed"] for r in res["samples"] if r["evaluator"] == ev})
        averaged = (f" Every number of a cell (MAUVE, Gen PPL, entropy, tok/s and its [slowest-fastest]) is the mean "
                    f"over the models of training seeds {', '.join(map(str, seeds))}, not a median or a pooled value."
                    if len(seeds) > 1 else "")
        lines += [f"## Sampling sweep, Gen PPL and MAUVE under {_ev_label(ev)}", "",
                  f"{cfg.sampling.num_samples} samples of {cfg.data.seq_len} tokens per cell (seed "
                  f"{cfg.sampling.seed}), sampler `{cfg.sampling.sampler.name}` (top-p {cfg.sampling.sampler.top_p}, nucleus "
                  f"`{cfg.sampling.sampler.nucleus}`, time grid `{cfg.sampling.sampler.time_grid}`); models of training seeds "
                  f"{cfg.sampling.model_seeds or 'first'}. MAUVE [samples, k-means clusters] against blocks of "
                  f"{cfg.sampling.reference} ({cfg.sampling.reference_split}) drawn at random (seed {REFERENCE_SEED}). "
                  "Compute: Transformer-layer calls of one "
                  f"generation relative to a {res['baseline_layers']}-layer MDLM. " + throughput_note(rows).rstrip(".")
                  + (f"; (x) relative to {adlm} at K = 1." if adlm else ".") + averaged, "", table.strip(), ""]
    lines += ["## Degradation from K = 1 to the largest K", "",
              f"Relative change of Gen PPL from K = 1 to K = {_largest_fixed(cfg)} (same samples' settings), and "
              f"of the likelihood bound from cache age 0 to {cfg.staleness.max_age}; mean over training seeds ± half "
              "the range of the per-training-seed values where several were run.", "", _degradation_table(cfg, res), ""]
    return lines


def write_report(cfg: StudyConfig, layout: Any, run: Run, cells: Sequence[Cell], *,
                 log: Callable[[str], None] = print) -> dict[str, Path]:
    """Rebuild ``results.json``, ``results.csv``, ``staleness.csv``, ``report.md`` and the plots."""
    res = collect_results(cfg, layout, run, cells)
    if not any(res[name] for name in ("models", "likelihood", "staleness", "samples")):
        raise ValueError(f"{layout.root} holds no finished unit of this study to report: run its other stages first "
                         "(the default --stages runs them all)")
    invocations = (read_json(layout.manifest) or {}).get("invocations", [])
    files = _write_data_files(cfg, res, invocations, layout.root)
    lines = [*_setup_lines(cfg, invocations), *_likelihood_lines(cfg, res), *_sampling_lines(cfg, res),
             "## Files", "", "`results.json` (everything above, with configs, seeds, machine and commit), "
             "`results.csv` (one row per sampling cell and evaluator), `staleness.csv` (one row per model, seed, T "
             f"and k){', `plots/`' if any(name.startswith('plot') for name in files) else ''}.", ""]
    files["report"] = write_text(layout.root / "report.md", "\n".join(lines))
    log(f"[study] report: {files['report']}")
    return files
