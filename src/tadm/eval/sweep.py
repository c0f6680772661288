"""Evaluation sweeps over models, sampling budgets T and refresh policies K (paper Tables 2 and 4).

``tadm eval sweep`` is a thin front over :mod:`tadm.eval.pipeline`, the stages a study runs too: for
every cell (model, T, K) it samples, scores (Gen PPL and MAUVE under one evaluator, from one pass
over the samples; unigram entropy) and times (all cells interleaved in shuffled rounds), each cell a
resumable unit in ``out_dir``; a sweep started again skips the finished units and may add T or K
values. Then ``results.json`` / ``results.csv`` (one row per cell, plus the reference text's row),
``table.md`` (:func:`tadm.eval.report.markdown_report`) and the plots are rebuilt from the units.

A folder written by the sweep of earlier tadm versions (rows in ``results.json``, no units) stays
readable by :func:`tadm.eval.report.read_results`; a new sweep into it is refused with a one-line
error naming the new layout.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


from tadm.eval.evaluator import Evaluator, check_evaluator
from tadm.eval.likelihood import packed_eval_blocks
from tadm.eval.pipeline import (MAUVE_SEED, REFERENCE_SEED, Cell, PipelineStore, Run, SamplingSettings, cell_rows,
                                check_scoring_dependencies, data_row, draw_reference, resolve_device, sample_cells,
                                score_cells, throughput_note, time_cells, timing_warmup)
from tadm.eval.plots import PLOTS_SKIPPED, can_plot, write_plots
from tadm.eval.report import DATA_MODEL, markdown_report, write_results
from tadm.records import check_publishable, machine_info, provenance_note, read_json
from tadm.specs import load_model_and_tokenizer

__all__ = ["PAPER_BASELINE_LAYERS", "SweepConfig", "SweepOutput", "parse_model_specs",
           "run_sweep"]

PAPER_BASELINE_LAYERS = 12  # the paper normalises compute to the 12-layer MDLM
REFERENCE_VAL_FRACTION = 0.02  # the default held-out share of the reference, which every earlier unit used


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


@dataclass
class SweepConfig:
    """A sweep: named models (checkpoint directory, Hub id or builder name) and the shared sampling settings.

    ``sampling`` holds T, the refresh specs, sample counts, the nested sampler section, the evaluator
    (``sampling.evaluators``, one name), MAUVE, throughput, device and dtype. The reference text
    (``sampling.reference``, any :func:`~tadm.training.data.load_texts` source; ``reference_split``
    "val" holds out ``reference_val_fraction`` of its documents) is packed with each model's tokenizer.
    ``baseline_layers`` normalises compute (default: the first MDLM-like model, else 12 as in the
    paper); ``throughput_baseline`` names the model whose K = 1 row normalises tok/s.
    """

    models: dict[str, str]
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    length: int | None = None
    tokenizer: str | None = None
    reference_val_fraction: float = REFERENCE_VAL_FRACTION
    num_reference: int | None = None
    baseline_layers: int | None = None
    throughput_baseline: str | None = None
    cache_dir: str = ".tadm-cache"
    out_dir: str = "tadm-sweep"

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("SweepConfig.models is empty: pass at least one NAME=PATH")
        self.sampling.validate("sweep")
        if len(self.sampling.evaluators) != 1:
            raise ValueError(f"a sweep scores with one evaluator, got {self.sampling.evaluators}")
        self.sampling.steps = sorted(set(self.sampling.steps))
        if self.throughput_baseline is not None and self.throughput_baseline not in self.models:
            raise ValueError(f"throughput baseline {self.throughput_baseline!r} is not one of the sweep's models "
                             f"({', '.join(self.models)})")

    def reference_spec(self) -> dict[str, Any]:
        """What the held-out reference depends on besides ``sampling``, as the data and score units record it:
        ``num_reference`` when it is set to another count than ``num_samples``, and ``reference_val_fraction``
        when the reference is a held-out split of another share than the default. Each is left out at the
        value every unit written before it was recorded was made with, so that those units are still reused."""
        s, spec = self.sampling, {}
        if self.num_reference is not None and self.num_reference != s.num_samples:
            spec["num_reference"] = self.num_reference
        if s.reference_split == "val" and self.reference_val_fraction != REFERENCE_VAL_FRACTION:
            spec["reference_val_fraction"] = self.reference_val_fraction
        return spec

    def cells(self, name: str) -> list[Cell]:
        return [Cell(label=name, model_path=self.models[name], steps=T, policy=policy)
                for T in self.sampling.steps for policy in self.sampling.policies()]


@dataclass
class SweepOutput:
    """Rows of every finished cell and the files written; ``evaluated`` are the units run in this call."""

    rows: list[dict[str, Any]]
    files: dict[str, Path]
    evaluated: list[str] = field(default_factory=list)


def _length(config: SweepConfig, model: Any, name: str) -> int:
    max_len = model.max_seq_len
    length = config.length if config.length is not None else max_len
    if length is None or length > max_len or length < 3:
        raise ValueError(f"length {length} does not fit model {name!r} (3..{max_len})")
    return int(length)


def _check_layout(out: Path) -> None:
    stored = read_json(out / "results.json")
    if isinstance(stored, dict) and stored.get("rows") and not (out / "samples").is_dir():
        raise ValueError(f"{out} holds a sweep of the earlier layout (rows in results.json, no samples/ units); its "
                         f"results stay readable (tadm.eval.report.read_results): sweep into a new --out")


class _Models:
    """Each model and tokenizer loaded once, when a stage first needs it."""

    def __init__(self, config: SweepConfig) -> None:
        self.config, self.loaded = config, {}

    def get(self, name: str) -> tuple[Any, Any]:
        if name not in self.loaded:
            spec = self.config.models[name]
            model, tokenizer = load_model_and_tokenizer(spec, self.config.tokenizer,
                                                        resolve_device(self.config.sampling.device))
            if model.mask_token_id is None:
                raise ValueError(f"model {spec!r} has no mask token: a sweep needs masked diffusion models")
            self.loaded[name] = model, tokenizer
        return self.loaded[name]


def _reference(config: SweepConfig, tokenizer: Any, length: int, log: Callable[[str], None]) -> tuple[list[str], Any]:
    """Held-out texts and their (n, L) ids: n whole packed blocks drawn at random (:func:`draw_reference`)."""
    s = config.sampling
    blocks = packed_eval_blocks(s.reference, tokenizer, length, cache_dir=config.cache_dir, split=s.reference_split,
                                val_fraction=config.reference_val_fraction, seed=0)
    wanted = config.num_reference or s.num_samples
    n = min(wanted, len(blocks))
    if n < wanted:
        log(f"note: {s.reference!r} ({s.reference_split}) has only {n} blocks of {length} tokens; "
            f"MAUVE uses {n} reference texts instead of {wanted}")
    return draw_reference(blocks, n, tokenizer)


def _baseline_layers(config: SweepConfig, models: _Models) -> int:
    if config.baseline_layers is not None:
        return config.baseline_layers
    for name in config.models:
        split = models.get(name)[0].layer_split
        if split.anchor == 0:  # an uncached single-stage DLM (MDLM)
            return split.total
    return PAPER_BASELINE_LAYERS


def _notes(config: SweepConfig, rows: list[dict[str, Any]], baseline: int, warmup: int | None) -> list[str]:
    s = config.sampling
    notes = [
        f"Evaluator: {s.evaluators[0]}; {s.num_samples} samples of {rows[0]['length'] if rows else config.length} "
        f"tokens per cell; sampler {s.sampler.name}, top-p {s.sampler.top_p}; seed {s.seed}.",
        f"Compute: Transformer-layer calls of one generation (Eq. anchor-cache-compute), relative to a "
        f"{baseline}-layer MDLM.",
        throughput_note(rows, warmup) + (f", all positions counted, {s.dtype} on {s.device}."
                                          if any(r.get("tokens_per_second") is not None for r in rows) else ""),
        f"MAUVE: [n = samples, clusters], k-means seed {MAUVE_SEED}; not computed for fewer than "
        f"{s.mauve_min_samples} texts per side; the reference is held-out blocks drawn at random (seed "
        f"{REFERENCE_SEED}).",
    ]
    note = provenance_note(rows)
    return notes + ([note] if note else [])


def run_sweep(config: SweepConfig, *, evaluator: Evaluator | None = None, overwrite: bool = False,
              progress: bool = True, log: Callable[[str], None] = print, allow_dirty: bool = False) -> SweepOutput:
    """Run (or resume) the sweep of ``config`` through the pipeline's stages; see the module docstring.

    ``evaluator`` may be passed pre-loaded (else ``sampling.evaluators[0]`` is loaded once, only if a
    unit needs it). Interrupting keeps every finished unit; running again resumes; ``overwrite``
    discards them first. Writing the tables from a source tree with local changes needs ``allow_dirty``
    (they then say so).
    """
    check_publishable(allow_dirty)
    out = Path(config.out_dir)
    if overwrite:
        for name in ("samples", "scores"):
            shutil.rmtree(out / name, ignore_errors=True)
        for name in ("throughput.json", "results.json", "results.csv", "table.md"):
            (out / name).unlink(missing_ok=True)
    _check_layout(out)
    name_of_evaluator = config.sampling.evaluators[0]
    if evaluator is None:
        check_evaluator(name_of_evaluator)  # before the first sample, not after
    check_scoring_dependencies(config.sampling)
    store, models = PipelineStore(out), _Models(config)
    load = (lambda _: evaluator) if evaluator is not None else None
    ran: list[str] = []
    runs: dict[str, Run] = {}
    for name in config.models:
        model, tok = models.get(name)
        length = _length(config, model, name)
        run = Run(store, config.sampling, length, model_of=lambda cell: models.get(cell.label)[0], log=log,
                  progress=progress)
        runs[name] = run
        sample_cells(run, config.cells(name))
        score_cells(run, config.cells(name), tokenizer=tok, evaluator_spec=lambda ev: ev, load=load,
                    reference=(lambda tok=tok, length=length: _reference(config, tok, length, log))
                    if config.sampling.reference is not None else None, reference_spec=config.reference_spec())
        ran += run.ran
    all_cells = [cell for name in config.models for cell in config.cells(name)]
    first = runs[next(iter(config.models))]
    timing = Run(store, config.sampling, first.length, model_of=lambda cell: models.get(cell.label)[0], log=log,
                 progress=progress, length_of=lambda cell: runs[cell.label].length)
    time_cells(timing, all_cells)
    ran += timing.ran
    baseline = _baseline_layers(config, models)
    rows = [r for name, run in runs.items() for r in cell_rows(run, config.cells(name), name_of_evaluator,
                                                                split_of=lambda cell: models.get(cell.label)[0].layer_split,
                                                                baseline_layers=baseline)]
    data = data_row(first, name_of_evaluator)
    rows = ([data] if data is not None else []) + rows
    settings = {**asdict(config), "resolved_baseline_layers": baseline}
    json_path, csv_path = write_results(out, settings, rows, machine_info())
    table = out / "table.md"
    table.write_text(markdown_report(rows, throughput_baseline=config.throughput_baseline,
                                     notes=_notes(config, rows, baseline, timing_warmup(store))))
    files = {"json": json_path, "csv": csv_path, "table": table}
    if can_plot():
        files["plot_throughput"], files["plot_refresh"] = write_plots(rows, out)
    else:
        warnings.warn(PLOTS_SKIPPED, stacklevel=2)
    return SweepOutput(rows=rows, files=files, evaluated=ran)
