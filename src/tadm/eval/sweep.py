"""Evaluation sweeps over models, sampling budgets T and anchor refresh intervals K (paper Tables 2 and 5).

For every cell (model, T, K) :func:`run_sweep` generates ``num_samples`` unconditional samples of
``length`` tokens with anchor-cache inference (Algorithm 1), decodes them with the model's
tokenizer and reports

* MAUVE against held-out reference text and Gen PPL, both under one evaluator loaded once per
  run (:mod:`tadm.eval.evaluator`, :mod:`tadm.eval.mauve`, :mod:`tadm.eval.gen_ppl`); MAUVE is
  stored with its sample and cluster counts, and not computed (the row says why) when either side
  has fewer than ``mauve_min_samples`` texts;
* the mean per-sample unigram entropy (:mod:`tadm.eval.entropy`);
* the Transformer-layer calls of one generation, Eq. (anchor-cache-compute), counted and
  analytic, and their ratio to an uncached MDLM (:mod:`tadm.eval.compute`);
* measured tokens/s (:mod:`tadm.eval.throughput`): after every quality cell is done, all cells are
  timed together, interleaved in shuffled rounds, and each reports the median of its timed
  generations with the fastest and slowest.

Rows go to ``results.json`` / ``results.csv`` after every cell (:mod:`tadm.eval.report`); a sweep
started again on the same output directory with the same settings skips the finished cells, and
may add new T or K values. At the end the Markdown tables and the plots are written.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tadm.eval.compute import layer_calls
from tadm.eval.entropy import mean_entropy
from tadm.eval.evaluator import Evaluator, load_evaluator
from tadm.eval.gen_ppl import decode_samples, gen_ppl
from tadm.eval.mauve import MAUVE_MIN_SAMPLES, mauve_from_features, mauve_sample_problem, text_features
from tadm.eval.report import DATA_MODEL, cell_key, markdown_report, read_results, write_results
from tadm.records import machine_info
from tadm.eval.throughput import MIN_TIMED_GENERATIONS, TimingCell, interleaved_throughput, resolve_dtype
from tadm.sampling.registry import SAMPLERS, get_sampler, sampler_config, sampler_options

MASKED_SAMPLERS = tuple(sorted(name for name, entry in SAMPLERS.items() if entry.needs == "mask_id"))

__all__ = [
    "PAPER_BASELINE_LAYERS",
    "CellContext",
    "SweepConfig",
    "SweepOutput",
    "evaluate_cell",
    "load_model_and_tokenizer",
    "parse_model_specs",
    "resolve_sampler",
    "run_sweep",
]

PAPER_BASELINE_LAYERS = 12  # the paper normalises compute to the 12-layer MDLM
MAUVE_SEED = 25  # mauve-text's default k-means seed
_RESUME_FREE = ("steps", "refresh", "out_dir")  # settings a resumed sweep may change


def parse_model_specs(specs: Sequence[str]) -> dict[str, str]:
    """``["tadm=runs/tadm", "mdlm=runs/mdlm"]`` -> ``{"tadm": "runs/tadm", ...}`` (names unique, non-empty)."""
    models: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"model spec {spec!r} must look like NAME=PATH (a checkpoint directory or builder name)")
        if name == DATA_MODEL:
            raise ValueError(f"model name {DATA_MODEL!r} is reserved for the reference-text row")
        if name in models:
            raise ValueError(f"model name {name!r} is given twice")
        models[name] = path
    if not models:
        raise ValueError("no model to evaluate: pass at least one NAME=PATH")
    return models


def resolve_sampler(name: str, num_steps: int, length: int) -> str:
    """The sampler of a cell: ``"auto"`` is the paper's rule, ReMDM-cap for T < L and ReMDM-loop for T >= L."""
    if name == "auto":
        return "remdm-cap" if num_steps < length else "remdm-loop"
    return name


@dataclass
class SweepConfig:
    """Everything a sweep needs; saved (resolved) in ``results.json``.

    ``models`` maps a display name to a checkpoint directory, a hub id or a builder name (random
    weights, then ``tokenizer`` is required). ``reference`` is any text source of
    :func:`~tadm.training.data.load_texts` (None: no MAUVE); its ``reference_split`` ("val": the
    held-out documents, "all": every document) is packed into ``length``-token blocks with each
    model's tokenizer. ``baseline_layers`` normalises compute (default: the first MDLM-like model
    of the sweep, else 12 as in the paper). ``throughput_baseline`` names the model whose K = 1
    row normalises tok/s in the table (the paper uses ADLM). ``throughput_generations = 0``
    skips the throughput measurement.
    """

    models: dict[str, str]
    steps: list[int]
    refresh: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    num_samples: int = 16
    length: int | None = None
    sampler: str = "auto"
    top_p: float = 0.9
    eta: float | None = None
    schedule: str = "loglinear"
    nucleus: str = "released"
    time_grid: str = "paper"
    batch_size: int = 16
    seed: int = 0
    tokenizer: str | None = None
    evaluator: str | None = None
    eval_batch_size: int = 8
    reference: str | None = "brown"
    reference_split: str = "val"
    reference_val_fraction: float = 0.02
    num_reference: int | None = None
    mauve_num_buckets: int | str = "auto"
    mauve_min_samples: int = MAUVE_MIN_SAMPLES
    throughput_generations: int = 20
    throughput_batch_size: int = 1
    throughput_warmup: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    baseline_layers: int | None = None
    throughput_baseline: str | None = None
    cache_dir: str = ".tadm-cache"
    out_dir: str = "tadm-sweep"

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("SweepConfig.models is empty: pass at least one NAME=PATH")
        for name, values in (("steps", self.steps), ("refresh", self.refresh)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"SweepConfig.{name} must be a non-empty list of integers >= 1, got {values!r}")
        for name in ("num_samples", "batch_size", "eval_batch_size", "throughput_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SweepConfig.{name} must be an integer >= 1, got {value!r}")
        if self.throughput_generations < 0 or self.throughput_warmup < 0:
            raise ValueError("SweepConfig.throughput_generations and throughput_warmup must be >= 0")
        if 0 < self.throughput_generations < MIN_TIMED_GENERATIONS:
            raise ValueError(f"SweepConfig.throughput_generations must be 0 (skip) or >= {MIN_TIMED_GENERATIONS} "
                             f"(tokens/s is the median of the timed generations), got {self.throughput_generations}")
        if self.mauve_min_samples < 2:
            raise ValueError(f"SweepConfig.mauve_min_samples must be >= 2, got {self.mauve_min_samples}")
        if self.sampler != "auto" and self.sampler not in MASKED_SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; valid: auto, {', '.join(MASKED_SAMPLERS)}")
        for name in ("remdm-cap", "remdm-loop") if self.sampler == "auto" else (self.sampler,):
            sampler_config(name, **sampler_options(name, self.sampler_settings()))
        if self.reference_split not in ("val", "all"):
            raise ValueError(f"SweepConfig.reference_split must be 'val' or 'all', got {self.reference_split!r}")
        resolve_dtype(self.dtype)
        self.steps = sorted(set(self.steps))
        self.refresh = sorted(set(self.refresh))

    def sampler_settings(self) -> dict[str, Any]:
        """The sampler options of every cell (unset ones keep the sampler's defaults)."""
        return {"top_p": self.top_p, "eta": self.eta, "schedule": self.schedule, "nucleus": self.nucleus,
                "time_grid": self.time_grid}

    def identity(self) -> dict[str, Any]:
        """The settings that must match for a resumed sweep to reuse finished cells."""
        return {k: v for k, v in asdict(self).items() if k not in _RESUME_FREE}


# ---------------------------------------------------------------------------------------- loading
def load_model_and_tokenizer(
    spec: str, tokenizer: str | os.PathLike[str] | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, Any]:
    """A model (eval mode, on ``device``) and its ``TextTokenizer``, vocabularies checked against each other.

    ``spec`` is a checkpoint directory (the tokenizer is looked up in it, in ``tokenizer/`` beside
    its files, or in its parent), a Hub id, or a builder name such as ``"tadm-tiny"`` (random
    weights; ``tokenizer`` must then be given). ``tokenizer`` overrides the lookup.
    """
    from tadm.specs import find_tokenizer, resolve_model
    from tadm.training.tokenization import check_vocab_compatible

    model = resolve_model(spec, device=device)
    tok = find_tokenizer(spec, tokenizer)
    mask_id = getattr(model, "mask_token_id", None)
    if mask_id is None:  # the AR baseline has no mask token: its vocabulary may lack the tokenizer's mask id
        if model.vocab_size not in (tok.vocab_size, tok.vocab_size - 1):
            raise ValueError(
                f"vocabulary mismatch: the tokenizer has {tok.vocab_size} tokens but the AR model has {model.vocab_size}"
            )
    else:
        check_vocab_compatible(tok, model.vocab_size, mask_id)
    return model, tok


@dataclass
class CellContext:
    """What every cell of one model shares: the loaded model, tokenizer, evaluator and reference features."""

    config: SweepConfig
    name: str
    path: str
    model: Any
    tokenizer: Any
    evaluator: Evaluator
    length: int
    baseline_layers: int
    reference_features: Any = None  # (n_ref, D) array or None
    progress: bool = False


@dataclass
class SweepOutput:
    """Rows of every finished cell and the files written."""

    rows: list[dict[str, Any]]
    files: dict[str, Path]
    evaluated: list[tuple[str, int, int]] = field(default_factory=list)  # cells run in this call


def _build_sampler(ctx: CellContext, num_steps: int) -> tuple[str, Any]:
    name = resolve_sampler(ctx.config.sampler, num_steps, ctx.length)
    return name, get_sampler(name, ctx.model.mask_token_id, **sampler_options(name, ctx.config.sampler_settings()))


def evaluate_cell(ctx: CellContext, num_steps: int, refresh_interval: int) -> dict[str, Any]:
    """Generate, score and time one (model, T, K) cell; return its result row."""
    from tadm.sampling import generate

    cfg = ctx.config
    start = time.perf_counter()
    sampler_name, sampler = _build_sampler(ctx, num_steps)
    device = torch.device(cfg.device)
    amp = resolve_dtype(cfg.dtype)
    generator = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(cfg.seed)
    batches, counted, sampling_seconds = [], None, 0.0
    sizes = [min(cfg.batch_size, cfg.num_samples - s) for s in range(0, cfg.num_samples, cfg.batch_size)]
    for size in tqdm(sizes, desc=f"{ctx.name} T={num_steps} K={refresh_interval} sampling",
                     disable=not ctx.progress, leave=False):
        with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
            out = generate(ctx.model, sampler, batch_size=size, seq_len=ctx.length, num_steps=num_steps,
                           refresh_interval=refresh_interval, generator=generator, device=device)
        batches.append(out.tokens.cpu())
        counted = out.layer_calls.total
        sampling_seconds += out.seconds
    tokens = torch.cat(batches)  # (N, L)
    texts = decode_samples(tokens, ctx.tokenizer)
    ppl = gen_ppl(texts, ctx.evaluator, batch_size=cfg.eval_batch_size, progress=ctx.progress)
    mauve: dict[str, Any] = {"mauve": None, "mauve_num_samples": None, "mauve_num_reference": None,
                             "mauve_buckets": None, "mauve_note": None}
    if ctx.reference_features is not None:
        n_ref = len(ctx.reference_features)
        problem = mauve_sample_problem(len(texts), n_ref, cfg.mauve_min_samples)
        mauve.update(mauve_num_samples=len(texts), mauve_num_reference=n_ref)
        if problem is None:
            q = text_features(texts, ctx.evaluator, batch_size=cfg.eval_batch_size, progress=ctx.progress)
            result = mauve_from_features(ctx.reference_features, q, num_buckets=cfg.mauve_num_buckets,
                                         seed=MAUVE_SEED, min_samples=cfg.mauve_min_samples)
            mauve.update(mauve=result.mauve, mauve_buckets=result.num_buckets)
        else:
            mauve["mauve_note"] = problem
    calls = layer_calls(ctx.model.layer_split, num_steps, refresh_interval)
    baseline = num_steps * ctx.baseline_layers
    return {
        "model": ctx.name,
        "path": ctx.path,
        "steps": num_steps,
        "refresh": refresh_interval,
        "sampler": sampler_name,
        "length": ctx.length,
        "num_samples": cfg.num_samples,
        "seed": cfg.seed,
        **mauve,
        "gen_ppl": ppl.gen_ppl,
        "gen_ppl_nll": ppl.nll,
        "gen_ppl_tokens": ppl.num_tokens,
        "entropy": mean_entropy(tokens),
        "layer_calls": calls,
        "layer_calls_counted": counted,
        "baseline_layer_calls": baseline,
        "compute_relative": calls / baseline,
        "tokens_per_second": None,  # filled by the interleaved timing phase of run_sweep
        "tokens_per_second_min": None,
        "tokens_per_second_max": None,
        "throughput_generations": cfg.throughput_generations,
        "throughput_batch_size": cfg.throughput_batch_size,
        "sampling_seconds": sampling_seconds,
        "cell_seconds": time.perf_counter() - start,
    }


def _length(config: SweepConfig, model: Any, name: str) -> int:
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    length = config.length if config.length is not None else max_len
    if length is None or (max_len is not None and length > max_len) or length < 3:
        raise ValueError(f"length {length} does not fit model {name!r} (3..{max_len})")
    return int(length)


def _timing_cell(config: SweepConfig, cell: tuple[str, int, int], model: Any, tokenizer: Any) -> TimingCell:
    name, T, K = cell
    length = _length(config, model, name)
    sampler_name = resolve_sampler(config.sampler, T, length)
    return TimingCell(key=cell, model=model, seq_len=length, num_steps=T, policy=K,
                      make_sampler=lambda: get_sampler(sampler_name, model.mask_token_id,
                                                       **sampler_options(sampler_name, config.sampler_settings())))


def _reference(cfg: SweepConfig, tokenizer: Any, length: int, log: Callable[[str], None]) -> tuple[list[str], torch.Tensor]:
    """Held-out reference texts and their (n, L) blocks.

    Each reference is a whole packed block decoded like a sample, end-of-text framing included: the
    models learn the framing of the blocks they are trained on (an end-of-text id at the first and last
    position), so stripping it from the references alone would make every sample differ from every
    reference in its last token, which is where MAUVE takes its features.
    """
    from tadm.eval.likelihood import packed_eval_blocks

    assert cfg.reference is not None
    blocks = packed_eval_blocks(cfg.reference, tokenizer, length, cache_dir=cfg.cache_dir, split=cfg.reference_split,
                                val_fraction=cfg.reference_val_fraction, seed=0)
    wanted = cfg.num_reference or cfg.num_samples
    n = min(wanted, len(blocks))
    if n < wanted:
        log(f"note: {cfg.reference!r} ({cfg.reference_split}) has only {n} blocks of {length} tokens; "
            f"MAUVE uses {n} reference texts instead of {wanted}")
    ids = blocks.get_batch(range(n))  # (n, L)
    return decode_samples(ids, tokenizer), ids


def _baseline_layers(cfg: SweepConfig, models: dict[str, Any]) -> int:
    if cfg.baseline_layers is not None:
        return cfg.baseline_layers
    for model in models.values():
        split = model.layer_split
        if split.anchor == 0:  # an uncached single-stage DLM (MDLM)
            return split.total
    return PAPER_BASELINE_LAYERS


def _resolved_settings(cfg: SweepConfig, evaluator: Evaluator | None, baseline: int | None,
                       previous: dict[str, Any] | None) -> dict[str, Any]:
    settings = asdict(cfg)
    settings["seeds"] = {
        "sampling": cfg.seed,
        "throughput": f"{cfg.seed} + generation index",
        "mauve_kmeans": MAUVE_SEED,
        "reference_split": 0,
    }
    if evaluator is not None:
        settings["evaluator_info"] = evaluator.describe()
    elif previous is not None and "evaluator_info" in previous:
        settings["evaluator_info"] = previous["evaluator_info"]
    if baseline is not None:
        settings["resolved_baseline_layers"] = baseline
    elif previous is not None and "resolved_baseline_layers" in previous:
        settings["resolved_baseline_layers"] = previous["resolved_baseline_layers"]
    return settings


def _check_resumable(cfg: SweepConfig, previous: dict[str, Any], out: Path) -> None:
    mine = cfg.identity()
    diffs = [k for k, v in mine.items() if previous.get(k) != v]
    if diffs:
        shown = "; ".join(f"{k}: {previous.get(k)!r} there, {mine[k]!r} now" for k in diffs[:3])
        raise ValueError(
            f"{out} holds a sweep with other settings ({shown}); use another output directory or overwrite=True"
        )


def _write_outputs(cfg: SweepConfig, rows: list[dict[str, Any]], out: Path, settings: dict[str, Any]) -> dict[str, Path]:
    from tadm.eval.plots import write_plots

    json_path, csv_path = write_results(out, settings, rows, machine_info())
    notes = [
        f"Evaluator: {settings.get('evaluator_info', {}).get('name', cfg.evaluator)}; "
        f"{cfg.num_samples} samples of {rows[0]['length'] if rows else cfg.length} tokens per cell; "
        f"sampler {cfg.sampler}, top-p {cfg.top_p}; seed {cfg.seed}.",
        f"Compute: Transformer-layer calls of one generation (Eq. anchor-cache-compute), "
        f"relative to a {settings.get('resolved_baseline_layers', PAPER_BASELINE_LAYERS)}-layer MDLM.",
        f"Throughput: median tokens/s [slowest-fastest] of {cfg.throughput_generations} timed generations of batch "
        f"{cfg.throughput_batch_size} after {cfg.throughput_warmup} warm-up, all cells interleaved in shuffled "
        f"rounds, all positions counted, {cfg.dtype} on {cfg.device}.",
        f"MAUVE: [n = samples, clusters]; not computed for fewer than {cfg.mauve_min_samples} texts per side.",
    ]
    table = out / "table.md"
    table.write_text(markdown_report(rows, throughput_baseline=cfg.throughput_baseline, notes=notes))
    png_tps, png_k = write_plots(rows, out)
    return {"json": json_path, "csv": csv_path, "table": table, "plot_throughput": png_tps, "plot_refresh": png_k}


def run_sweep(
    config: SweepConfig,
    *,
    evaluator: Evaluator | None = None,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> SweepOutput:
    """Run (or resume) the sweep of ``config``; see the module docstring.

    ``evaluator`` may be passed pre-loaded; otherwise ``config.evaluator`` is loaded once, and only
    if some cell still has to run. Interrupting (Ctrl-C) keeps every finished cell in
    ``results.json``; running again resumes. ``overwrite`` discards earlier results.
    """
    out = Path(config.out_dir)
    previous = None if overwrite else read_results(out)
    rows: list[dict[str, Any]] = []
    prev_settings: dict[str, Any] | None = None
    if previous is not None:
        prev_settings, rows = previous
        _check_resumable(config, prev_settings, out)
    done = {cell_key(r) for r in rows}
    cells = [(name, T, K) for name in config.models for T in config.steps for K in config.refresh]
    todo = [c for c in cells if c not in done]
    need_data = config.reference is not None and (DATA_MODEL, None, None) not in done
    if previous is not None and len(todo) < len(cells):
        log(f"resuming {out}: {len(cells) - len(todo)} of {len(cells)} cells already done")
    evaluated: list[tuple[str, int, int]] = []
    baseline: int | None = None
    untimed = [] if config.throughput_generations == 0 else [
        c for c in cells if c not in done or next(r for r in rows if cell_key(r) == c).get("tokens_per_second") is None
    ]
    loaded: dict[str, tuple[Any, Any]] = {}

    def load(names: set[str]) -> None:
        for name in config.models:
            if name in names and name not in loaded:
                model, tok = load_model_and_tokenizer(config.models[name], config.tokenizer, config.device)
                _length(config, model, name)
                if getattr(model, "mask_token_id", None) is None:
                    raise ValueError(f"model {name!r} has no mask token: a sweep needs masked diffusion models")
                loaded[name] = (model, tok)

    settings = _resolved_settings(config, None, None, prev_settings)
    if todo and config.reference is not None and config.num_samples < config.mauve_min_samples:
        log(f"note: MAUVE is not computed: {config.num_samples} samples per cell < the minimum of "
            f"{config.mauve_min_samples} (raise --samples, or lower --mauve-min-samples knowingly)")
    if todo or need_data:
        if evaluator is None:
            log(f"loading evaluator {config.evaluator or 'default'} ...")
            evaluator = load_evaluator(config.evaluator, device=config.device)
        load({c[0] for c in todo} | (set(config.models) if need_data else set()))
        baseline = _baseline_layers(config, {n: m for n, (m, _) in loaded.items()})
        if prev_settings is not None and "resolved_baseline_layers" in prev_settings:
            baseline = int(prev_settings["resolved_baseline_layers"])
        settings = _resolved_settings(config, evaluator, baseline, prev_settings)
        ref_cache: dict[str, Any] = {}
        bar = tqdm(total=len(todo), desc="sweep", disable=not progress)
        try:
            for name, (model, tok) in loaded.items():
                length = _length(config, model, name)
                features = None
                if config.reference is not None:
                    key = tok.fingerprint() + f":{length}"
                    if key not in ref_cache:
                        ref_texts, ref_ids = _reference(config, tok, length, log)
                        ref_cache[key] = text_features(ref_texts, evaluator, batch_size=config.eval_batch_size,
                                                       progress=progress)
                        if need_data:
                            ppl = gen_ppl(ref_texts, evaluator, batch_size=config.eval_batch_size, progress=progress)
                            rows.append({"model": DATA_MODEL, "path": config.reference, "steps": None, "refresh": None,
                                         "length": length, "num_samples": len(ref_texts), "gen_ppl": ppl.gen_ppl,
                                         "gen_ppl_nll": ppl.nll, "gen_ppl_tokens": ppl.num_tokens,
                                         "entropy": mean_entropy(ref_ids), "mauve": None})
                            need_data = False
                            write_results(out, settings, rows, machine_info())
                    features = ref_cache[key]
                ctx = CellContext(config=config, name=name, path=config.models[name], model=model, tokenizer=tok,
                                  evaluator=evaluator, length=length, baseline_layers=baseline,
                                  reference_features=features, progress=progress)
                for cell in [c for c in todo if c[0] == name]:
                    bar.set_postfix_str(f"{name} T={cell[1]} K={cell[2]}")
                    rows.append(evaluate_cell(ctx, cell[1], cell[2]))
                    evaluated.append(cell)
                    write_results(out, settings, rows, machine_info())
                    bar.update(1)
        finally:
            bar.close()
    if untimed:
        load({c[0] for c in untimed})
        log(f"timing {len(untimed)} cells, interleaved: {config.throughput_warmup} warm-up + "
            f"{config.throughput_generations} timed generations each")
        timings = interleaved_throughput(
            [_timing_cell(config, c, *loaded[c[0]]) for c in untimed],
            num_generations=config.throughput_generations, warmup=config.throughput_warmup,
            batch_size=config.throughput_batch_size, dtype=config.dtype, device=config.device, seed=config.seed,
            progress=progress)
        for r in rows:
            timing = timings.get(cell_key(r))
            if timing is not None:
                r.update(tokens_per_second=timing.tokens_per_second, tokens_per_second_min=timing.tokens_per_second_min,
                         tokens_per_second_max=timing.tokens_per_second_max)
        write_results(out, settings, rows, machine_info())
    order = {c: i for i, c in enumerate(cells)}
    rows.sort(key=lambda r: (-1,) if r["model"] == DATA_MODEL else (order.get(cell_key(r), math.inf),))
    files = _write_outputs(config, rows, out, settings)
    return SweepOutput(rows=rows, files=files, evaluated=evaluated)
