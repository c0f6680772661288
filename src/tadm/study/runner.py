"""Running a staleness study as resumable units, from training to the report (``tadm study CONFIG``).

Every unit writes one JSON file (or a model directory) under ``out_dir`` and records the settings
that produced it (its *spec*). A later invocation skips a unit whose file exists with the same
spec, so a study cut off at any point continues where it stopped, and re-running a finished study
only rebuilds the report. The units, in order:

1. ``tokenizer/``: one BPE tokenizer trained on the corpus and shared by every model;
2. ``models/NAME-sSEED/``: training of each (model, seed) (:func:`tadm.training.train`; a cut-off
   training resumes from its ``training_state.pt``); ``study_unit.json`` marks it finished;
3. ``evals/NAME-sSEED/likelihood.json``: the fresh validation NELBO (AR: exact NLL);
4. ``evals/NAME-sSEED/staleness[-naive]-eEVAL.json``: the stale-anchor curves, the
   uninformative-anchor bound and the cached-process bound per K, per evaluation seed;
5. ``samples/NAME-sSEED/T*-K*.json``: the K x T sampling sweep (token ids, exact layer calls);
6. ``scores/EVALUATOR/...json``: Gen PPL, entropy and MAUVE of each sample set, and of the held-out
   reference text (``data.json``), per evaluator;
7. ``throughput.json``: tokens/s of every sampling cell (tokens over the median generation time, with the
   slowest and fastest generation's), timed interleaved;
8. ``results.json`` / ``results.csv`` / ``report.md`` / ``plots/``: rebuilt from the units
   (:mod:`tadm.study.report`).

A unit whose file holds another spec is an error for trained models (retraining would silently
discard hours of work: use another ``out_dir``) and is redone for evaluations. Specs write the paths
inside ``out_dir`` (the models, the in-domain evaluator) relative to it, so that the study named by another
path or moved keeps its units; a record written before, with the paths the study had then, still counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePath
from typing import Any

from tadm.config import ConfigError
from tadm.devices import resolve_device
from tadm.eval.evaluator import check_evaluator
from tadm.eval.likelihood import cached_process_nelbo, evaluate_likelihood, packed_eval_blocks, stale_anchor_nelbo
from tadm.eval.pipeline import (Cell, PipelineStore, Run, check_scoring_dependencies, draw_reference, sample_cells,
                                score_cells, time_cells)
from tadm.nn import NaiveReuse, load_model
from tadm.records import git_commit, machine_info, read_json, write_json
from tadm.sampling.refresh import parse_refresh
from tadm.study.config import IN_DOMAIN_EVALUATOR, MODEL_KINDS, StudyConfig, StudyModel, model_experiment_config
from tadm.study.report import write_report
from tadm.training.checkpoint import STATE_FILENAME
from tadm.training.data import TEXT_SUFFIXES
from tadm.training.provenance import check_provenance, train_recorded_tokenizer
from tadm.training.rundir import RunDirLock, prepare_run_dir
from tadm.training.tokenization import META_FILENAME, load_tokenizer
from tadm.training.trainer import train

__all__ = ["StudyLayout", "StudyOutput", "run_study"]

UNIT_MARKER = "study_unit.json"


@dataclass(frozen=True)
class StudyLayout:
    """Where each unit of a study lives."""

    root: Path

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    def run_dir(self, name: str, seed: int) -> Path:
        return self.root / "models" / f"{name}-s{seed}"

    def final_dir(self, name: str, seed: int) -> Path:
        return self.run_dir(name, seed) / "final"

    def eval_file(self, name: str, seed: int, what: str) -> Path:
        return self.root / "evals" / f"{name}-s{seed}" / f"{what}.json"

    @property
    def manifest(self) -> Path:
        return self.root / "study.json"


@dataclass
class StudyOutput:
    """What :func:`run_study` did and wrote."""

    out_dir: Path
    ran: list[str] = field(default_factory=list)  # units run in this call
    skipped: list[str] = field(default_factory=list)  # units found finished
    files: dict[str, Path] = field(default_factory=dict)
    seconds: float = 0.0


# ----------------------------------------------------------------------------------------- helpers
# Training keys that say how a run is watched, not what it learns: a unit trained with other values, or
# before one of them existed, is still the same unit.
WATCH_KEYS = ("loggers", "wandb_project", "tensorboard", "log_every", "overwrite")


def _training_identity(spec: Any) -> Any:
    """A training unit's spec as compared for "done": watch keys dropped, a derived micro-batch (None) written
    as the global batch it is on the study's one process, the validation batch as the size it was (a record
    from before ``train.eval_batch_size`` validated on micro-batches; unset means the global batch), and the paths inside the study's out_dir (the unit's
    own directory, the shared tokenizer) written relative to it, so that the same study named by another path
    (relative or absolute, from another working directory, or moved) is the same study."""
    spec = json.loads(json.dumps(spec))
    config = spec.get("config") if isinstance(spec, dict) else None
    train = config.get("train") if isinstance(config, dict) else None
    if isinstance(train, dict):
        for key in WATCH_KEYS:
            train.pop(key, None)
        if train.get("micro_batch_size") is None:
            train["micro_batch_size"] = train.get("global_batch_size")
        if "eval_batch_size" not in train:  # recorded before the key existed: validation took micro-batches
            train["eval_batch_size"] = train["micro_batch_size"]
        elif train["eval_batch_size"] is None:
            train["eval_batch_size"] = train.get("global_batch_size")
        if isinstance(train.get("out_dir"), str):
            unit_dir = PurePath(train["out_dir"])
            root = unit_dir.parent.parent  # the unit trains in out_dir/models/NAME-sSEED
            train["out_dir"] = unit_dir.relative_to(root).as_posix()
            data = config.get("data")
            if isinstance(data, dict) and isinstance(data.get("tokenizer"), str):
                try:
                    data["tokenizer"] = PurePath(data["tokenizer"]).relative_to(root).as_posix()
                except ValueError:  # a tokenizer outside the study (a named one, or a directory elsewhere)
                    pass
    return spec


def _fmt_seconds(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


# ------------------------------------------------------------------------------------------- study
class _Study:
    def __init__(self, cfg: StudyConfig, log: Callable[[str], None], progress: bool) -> None:
        self.cfg = cfg
        self.layout = StudyLayout(Path(cfg.out_dir))
        self.log = log
        self.progress = progress
        self.out = StudyOutput(out_dir=self.layout.root)
        # every unit spec writes the study's model paths relative to out_dir: a moved study keeps its units
        self.store = PipelineStore(self.layout.root, relative_paths=True)
        self.device = resolve_device(cfg.sampling.device)
        self._models: dict[tuple[str, int, bool], Any] = {}
        self._tokenizer: Any = None

    # ---------------------------------------------------------------- bookkeeping
    def units(self) -> list[tuple[StudyModel, int]]:
        return [(m, seed) for m in self.cfg.models for seed in self.cfg.seeds_of(m)]

    def anchored(self, m: StudyModel) -> bool:
        return MODEL_KINDS[m.kind][0] in ("tadm", "adlm")

    def diffusion(self, m: StudyModel) -> bool:
        return MODEL_KINDS[m.kind][0] != "ar"

    def variants(self, m: StudyModel, naive: bool) -> list[bool]:
        """[False] (the model itself), plus True (naive reuse) for a TADM when asked for."""
        return [False, True] if naive and MODEL_KINDS[m.kind][0] == "tadm" else [False]

    def label(self, m: StudyModel, naive: bool) -> str:
        return f"{m.name}-naive" if naive else m.name

    def _ran(self, unit: str, seconds: float) -> None:
        self.out.ran.append(unit)
        self.log(f"[study] {unit}: done in {_fmt_seconds(seconds)}")

    # ---------------------------------------------------------------- 1. tokenizer
    @cached_property
    def tokenizer_source(self) -> str:
        """The ``data.tokenizer`` every model trains with: the shared BPE directory, or the configured one."""
        if self.cfg.data.tokenizer != "bpe":
            return self.cfg.data.tokenizer
        data, tok_dir = self.cfg.data, self.layout.tokenizer_dir
        if not (tok_dir / META_FILENAME).is_file():
            start = time.perf_counter()
            self.log(f"[study] training a {data.tokenizer_vocab_size}-token BPE on {data.source!r}")
            train_recorded_tokenizer(data.source, data.tokenizer_vocab_size, tok_dir, text_field=data.text_field)
            self._ran("tokenizer", time.perf_counter() - start)
        else:  # studies from before tokenizer records have none: accepted
            check_provenance(tok_dir, data.source, data.tokenizer_vocab_size, text_field=data.text_field,
                             missing_ok=True, advice="a study keeps one tokenizer: give the new data a new out_dir")
            self.out.skipped.append("tokenizer")
        return str(tok_dir)

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_source)
        return self._tokenizer

    # ---------------------------------------------------------------- 2. training
    def training_unit(self, m: StudyModel, seed: int, tokenizer: str) -> tuple[Any, dict[str, Any]]:
        """(training config, spec) of one (model, seed) unit trained with the study's ``tokenizer``; the spec is
        what its ``study_unit.json`` records."""
        exp = model_experiment_config(self.cfg, m, seed)
        if self.cfg.data.tokenizer == "bpe":
            exp.data.tokenizer = tokenizer
        return exp, {"kind": m.kind, "config": exp.to_dict()}

    def check_trained(self, m: StudyModel, seed: int, spec: dict[str, Any]) -> bool:
        """Whether the unit is trained with ``spec``; a ConfigError when it is trained with another one, or its
        record cannot be read."""
        run_dir = self.layout.run_dir(m.name, seed)
        marker = run_dir / UNIT_MARKER
        if not marker.is_file():
            return False
        record = read_json(marker)
        if not isinstance(record, dict) or not isinstance(record.get("spec"), dict):
            raise ConfigError(f"{marker} is not a readable study unit record; restore it, or delete {run_dir} to "
                              "retrain the model")
        saved, wanted = _training_identity(record["spec"]), _training_identity(spec)
        if saved != wanted:
            raise ConfigError(
                f"{run_dir} holds model {m.name!r} (seed {seed}) trained with other settings; "
                f"{_first_difference(saved, wanted)}; use another out_dir, or delete {run_dir} to retrain it")
        return True

    def check_training(self) -> None:
        """Stop before anything is written on what would stop the train stage: a trained unit or the shared
        tokenizer made with other settings, or an unreadable unit record."""
        tok = str(self.layout.tokenizer_dir)  # where tokenizer_source puts the shared BPE
        if self.cfg.data.tokenizer != "bpe" or (self.layout.tokenizer_dir / META_FILENAME).is_file():
            tok = self.tokenizer_source  # checks the tokenizer's provenance (trains nothing: it exists)
        for m, seed in self.units():
            self.check_trained(m, seed, self.training_unit(m, seed, tok)[1])

    def train_all(self) -> None:
        tok = self.tokenizer_source
        for m, seed in self.units():
            unit = f"train {m.name} seed {seed}"
            exp, spec = self.training_unit(m, seed, tok)
            run_dir = self.layout.run_dir(m.name, seed)
            marker = run_dir / UNIT_MARKER
            if self.check_trained(m, seed, spec):
                self.out.skipped.append(unit)
                continue
            resume = (run_dir / STATE_FILENAME).is_file()
            if (run_dir / "final").exists() and not resume:
                exp.train.overwrite = True  # a final/ without state or marker: an unfinished earlier attempt
            self.log(f"[study] {unit} ({MODEL_KINDS[m.kind][1]})" + (" - resuming" if resume else ""))
            start = time.perf_counter()
            result = train(exp, resume=resume)
            seconds = time.perf_counter() - start
            write_json(marker, {"spec": spec, "step": result.step, "tokens_seen": result.tokens_seen,
                                 "val_nelbo": result.val_nelbo, "num_parameters": result.num_parameters,
                                 "wall_time_s": seconds, "resumed": resume})
            self._ran(unit, seconds)

    def check_inputs(self, stages: tuple[str, ...]) -> None:
        """Stop at once on what would stop a later stage: models not trained, an evaluator that cannot load."""
        if "train" not in stages and set(stages) & {"likelihood", "sample", "score", "throughput"}:
            missing = [f"{m.name!r} seed {seed}" for m, seed in self.units()
                       if not (self.layout.run_dir(m.name, seed) / UNIT_MARKER).is_file()]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise ConfigError(f"model {missing[0]}{more} is not trained in {self.layout.root}; "
                                  "run the train stage first")
        if "score" in stages:
            reference = self.cfg.sampling.reference
            path_like = reference is not None and (reference.startswith((".", "/", "~"))
                                                   or reference.lower().endswith(TEXT_SUFFIXES))
            if path_like and not Path(reference).expanduser().exists():
                raise ConfigError(f"sampling.reference: corpus file or directory {reference!r} does not exist; give "
                                  "an existing file or directory, a bundled corpus such as 'brown', or a Hugging Face "
                                  "dataset name")
            for name in self.cfg.sampling.evaluators:
                if name != IN_DOMAIN_EVALUATOR:
                    try:
                        check_evaluator(name, supply="name in sampling.evaluators")
                    except (FileNotFoundError, ValueError, ImportError) as err:
                        raise ConfigError(f"sampling.evaluators: {err}") from None
            check_scoring_dependencies(self.cfg.sampling)

    # ---------------------------------------------------------------- loading
    def model(self, m: StudyModel, seed: int, naive: bool = False) -> Any:
        key = (m.name, seed, naive)
        if key not in self._models:
            if naive:
                model = NaiveReuse(self.model(m, seed))
            else:
                model = load_model(self.layout.final_dir(m.name, seed), device=str(self.device)).to(self.device)
            self._models[key] = model.eval()
        return self._models[key]

    def length(self) -> int:
        return int(self.cfg.data.seq_len)

    @cached_property
    def val_blocks(self) -> Any:
        data = self.cfg.data
        return packed_eval_blocks(data.source, self.tokenizer(), self.length(), cache_dir=data.cache_dir, split="val",
                                  val_fraction=data.val_fraction, seed=0)

    # ---------------------------------------------------------------- 3. + 4. likelihood
    def evaluate_likelihoods(self) -> None:
        st, schedule = self.cfg.staleness, self.cfg.objective.schedule
        common = dict(batch_size=st.batch_size, max_blocks=st.max_blocks, device=self.device, schedule=schedule)
        discrete = st.discrete_steps or min(st.steps)
        for m, seed in self.units():
            final = str(self.layout.final_dir(m.name, seed))
            specs = [{"model": form(final), "t_samples": st.t_samples, "seed": st.eval_seeds[0],
                      "batch_size": st.batch_size, "max_blocks": st.max_blocks, "schedule": schedule}
                     for form in self.store.forms]
            path = self.layout.eval_file(m.name, seed, "likelihood")
            unit = f"likelihood {m.name} seed {seed}"
            if self.store.holds(read_json(path), specs):
                self.out.skipped.append(unit)
            else:
                start = time.perf_counter()
                result = evaluate_likelihood(self.model(m, seed), self.val_blocks, num_t_samples=st.t_samples,
                                             seed=st.eval_seeds[0], **common)
                write_json(path, {"spec": specs[0], "result": result.as_dict(), "seconds": time.perf_counter() - start})
                self._ran(unit, time.perf_counter() - start)
            if not self.anchored(m):
                continue
            for naive in self.variants(m, st.naive):
                for eval_seed in st.eval_seeds:
                    what = f"staleness{'-naive' if naive else ''}-e{eval_seed}"
                    specs = [{"model": form(final), "naive": naive, "steps": st.steps, "max_age": st.max_age,
                              "refresh": st.refresh, "discrete_steps": discrete, "uninformative": st.uninformative,
                              "t_samples": st.t_samples, "batch_size": st.batch_size, "max_blocks": st.max_blocks,
                              "seed": eval_seed, "schedule": schedule} for form in self.store.forms]
                    path = self.layout.eval_file(m.name, seed, what)
                    unit = f"staleness {self.label(m, naive)} seed {seed} eval-seed {eval_seed}"
                    if self.store.holds(read_json(path), specs):
                        self.out.skipped.append(unit)
                        continue
                    model = self.model(m, seed, naive)
                    start = time.perf_counter()
                    stale = stale_anchor_nelbo(model, self.val_blocks, steps=st.steps, max_age=st.max_age,
                                               uninformative=st.uninformative, num_t_samples=st.t_samples,
                                               seed=eval_seed, progress=self.progress, **common)
                    mid = time.perf_counter()
                    cached = cached_process_nelbo(model, self.val_blocks, num_steps=discrete,
                                                  refresh_intervals=st.refresh, seed=eval_seed, progress=self.progress,
                                                  **common)
                    end = time.perf_counter()
                    write_json(path, {"spec": specs[0], "staleness": stale.as_dict(), "cached": cached.as_dict(),
                                       "seconds": {"staleness": mid - start, "cached": end - mid}})
                    self._ran(unit, end - start)

    # ---------------------------------------------------------------- 5.-7. sampling, scoring, timing
    def sampling_cells(self) -> list[Cell]:
        """Every sampling cell: each diffusion model x sampled seed (x naive reuse) x T x refresh policy;
        models without an anchor only at K = 1."""
        sp, cells = self.cfg.sampling, []
        for m in self.cfg.models:
            if not self.diffusion(m):
                continue
            for seed in self.cfg.sampled_seeds(m):
                for naive in self.variants(m, sp.naive):
                    for T in sp.steps:
                        policies = sp.policies() if self.anchored(m) else [parse_refresh(1)]
                        cells += [Cell(label=self.label(m, naive), model_path=str(self.layout.final_dir(m.name, seed)),
                                       steps=T, policy=policy, seed=seed, naive=naive) for policy in policies]
        return cells

    def pipeline(self) -> Run:
        """The shared pipeline's run over this study's units (:mod:`tadm.eval.pipeline`)."""
        by_path = {str(self.layout.final_dir(m.name, seed)): (m, seed) for m, seed in self.units()}

        def model_of(cell: Cell) -> Any:
            m, seed = by_path[cell.model_path]
            return self.model(m, seed, cell.naive)

        return Run(self.store, self.cfg.sampling, self.length(), model_of,
                   log=lambda line: self.log(f"[study] {line}"), progress=self.progress)

    def _pipeline_stage(self, stage: Callable[..., None], **kwargs: Any) -> None:
        """One stage of the shared pipeline over every sampling cell, its units counted as this study's."""
        run = self.pipeline()
        stage(run, self.sampling_cells(), **kwargs)
        self.out.ran += run.ran
        self.out.skipped += run.skipped

    def sample_all(self) -> None:
        self._pipeline_stage(sample_cells)

    def evaluator_spec(self, name: str) -> str:
        """The loadable spec of an evaluator name (the in-domain AR is the first seed of the AR model; its units
        record its path relative to out_dir, :meth:`PipelineStore.recorded`)."""
        if name == IN_DOMAIN_EVALUATOR:
            ar = next(m for m in self.cfg.models if m.kind == "ar")
            return str(self.layout.final_dir(ar.name, self.cfg.seeds_of(ar)[0]))
        return name

    def reference(self) -> tuple[list[str], Any]:
        """``num_samples`` held-out blocks drawn at random (:func:`~tadm.eval.pipeline.draw_reference`), decoded like
        the samples (whole blocks, framing included), and their ids."""
        sp = self.cfg.sampling
        blocks = packed_eval_blocks(sp.reference, self.tokenizer(), self.length(), cache_dir=self.cfg.data.cache_dir,
                                    split=sp.reference_split, val_fraction=self.cfg.data.val_fraction, seed=0)
        n = min(sp.num_samples, len(blocks))
        if n < sp.num_samples:
            self.log(f"[study] note: {sp.reference!r} ({sp.reference_split}) has only {n} blocks of {self.length()} "
                     f"tokens for {sp.num_samples} samples per cell")
        return draw_reference(blocks, n, self.tokenizer())

    def score_all(self) -> None:
        self._pipeline_stage(score_cells, tokenizer=self.tokenizer(), evaluator_spec=self.evaluator_spec,
                             reference=self.reference if self.cfg.sampling.reference is not None else None)

    def time_all(self) -> None:
        self._pipeline_stage(time_cells)


def open_study(cfg: StudyConfig, *, log: Callable[[str], None] = print, progress: bool = False) -> _Study:
    """A finished (or partial) study's workspace: its trained models, samplers, tokenizer and evaluators.

    For follow-up measurements on the study's models (e.g. refresh policies) without re-running units.
    """
    return _Study(cfg, log, progress)


def _first_difference(old: Any, new: Any, prefix: str = "") -> str:
    """A short description of the first differing key of two nested JSON values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _first_difference(old.get(key), new.get(key), f"{prefix}{key}.")
    return f"{prefix.rstrip('.') or 'spec'}: {old!r} there, {new!r} now"


def run_study(
    cfg: StudyConfig,
    *,
    log: Callable[[str], None] = print,
    progress: bool = True,
    stages: tuple[str, ...] = ("train", "likelihood", "sample", "score", "throughput", "report"),
    command: str | None = None,
) -> StudyOutput:
    """Run (or continue) the study ``cfg``; see the module docstring. ``stages`` limits what runs.

    The study directory is locked (``.tadm.lock``): a second invocation on it is refused with a
    message naming the holder, so two processes never run the same units or lose an invocation record.
    """
    start = time.perf_counter()
    study = _Study(cfg, log, progress)
    study.check_inputs(stages)
    layout = study.layout
    prepare_run_dir(layout.root, what="study out_dir")
    with RunDirLock(layout.root, what="study out_dir"):
        history = list((read_json(layout.manifest) or {}).get("invocations", []))
        invocation = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command, "stages": list(stages),
                      "machine": machine_info(), **git_commit()}
        timings: dict[str, float] = {}

        def record(**final: int) -> None:
            invocation["seconds"] = {**timings, "total": time.perf_counter() - start}
            invocation.update(final)
            write_json(layout.manifest, {"config": cfg.to_dict(), "invocations": history + [invocation]})

        if "train" in stages:
            study.check_training()  # before the manifest: a refused invocation leaves the study's record as it was
        write_json(layout.manifest, {"config": cfg.to_dict(), "invocations": history + [invocation]})
        for stage, fn in (("train", study.train_all), ("likelihood", study.evaluate_likelihoods),
                          ("sample", study.sample_all), ("score", study.score_all), ("throughput", study.time_all)):
            if stage in stages:
                t0 = time.perf_counter()
                fn()
                timings[stage] = time.perf_counter() - t0
                record()  # after every stage, so an invocation cut off later still counts what it finished
        record(ran=len(study.out.ran), skipped=len(study.out.skipped))
        if "report" in stages:
            study.out.files = write_report(cfg, layout, study.pipeline(), study.sampling_cells(), log=log)
        study.out.seconds = time.perf_counter() - start
    return study.out
