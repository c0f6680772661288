"""The one experiment pipeline: sampling cells generated, scored and timed, each a resumable unit.

A sweep (``tadm eval sweep``) and a study (``tadm study``) are lists of :class:`Cell` (a model, a
step budget T and a refresh policy) fed through the same stages, each stage writing one
spec-keyed unit per cell into a :class:`PipelineStore` (a :class:`~tadm.records.UnitStore`) and
skipping the cells already done:

1. :func:`sample_cells`: ``num_samples`` unconditional samples with anchor-cache inference
   (Algorithm 1), their token ids and the layer calls counted (``samples/…/T*-K*.json``);
2. :func:`score_cells`: per evaluator, Gen PPL with the MAUVE features of the same forward passes
   (one pass over the samples), MAUVE against the held-out reference (blocks drawn at random by
   :func:`draw_reference`), and the unigram entropy; the reference text's own row
   (``scores/EVALUATOR/…``);
3. :func:`time_cells`: tokens/s of every cell (tokens over the median generation time), timed together in shuffled interleaved rounds
   (``throughput.json``);
4. :func:`cell_rows`: one row per (cell, evaluator) merging the three with the analytic compute.

Settings every stage reads are one :class:`SamplingSettings`, with its sampler in a nested
:class:`SamplerSection` and its refresh entries in the one refresh currency
(:func:`tadm.sampling.refresh.parse_refresh`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePath
from typing import Any

import torch

from tadm.diffusion import DEFAULT_SCHEDULE
from tadm.eval.compute import policy_layer_calls
from tadm.eval.entropy import mean_entropy
from tadm.eval.evaluator import load_evaluator
from tadm.eval.gen_ppl import decode_samples, gen_ppl
from tadm.eval.mauve import (MAUVE_MIN_SAMPLES, MAUVE_MISSING, mauve_from_features, mauve_installed,
                             mauve_sample_problem)
from tadm.devices import resolve_device, resolve_dtype
from tadm.eval.throughput import DTYPES, MIN_TIMED_GENERATIONS, TimingCell, interleaved_throughput
from tadm.records import UnitStore, same_spec
from tadm.sampling import generate
from tadm.sampling.base import TIME_GRIDS
from tadm.sampling.categorical import NUCLEUS_RULES
from tadm.sampling.refresh import RefreshPolicy, parse_refresh, parse_refresh_list
from tadm.sampling.registry import SAMPLERS, build_sampler, sampler_config, sampler_options

__all__ = ["MAUVE_SEED", "REFERENCE_SEED", "Cell", "PipelineStore", "SamplerSection", "SamplingSettings", "cell_rows",
           "draw_reference", "sample_cells", "score_cells", "throughput_note", "time_cells", "timing_warmup"]

MAUVE_SEED = 25  # mauve-text's default k-means seed
MAUVE_DEFAULT_BUCKETS = "auto"  # what every score unit was made with before the count was recorded
REFERENCE_SEED = 0  # seeds the permutation of the held-out blocks that the reference is drawn from
# Recorded in data and score units since the reference is drawn at random; units without it used the first blocks.
REFERENCE_ORDER = {"reference_order": "random"}
Log = Callable[[str], None]
PathForm = Callable[[str], str]  # how a unit spec writes a model or evaluator path


# ========================================================================================= settings
@dataclass
class SamplerSection:
    """The nested ``sampler:`` section: a registry name (``auto``: the paper's rule, ReMDM-cap for T < L and
    ReMDM-loop for T >= L) and its options (unset ones keep the sampler's defaults)."""

    name: str = "auto"
    top_p: float | None = 0.9
    eta: float | None = None
    schedule: str | None = None
    nucleus: str = "released"
    time_grid: str = "paper"

    def resolve(self, num_steps: int, length: int) -> str:
        if self.name == "auto":
            return "remdm-cap" if num_steps < length else "remdm-loop"
        return self.name

    def options(self, name: str) -> dict[str, Any]:
        return sampler_options(name, {k: v for k, v in asdict(self).items() if k != "name"})

    def build(self, model: Any, num_steps: int, length: int) -> tuple[str, Any]:
        """(resolved name, sampler) for ``model`` at T = ``num_steps`` and canvas ``length``."""
        name = self.resolve(num_steps, length)
        return name, build_sampler(name, model, **self.options(name))

    def spec(self) -> dict[str, Any]:
        """The settings a sample unit depends on (the keys units have always recorded: listed, so that a new
        field does not change the spec of every finished unit). The noise schedule is recorded when it is not
        the default log-linear one, which every earlier unit used."""
        spec = {"sampler": self.name, "top_p": self.top_p, "eta": self.eta, "nucleus": self.nucleus,
                "time_grid": self.time_grid}
        return spec | ({"schedule": self.schedule} if self.schedule not in (None, DEFAULT_SCHEDULE) else {})

    def validate(self, where: str) -> None:
        masked = sorted(n for n, e in SAMPLERS.items() if e.needs == "mask_id" and e.sampler_class.consumes == "log_probs")
        for key, valid in (("name", ["auto", *masked]), ("nucleus", NUCLEUS_RULES), ("time_grid", TIME_GRIDS)):
            if getattr(self, key) not in valid:
                raise ValueError(f"{where}.{key} {getattr(self, key)!r} is unknown; valid: {', '.join(valid)}")
        if self.time_grid == "released" and self.schedule not in (None, DEFAULT_SCHEDULE):
            raise ValueError(f"{where}.schedule {self.schedule!r} has no effect with time_grid 'released' (its "
                             "alpha is 1 - t)")
        for name in ("remdm-cap", "remdm-loop") if self.name == "auto" else (self.name,):
            try:
                sampler_config(name, **self.options(name))
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None


@dataclass
class SamplingSettings:
    """How cells are sampled, scored and timed; shared by sweeps and studies, validated in one place."""

    steps: list[int] = field(default_factory=lambda: [32, 128])
    refresh: list[Any] = field(default_factory=lambda: [1, 2, 4, 8])  # refresh specs: 4, "adaptive:tau=0.3", ...
    num_samples: int = 64
    batch_size: int = 32
    seed: int = 0
    sampler: SamplerSection = field(default_factory=SamplerSection)
    evaluators: list[str] = field(default_factory=lambda: ["smollm2-135m"])
    eval_batch_size: int = 16
    reference: str | None = "brown"  # held-out text for MAUVE and the data row (None: neither)
    reference_split: str = "val"
    mauve: bool = True
    mauve_min_samples: int = MAUVE_MIN_SAMPLES  # fewer samples or reference texts per side: no MAUVE
    mauve_num_buckets: Any = MAUVE_DEFAULT_BUCKETS
    throughput_generations: int = 5  # 0: not timed
    throughput_warmup: int = 1
    throughput_batch_size: int = 1
    device: str = "auto"
    dtype: str = "float32"

    def policies(self) -> list[RefreshPolicy]:
        return parse_refresh_list(list(self.refresh))

    def validate(self, where: str = "sampling") -> None:
        """A ValueError naming ``where.key`` for the first bad value."""
        _ints(f"{where}.steps", self.steps, 1)
        specs = list(self.refresh) if isinstance(self.refresh, (list, tuple)) else [self.refresh]
        for i, spec in enumerate(specs):
            try:
                parse_refresh(spec)
            except ValueError as err:
                raise ValueError(f"{where}.refresh[{i}]: {err}") from None
        try:
            policies = self.policies()
            for policy, steps in ((p, t) for p in policies for t in self.steps):
                policy.check_steps(steps)
        except ValueError as err:
            raise ValueError(f"{where}.refresh: {err}") from None
        if "1" not in [p.key for p in policies]:
            raise ValueError(f"{where}.refresh must include K = 1 (the reference of every comparison), got "
                             f"{[p.key for p in policies]}")
        for name in ("num_samples", "batch_size", "eval_batch_size", "throughput_batch_size", "mauve_min_samples"):
            _ints(f"{where}.{name}", [getattr(self, name)], 1)
        _ints(f"{where}.seed", [self.seed], 0)
        if self.throughput_generations < 0 or self.throughput_warmup < 0:
            raise ValueError(f"{where}.throughput_generations and {where}.throughput_warmup must be >= 0")
        if 0 < self.throughput_generations < MIN_TIMED_GENERATIONS:
            raise ValueError(f"{where}.throughput_generations must be 0 (skip) or >= {MIN_TIMED_GENERATIONS} for a "
                             f"median, got {self.throughput_generations}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{where}.dtype {self.dtype!r} is unknown; valid: {', '.join(DTYPES)}")
        if self.reference_split not in ("val", "all"):
            raise ValueError(f"{where}.reference_split must be 'val' or 'all', got {self.reference_split!r}")
        if not self.evaluators:
            raise ValueError(f"{where}.evaluators is empty: name at least one evaluator")
        self.sampler.validate(f"{where}.sampler")


def _ints(name: str, values: Sequence[Any], minimum: int) -> None:
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        raise ValueError(f"{name} must be a non-empty list of integers >= {minimum}, got {list(values)!r}")


# ============================================================================================ cells
@dataclass(frozen=True)
class Cell:
    """One sampling configuration: a model (by its label in files and tables), T and a refresh policy."""

    label: str  # e.g. "tadm", "tadm-naive"
    model_path: str  # what the model is loaded from (in unit specs as PipelineStore.recorded writes it)
    steps: int
    policy: RefreshPolicy
    seed: int | None = None  # training seed of a study's model; None for a sweep's
    naive: bool = False

    @property
    def refresh(self) -> int | str:
        """The policy's key as units and rows record it (an int for fixed K)."""
        return self.policy.record

    @property
    def key(self) -> tuple[str, int | None, int, int | str]:
        return (self.label, self.seed, self.steps, self.refresh)

    @property
    def stem(self) -> str:
        return self.label if self.seed is None else f"{self.label}-s{self.seed}"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_") or "x"


def _as_given(path: str) -> str:
    return path


def _strings(value: Any) -> set[str]:
    """Every string in a JSON-like ``value``."""
    if isinstance(value, dict):
        return set().union(*map(_strings, value.values()))
    if isinstance(value, (list, tuple)):
        return set().union(*map(_strings, value))
    return {value} if isinstance(value, str) else set()


def _relocated(value: Any, tails: set[str]) -> Any:
    """``value`` with each string that ends in ``/TAIL`` (for a TAIL of ``tails``) written as TAIL."""
    if isinstance(value, dict):
        return {key: _relocated(item, tails) for key, item in value.items()}
    if isinstance(value, list):
        return [_relocated(item, tails) for item in value]
    if isinstance(value, str):
        return next((tail for tail in tails if value.endswith("/" + tail)), value)
    return value


class PipelineStore(UnitStore):
    """Where each stage's units live: ``samples/``, ``scores/EVALUATOR/`` and ``throughput.json``.

    Each ``*_path`` is relative to the store's root, as :meth:`~tadm.records.UnitStore.load`, ``save`` and
    ``done`` take it. With ``relative_paths`` (a study's store, whose models live under its root), the unit
    specs write a model or evaluator path inside the root relative to it, so that the same store named by
    another path (absolute or relative, from another working directory) or moved keeps its finished units.
    A sweep's store writes the paths as given: its models are the user's, outside it.
    """

    def __init__(self, root: str | os.PathLike[str], *, relative_paths: bool = False) -> None:
        super().__init__(root)
        self.relative_paths = relative_paths

    def recorded(self, path: str) -> str:
        """``path`` as new unit specs write it (see the class docstring)."""
        if self.relative_paths:
            try:
                return PurePath(path).relative_to(self.root).as_posix()
            except ValueError:  # outside the root (an evaluator name, a model elsewhere): as given
                pass
        return path

    @property
    def forms(self) -> list[PathForm]:
        """The ways a unit's spec may write its paths and still be this unit: as new units record them, then
        (for relative paths) as given, as units written before paths were recorded relative hold them at the
        same location."""
        return [self.recorded, _as_given] if self.relative_paths else [_as_given]

    def holds(self, payload: Any, specs: Sequence[Any]) -> bool:
        """Whether a unit record ``payload`` holds one of ``specs`` (the same spec in each of :attr:`forms`).

        With ``relative_paths``, a record written before paths were recorded relative counts too, wherever the
        store was then: each of its paths that ends in one of the relative paths of ``specs[0]`` (its strings
        that name something under the root, such as ``models/tadm-s0/final``) is read as that path.
        """
        if any(same_spec(payload, spec) for spec in specs):
            return True
        if not (self.relative_paths and specs and isinstance(payload, dict)):
            return False
        tails = {text for text in _strings(specs[0])
                 if "/" in text and not PurePath(text).is_absolute() and (self.root / text).exists()}
        return bool(tails) and same_spec({"spec": _relocated(payload.get("spec"), tails)}, specs[0])

    def done_as_any(self, relative: str | os.PathLike[str], specs: Sequence[Any]) -> bool:
        """Whether the unit at ``relative`` holds one of ``specs`` (:meth:`holds`)."""
        return self.holds(self.load(relative), specs)

    def sample_path(self, cell: Cell) -> Path:
        return Path("samples") / cell.stem / f"T{cell.steps}-K{cell.refresh}.json"

    def score_path(self, evaluator: str, cell: Cell | None) -> Path:
        base = Path("scores") / _slug(evaluator)
        return base / ("data.json" if cell is None else f"{cell.stem}-T{cell.steps}-K{cell.refresh}.json")

    @property
    def throughput_path(self) -> Path:
        return Path("throughput.json")


def sample_spec(cell: Cell, settings: SamplingSettings, length: int,
                form: PathForm = _as_given) -> dict[str, Any]:
    """What a sample unit depends on, its model path written by ``form`` (a :attr:`PipelineStore.forms`)."""
    return {"model": form(cell.model_path), "naive": cell.naive, "steps": cell.steps, "refresh": cell.refresh,
            "length": length, "num_samples": settings.num_samples, "batch_size": settings.batch_size,
            "seed": settings.seed, **settings.sampler.spec(), "dtype": settings.dtype}


@dataclass
class Run:
    """What every stage needs besides the cells: the store, settings, canvas length and how to get models."""

    store: PipelineStore
    settings: SamplingSettings
    length: int
    model_of: Callable[[Cell], Any]
    log: Log = print
    progress: bool = False
    length_of: Callable[[Cell], int] | None = None  # per-cell canvas length (models of a sweep may differ)
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return resolve_device(self.settings.device)

    def done(self, unit: str, seconds: float) -> None:
        self.ran.append(unit)
        self.log(f"{unit}: done in {seconds:.1f}s")


# =========================================================================================== stages
def _unit(cell: Cell) -> str:
    return f"{cell.label}{'' if cell.seed is None else f' seed {cell.seed}'} T={cell.steps} K={cell.refresh}"


def sample_cells(run: Run, cells: Sequence[Cell]) -> None:
    """Stage 1: the samples of every cell not yet sampled with the same spec."""
    s = run.settings
    amp = resolve_dtype(s.dtype)
    device = run.device
    for cell in cells:
        specs = [sample_spec(cell, s, run.length, form) for form in run.store.forms]
        path = run.store.sample_path(cell)
        if run.store.done_as_any(path, specs):
            run.skipped.append(f"sample {_unit(cell)}")
            continue
        model = run.model_of(cell)
        sampler_name, sampler = s.sampler.build(model, cell.steps, run.length)
        generator = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(s.seed)
        start, rows, calls = time.perf_counter(), [], None
        for lo in range(0, s.num_samples, s.batch_size):
            with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
                out = generate(model, sampler, batch_size=min(s.batch_size, s.num_samples - lo), seq_len=run.length,
                               num_steps=cell.steps, policy=cell.policy, generator=generator, device=device)
            rows.extend(out.tokens.cpu().tolist())
            calls = out.layer_calls.as_dict()
        seconds = time.perf_counter() - start
        run.store.save(path, specs[0], {"sampler": sampler_name, "token_ids": rows,
                                        "layer_calls_last_batch": calls, "seconds": seconds})
        run.done(f"sample {_unit(cell)}", seconds)


def draw_reference(blocks: Any, count: int, tokenizer: Any, *, seed: int = REFERENCE_SEED) -> tuple[list[str], Any]:
    """The held-out reference of MAUVE and the Data row: ``count`` blocks (at most all of them) drawn at random
    without replacement, the first ``count`` of a permutation of every held-out block seeded with ``seed``; their
    texts, decoded like samples (whole blocks, end-of-text framing included: the models learn the framing of the
    blocks they train on, and MAUVE reads the last token), and their ids (count, L).

    ReMDM draws its MAUVE references from the validation loader shuffled by a seeded generator; the first blocks
    would instead be a few documents of the held-out split in corpus order (with Brown, two or three genres). The
    permutation depends only on the number of blocks, so the models of a sweep that share a tokenizer and length,
    and a study run again, get the same reference.
    """
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))[:count]
    ids = blocks.get_batch(order.tolist())  # (count, L)
    return decode_samples(ids, tokenizer), ids


def _mauve(settings: SamplingSettings, reference: Any, features: Any, num_samples: int) -> dict[str, Any]:
    record: dict[str, Any] = {"mauve": None, "mauve_num_samples": None, "mauve_num_reference": None,
                              "mauve_buckets": None, "mauve_note": None}
    if reference is None or features is None:
        return record
    record.update(mauve_num_samples=num_samples, mauve_num_reference=len(reference))
    problem = mauve_sample_problem(num_samples, len(reference), settings.mauve_min_samples)
    if problem is not None:
        record["mauve_note"] = problem
        return record
    result = mauve_from_features(reference, features, num_buckets=settings.mauve_num_buckets, seed=MAUVE_SEED,
                                 min_samples=settings.mauve_min_samples)
    record.update(mauve=result.mauve, mauve_buckets=result.num_buckets)
    return record


def check_scoring_dependencies(settings: SamplingSettings) -> None:
    """An ImportError before any unit runs, rather than at the first score, when MAUVE is to be computed and
    mauve-text is not installed."""
    if settings.mauve and settings.reference is not None and settings.num_samples >= settings.mauve_min_samples \
            and not mauve_installed():
        raise ImportError(f"{MAUVE_MISSING}, or turn MAUVE off (sampling.mauve=false)")


def score_cells(run: Run, cells: Sequence[Cell], *, tokenizer: Any, evaluator_spec: Callable[[str], str],
                reference: Callable[[], tuple[list[str], Any]] | None,
                load: Callable[[str], Any] | None = None, reference_spec: dict[str, Any] | None = None) -> None:
    """Stage 2: per evaluator, Gen PPL, MAUVE (features from the same pass) and entropy of every sample set.

    ``evaluator_spec(name)`` is the loadable spec of an evaluator name (recorded in the units as the store
    writes a path, :meth:`PipelineStore.recorded`);
    ``load(name)`` returns the evaluator (default: :func:`~tadm.eval.evaluator.load_evaluator` of its
    spec), only when some unit needs it; ``reference()`` returns the held-out texts and their ids, drawn by
    :func:`draw_reference` (the units record ``reference_order: "random"``: units made when the reference was
    the first blocks are scored again, once); ``reference_spec`` holds what else those texts depend on (a front
    door's own settings, such as a sweep's reference count), recorded in the spec of the data unit and of
    every score unit.
    A MAUVE cluster count other than "auto" is recorded in the score units' specs; like every key added
    since units were first written, it is left out at the value earlier units were made with, so that
    they are still reused.
    """
    s = run.settings
    use_mauve = s.mauve and s.reference is not None
    if use_mauve and s.num_samples < s.mauve_min_samples:
        run.log(f"note: MAUVE is not computed: {s.num_samples} samples per cell < the minimum of "
                f"{s.mauve_min_samples} (raise the sample count, or lower mauve_min_samples knowingly)")
    forms = run.store.forms
    described = {**REFERENCE_ORDER, **(reference_spec or {})} if s.reference is not None else {}
    buckets = ({"mauve_num_buckets": s.mauve_num_buckets}
               if use_mauve and s.mauve_num_buckets != MAUVE_DEFAULT_BUCKETS else {})
    for name in s.evaluators:
        spec_of = evaluator_spec(name)
        bases = [{"evaluator": form(spec_of), "reference": s.reference, "reference_split": s.reference_split,
                  "reference_blocks": "whole", "mauve": use_mauve, "mauve_min_samples": s.mauve_min_samples,
                  **described}
                 for form in forms]
        data_path = run.store.score_path(name, None)
        data_specs = [{**base, "num_samples": s.num_samples, "length": run.length} for base in bases]
        need_data = s.reference is not None and not run.store.done_as_any(data_path, data_specs)
        todo = [(c, [{**base, **buckets, "samples": sample_spec(c, s, run.length, form)}
                     for base, form in zip(bases, forms)])
                for c in cells]
        todo = [(c, specs) for c, specs in todo if not run.store.done_as_any(run.store.score_path(name, c), specs)]
        run.skipped += [f"score {name} data"] if s.reference is not None and not need_data else []
        run.skipped += [f"score {name} {_unit(c)}" for c in cells if c not in {t[0] for t in todo}]
        if not todo and not need_data:
            continue
        run.log(f"loading evaluator {name} ({spec_of})")
        evaluator = load(name) if load is not None else load_evaluator(spec_of, device=run.device)
        ref_features = None
        if s.reference is not None and reference is not None:
            ref_features = _score_reference(run, name, evaluator, reference, use_mauve,
                                            (data_path, data_specs[0]) if need_data else None)
        for cell, specs in todo:
            start = time.perf_counter()
            ids = run.store.load(run.store.sample_path(cell))["token_ids"]
            texts = decode_samples(ids, tokenizer)
            ppl = gen_ppl(texts, evaluator, batch_size=s.eval_batch_size, features=ref_features is not None,
                          progress=run.progress)
            run.store.save(run.store.score_path(name, cell), specs[0], {
                "gen_ppl": ppl.gen_ppl, "gen_ppl_nll": ppl.nll, "gen_ppl_tokens": ppl.num_tokens,
                "entropy": mean_entropy(ids), **_mauve(s, ref_features, ppl.features, len(texts))})
            run.done(f"score {name} {_unit(cell)}", time.perf_counter() - start)


def _score_reference(run: Run, name: str, evaluator: Any, reference: Callable[[], tuple[list[str], Any]],
                     use_mauve: bool, data_unit: tuple[Path, dict[str, Any]] | None) -> Any:
    """The reference texts under ``evaluator``: their MAUVE features (None without MAUVE), and the Data row's
    unit saved when ``data_unit`` (its path and spec) is given."""
    s = run.settings
    ref_texts, ref_ids = reference()
    start = time.perf_counter()
    ref = gen_ppl(ref_texts, evaluator, batch_size=s.eval_batch_size, features=use_mauve, progress=run.progress)
    if data_unit is not None:
        run.store.save(*data_unit, {"gen_ppl": ref.gen_ppl, "gen_ppl_nll": ref.nll, "gen_ppl_tokens": ref.num_tokens,
                                    "entropy": mean_entropy(ref_ids), "num_texts": len(ref_texts)})
        run.done(f"score {name} data", time.perf_counter() - start)
    return ref.features


def timed_sample_spec(run: Run, cell: Cell, form: PathForm = _as_given) -> dict[str, Any]:
    """What the timing of ``cell`` depends on: its sample spec less the sample count and batch."""
    length = run.length_of(cell) if run.length_of else run.length
    return sample_spec(cell, run.settings, length, form) | {"num_samples": None, "batch_size": None}


def time_spec(run: Run, cells: Sequence[Cell], form: PathForm = _as_given) -> dict[str, Any]:
    s = run.settings
    return {"cells": [[c.label, c.seed, c.steps, c.refresh] for c in cells],
            "samples": [timed_sample_spec(run, c, form) for c in cells],
            "generations": s.throughput_generations, "warmup": s.throughput_warmup,
            "batch_size": s.throughput_batch_size, "device": str(run.device)}


def time_cells(run: Run, cells: Sequence[Cell]) -> None:
    """Stage 3: tokens/s of every cell, all timed together in shuffled interleaved rounds (one unit)."""
    s = run.settings
    if s.throughput_generations == 0 or not cells:
        return
    specs = [time_spec(run, cells, form) for form in run.store.forms]
    if run.store.done_as_any(run.store.throughput_path, specs):
        run.skipped.append("throughput")
        return
    length = run.length_of or (lambda cell: run.length)
    timing = [TimingCell(key=cell.key, model=run.model_of(cell), seq_len=length(cell), num_steps=cell.steps,
                         policy=cell.policy,
                         make_sampler=lambda cell=cell: s.sampler.build(run.model_of(cell), cell.steps, length(cell))[1])
              for cell in cells]
    run.log(f"timing {len(timing)} cells interleaved: {s.throughput_warmup} warm-up + {s.throughput_generations} "
            f"timed generations of batch {s.throughput_batch_size} each")
    start = time.perf_counter()
    results = interleaved_throughput(timing, num_generations=s.throughput_generations, warmup=s.throughput_warmup,
                                     batch_size=s.throughput_batch_size, dtype=s.dtype, device=run.device,
                                     seed=s.seed, progress=run.progress)
    rows = [{"model": key[0], "seed": key[1], "steps": key[2], "refresh": key[3], **r.as_dict()}
            for key, r in results.items()]
    run.store.save(run.store.throughput_path, specs[0], {"rows": rows, "torch_threads": torch.get_num_threads()})
    run.done("throughput", time.perf_counter() - start)


# ============================================================================================= rows
def cell_rows(run: Run, cells: Sequence[Cell], evaluator: str, *, split_of: Callable[[Cell], Any],
              baseline_layers: int) -> list[dict[str, Any]]:
    """One row per finished cell for ``evaluator``: samples, scores, timing and compute merged."""
    s = run.settings
    timing = run.store.load(run.store.throughput_path) or {}
    timed = timing.get("spec") or {}  # the settings the stored timings were made with (a resumed run may skip them)
    made_as = {tuple(key): spec for key, spec in zip(timed.get("cells", []), timed.get("samples", []))}
    tps = {(r["model"], r["seed"], r["steps"], r["refresh"]): r for r in timing.get("rows", [])}
    rows = []
    for cell in cells:
        sample, score = run.store.load(run.store.sample_path(cell)), run.store.load(run.store.score_path(evaluator, cell))
        if sample is None or score is None:
            continue
        counted = (sample.get("layer_calls_last_batch") or {}).get("total")
        calls = _calls(split_of(cell), cell, counted)
        # timings of a cell whose sampling settings changed since are not its timings
        made = {"spec": made_as.get(cell.key)}
        same = run.store.holds(made, [timed_sample_spec(run, cell, form) for form in run.store.forms])
        t = tps.get(cell.key, {}) if same else {}
        baseline = cell.steps * baseline_layers
        rows.append({
            "evaluator": evaluator, "model": cell.label, "path": cell.model_path, "seed": cell.seed,
            "steps": cell.steps, "refresh": cell.refresh, "refresh_label": cell.policy.label(),
            "sampler": sample.get("sampler"), "length": run.length, "num_samples": s.num_samples,
            **{k: score.get(k) for k in ("gen_ppl", "gen_ppl_nll", "gen_ppl_tokens", "entropy", "mauve",
                                         "mauve_num_samples", "mauve_num_reference", "mauve_buckets", "mauve_note")},
            "layer_calls": calls, "layer_calls_counted": counted, "baseline_layer_calls": baseline,
            "compute_relative": calls / baseline if calls is not None and baseline else None,
            "tokens_per_second": t.get("tokens_per_second"), "tokens_per_second_min": t.get("tokens_per_second_min"),
            "tokens_per_second_max": t.get("tokens_per_second_max"),
            "throughput_generations": timed.get("generations") if t else None,
            "throughput_batch_size": timed.get("batch_size") if t else None,
            "sampling_seconds": sample.get("seconds"), "commit": (sample.get("provenance") or {}).get("commit"),
            "dirty": (sample.get("provenance") or {}).get("dirty")})
    return rows


def throughput_note(rows: Sequence[dict[str, Any]], warmup: int | None = None) -> str:
    """The report's sentence on tokens/s, from the timing settings the rows carry (those of the stored timings,
    which a run resumed with ``throughput_generations: 0`` keeps), or that no cell was timed."""
    timed = sorted({(r["throughput_generations"], r["throughput_batch_size"]) for r in rows
                    if r.get("tokens_per_second") is not None})
    if not timed:
        return "Throughput: not timed."
    how = "; ".join(f"{g} timed generations of batch {b}" for g, b in timed)
    after = f" after {warmup} warm-up" if warmup is not None else ""
    return (f"Throughput: tokens/s = generated tokens / median generation time [slowest-fastest generation] of "
            f"{how}{after}, all cells interleaved in shuffled rounds")


def timing_warmup(store: PipelineStore) -> int | None:
    """The warm-up generations of the stored timings (None when nothing was timed)."""
    return ((store.load(store.throughput_path) or {}).get("spec") or {}).get("warmup")


def _calls(split: Any, cell: Cell, counted: int | None) -> int | None:
    """Eq. (anchor-cache-compute) for analytic policies; a canvas-dependent policy's compute is its count."""
    if cell.policy.refresh_count(cell.steps) is None:
        return counted
    return policy_layer_calls(split, cell.steps, cell.policy)


def data_row(run: Run, evaluator: str) -> dict[str, Any] | None:
    """The reference text's own row for ``evaluator`` (None until scored)."""
    data = run.store.load(run.store.score_path(evaluator, None))
    if data is None:
        return None
    return {"evaluator": evaluator, "model": "data", "path": run.settings.reference, "steps": None, "refresh": None,
            "length": run.length, "num_samples": data["num_texts"], "gen_ppl": data["gen_ppl"],
            "gen_ppl_nll": data.get("gen_ppl_nll"), "gen_ppl_tokens": data.get("gen_ppl_tokens"),
            "entropy": data["entropy"], "mauve": None, "commit": (data.get("provenance") or {}).get("commit"),
            "dirty": (data.get("provenance") or {}).get("dirty")}
