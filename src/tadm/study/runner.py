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
7. ``throughput.json``: tokens/s of every sampling cell, timed interleaved (median, min, max);
8. ``results.json`` / ``results.csv`` / ``report.md`` / ``plots/``: rebuilt from the units
   (:mod:`tadm.study.report`).

A unit whose file holds another spec is an error for trained models (retraining would silently
discard hours of work: use another ``out_dir``) and is redone for evaluations.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tadm.config import ConfigError
from tadm.records import git_commit, machine_info, read_json, same_spec, write_json
from tadm.training.rundir import RunDirLock, prepare_run_dir
from tadm.study.config import (
    IN_DOMAIN_EVALUATOR,
    MODEL_KINDS,
    StudyConfig,
    StudyModel,
    model_experiment_config,
    refresh_key,
    refresh_policy_of,
)

__all__ = ["StudyLayout", "StudyOutput", "run_study"]

UNIT_MARKER = "study_unit.json"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_") or "x"


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

    def sample_file(self, name: str, seed: int, T: int, K: int | str) -> Path:
        return self.root / "samples" / f"{name}-s{seed}" / f"T{T}-K{K}.json"

    def score_file(self, evaluator: str, name: str, seed: int | None, T: int | None, K: int | str | None) -> Path:
        base = self.root / "scores" / _slug(evaluator)
        return base / ("data.json" if seed is None else f"{name}-s{seed}-T{T}-K{K}.json")

    @property
    def throughput_file(self) -> Path:
        return self.root / "throughput.json"

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
def _done(path: Path, spec: Any) -> bool:
    return same_spec(read_json(path), spec)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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
        self.device = _device(cfg.sampling.device)
        self._models: dict[tuple[str, int, bool], Any] = {}
        self._tokenizer: Any = None
        self._tokenizer_source: str | None = None
        self._val_blocks: dict[int, Any] = {}

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

    def _skip(self, unit: str) -> None:
        self.out.skipped.append(unit)

    def _ran(self, unit: str, seconds: float) -> None:
        self.out.ran.append(unit)
        self.log(f"[study] {unit}: done in {_fmt_seconds(seconds)}")

    # ---------------------------------------------------------------- 1. tokenizer
    def tokenizer_source(self) -> str:
        """The ``data.tokenizer`` every model trains with: the shared BPE directory, or the configured one."""
        if self.cfg.data.tokenizer != "bpe":
            return self.cfg.data.tokenizer
        if self._tokenizer_source is not None:
            return self._tokenizer_source
        from tadm.training.provenance import check_provenance, train_recorded_tokenizer
        from tadm.training.tokenization import META_FILENAME

        data, tok_dir = self.cfg.data, self.layout.tokenizer_dir
        if not (tok_dir / META_FILENAME).is_file():
            start = time.perf_counter()
            self.log(f"[study] training a {data.tokenizer_vocab_size}-token BPE on {data.source!r}")
            train_recorded_tokenizer(data.source, data.tokenizer_vocab_size, tok_dir, text_field=data.text_field)
            self._ran("tokenizer", time.perf_counter() - start)
        else:  # studies from before tokenizer records have none: accepted
            check_provenance(tok_dir, data.source, data.tokenizer_vocab_size, text_field=data.text_field,
                             missing_ok=True, advice="a study keeps one tokenizer: give the new data a new out_dir")
            self._skip("tokenizer")
        self._tokenizer_source = str(tok_dir)
        return self._tokenizer_source

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tadm.training.tokenization import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_source())
        return self._tokenizer

    # ---------------------------------------------------------------- 2. training
    def train_all(self) -> None:
        from tadm.training.checkpoint import STATE_FILENAME
        from tadm.training.trainer import train

        tok = self.tokenizer_source()
        for m, seed in self.units():
            unit = f"train {m.name} seed {seed}"
            exp = model_experiment_config(self.cfg, m, seed)
            if self.cfg.data.tokenizer == "bpe":
                exp.data.tokenizer = tok
            spec = {"kind": m.kind, "config": exp.to_dict()}
            run_dir = self.layout.run_dir(m.name, seed)
            marker = run_dir / UNIT_MARKER
            if marker.is_file():
                saved = read_json(marker) or {}
                if saved.get("spec") != json.loads(json.dumps(spec)):
                    raise ConfigError(
                        f"{run_dir} holds model {m.name!r} (seed {seed}) trained with other settings; "
                        f"{_first_difference(saved.get('spec'), json.loads(json.dumps(spec)))}; use another out_dir, or delete "
                        f"{run_dir} to retrain it")
                self._skip(unit)
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

    # ---------------------------------------------------------------- loading
    def model(self, m: StudyModel, seed: int, naive: bool = False) -> Any:
        key = (m.name, seed, naive)
        if key not in self._models:
            from tadm.nn import NaiveReuse, load_model

            base_key = (m.name, seed, False)
            if base_key not in self._models:
                self._models[base_key] = load_model(self.layout.final_dir(m.name, seed), device=str(self.device))
                self._models[base_key].to(self.device).eval()
            if naive:
                self._models[key] = NaiveReuse(self._models[base_key]).eval()
        return self._models[key]

    def length(self) -> int:
        return int(self.cfg.data.seq_len)

    def val_blocks(self) -> Any:
        from tadm.eval.likelihood import packed_eval_blocks

        L = self.length()
        if L not in self._val_blocks:
            self._val_blocks[L] = packed_eval_blocks(self.cfg.data.source, self.tokenizer(), L,
                                                     cache_dir=self.cfg.data.cache_dir, split="val",
                                                     val_fraction=self.cfg.data.val_fraction, seed=0)
        return self._val_blocks[L]

    # ---------------------------------------------------------------- 3. + 4. likelihood
    def evaluate_likelihoods(self) -> None:
        from tadm.eval.likelihood import cached_process_nelbo, evaluate_likelihood, stale_anchor_nelbo

        st = self.cfg.staleness
        for m, seed in self.units():
            final = str(self.layout.final_dir(m.name, seed))
            common = dict(batch_size=st.batch_size, max_blocks=st.max_blocks, device=self.device)
            spec = {"model": final, "t_samples": st.t_samples, "seed": st.eval_seeds[0], "batch_size": st.batch_size,
                    "max_blocks": st.max_blocks, "schedule": self.cfg.objective.schedule}
            path = self.layout.eval_file(m.name, seed, "likelihood")
            unit = f"likelihood {m.name} seed {seed}"
            if _done(path, spec):
                self._skip(unit)
            else:
                start = time.perf_counter()
                result = evaluate_likelihood(self.model(m, seed), self.val_blocks(), num_t_samples=st.t_samples,
                                             seed=st.eval_seeds[0], schedule=self.cfg.objective.schedule, **common)
                write_json(path, {"spec": spec, "result": result.as_dict(), "seconds": time.perf_counter() - start})
                self._ran(unit, time.perf_counter() - start)
            if not self.anchored(m):
                continue
            for naive in self.variants(m, st.naive):
                for eval_seed in st.eval_seeds:
                    what = f"staleness{'-naive' if naive else ''}-e{eval_seed}"
                    discrete = st.discrete_steps or min(st.steps)
                    spec = {"model": final, "naive": naive, "steps": st.steps, "max_age": st.max_age,
                            "refresh": st.refresh, "discrete_steps": discrete, "uninformative": st.uninformative,
                            "t_samples": st.t_samples, "batch_size": st.batch_size, "max_blocks": st.max_blocks,
                            "seed": eval_seed, "schedule": self.cfg.objective.schedule}
                    path = self.layout.eval_file(m.name, seed, what)
                    unit = f"staleness {self.label(m, naive)} seed {seed} eval-seed {eval_seed}"
                    if _done(path, spec):
                        self._skip(unit)
                        continue
                    model = self.model(m, seed, naive)
                    start = time.perf_counter()
                    stale = stale_anchor_nelbo(model, self.val_blocks(), steps=st.steps, max_age=st.max_age,
                                               uninformative=st.uninformative, num_t_samples=st.t_samples,
                                               seed=eval_seed, schedule=self.cfg.objective.schedule,
                                               progress=self.progress, **common)
                    mid = time.perf_counter()
                    cached = cached_process_nelbo(model, self.val_blocks(), num_steps=discrete,
                                                  refresh_intervals=st.refresh, seed=eval_seed,
                                                  schedule=self.cfg.objective.schedule, progress=self.progress,
                                                  **common)
                    end = time.perf_counter()
                    write_json(path, {"spec": spec, "staleness": stale.as_dict(), "cached": cached.as_dict(),
                                       "seconds": {"staleness": mid - start, "cached": end - mid}})
                    self._ran(unit, end - start)

    # ---------------------------------------------------------------- 5. sampling
    def sampling_cells(self) -> list[tuple[StudyModel, int, bool, int, int | str]]:
        """(model, seed, naive, T, K) of every sampling cell; models without an anchor only at K = 1.

        K is the entry's :func:`~tadm.study.config.refresh_key`: the interval of a fixed policy, or
        the name of a policy mapping (``"adaptive-tau0.3"``).
        """
        sp = self.cfg.sampling
        cells = []
        for m in self.cfg.models:
            if not self.diffusion(m):
                continue
            refresh = [refresh_key(e) for e in sp.refresh] if self.anchored(m) else [1]
            for seed in self.cfg.sampled_seeds(m):
                for naive in self.variants(m, sp.naive):
                    for T in sp.steps:
                        for K in refresh:
                            cells.append((m, seed, naive, T, K))
        return cells

    def sampler(self, model: Any, T: int) -> tuple[str, Any]:
        from tadm.eval.sweep import resolve_sampler
        from tadm.sampling.registry import get_sampler, sampler_options

        sp = self.cfg.sampling
        name = resolve_sampler(sp.sampler, T, self.length())
        settings = {"top_p": sp.top_p, "eta": sp.eta, "schedule": self.cfg.objective.schedule,
                    "nucleus": sp.nucleus, "time_grid": sp.time_grid}
        return name, get_sampler(name, model.mask_token_id, **sampler_options(name, settings))

    def refresh_policy(self, K: int | str) -> Any:
        """A fresh refresh policy of the ``sampling.refresh`` entry whose key is ``K``."""
        for entry in self.cfg.sampling.refresh:
            if refresh_key(entry) == K:
                return refresh_policy_of(entry)
        return refresh_policy_of(K)  # K = 1 of models without an anchor

    def sample_spec(self, m: StudyModel, seed: int, naive: bool, T: int, K: int | str) -> dict[str, Any]:
        sp = self.cfg.sampling
        return {"model": str(self.layout.final_dir(m.name, seed)), "naive": naive, "steps": T, "refresh": K,
                "length": self.length(), "num_samples": sp.num_samples, "batch_size": sp.batch_size,
                "seed": sp.seed, "sampler": sp.sampler, "top_p": sp.top_p, "eta": sp.eta, "nucleus": sp.nucleus,
                "time_grid": sp.time_grid, "dtype": sp.dtype}

    def sample_all(self) -> None:
        from tadm.eval.throughput import resolve_dtype
        from tadm.sampling import generate

        sp = self.cfg.sampling
        amp = resolve_dtype(sp.dtype)
        for m, seed, naive, T, K in self.sampling_cells():
            spec = self.sample_spec(m, seed, naive, T, K)
            path = self.layout.sample_file(self.label(m, naive), seed, T, K)
            unit = f"sample {self.label(m, naive)} seed {seed} T={T} K={K}"
            if _done(path, spec):
                self._skip(unit)
                continue
            model = self.model(m, seed, naive)
            sampler_name, sampler = self.sampler(model, T)
            gen_device = self.device if self.device.type == "cuda" else torch.device("cpu")
            generator = torch.Generator(device=gen_device).manual_seed(sp.seed)
            start = time.perf_counter()
            rows, calls = [], None
            for lo in range(0, sp.num_samples, sp.batch_size):
                size = min(sp.batch_size, sp.num_samples - lo)
                with torch.autocast(self.device.type, dtype=amp, enabled=amp != torch.float32):
                    out = generate(model, sampler, batch_size=size, seq_len=self.length(), num_steps=T,
                                   policy=self.refresh_policy(K), generator=generator, device=self.device)
                rows.extend(out.tokens.cpu().tolist())
                calls = out.layer_calls.as_dict()
            seconds = time.perf_counter() - start
            write_json(path, {"spec": spec, "sampler": sampler_name, "token_ids": rows,
                               "layer_calls_last_batch": calls, "seconds": seconds})
            self._ran(unit, seconds)

    # ---------------------------------------------------------------- 6. scoring
    def evaluator_spec(self, name: str) -> str:
        """The loadable spec of an evaluator name (the in-domain AR is the first seed of the AR model)."""
        if name == IN_DOMAIN_EVALUATOR:
            ar = next(m for m in self.cfg.models if m.kind == "ar")
            return str(self.layout.final_dir(ar.name, self.cfg.seeds_of(ar)[0]))
        return name

    def reference(self) -> tuple[list[str], Any]:
        from tadm.eval.gen_ppl import decode_samples
        from tadm.eval.likelihood import packed_eval_blocks

        sp = self.cfg.sampling
        assert sp.reference is not None
        blocks = packed_eval_blocks(sp.reference, self.tokenizer(), self.length(), cache_dir=self.cfg.data.cache_dir,
                                    split=sp.reference_split, val_fraction=self.cfg.data.val_fraction, seed=0)
        n = min(sp.num_samples, len(blocks))
        if n < sp.num_samples:
            self.log(f"[study] note: {sp.reference!r} ({sp.reference_split}) has only {n} blocks of {self.length()} "
                     f"tokens for {sp.num_samples} samples per cell")
        ids = blocks.get_batch(range(n))  # (n, L)
        return decode_samples(ids, self.tokenizer()), ids  # whole blocks, framing included, like the samples

    def score_all(self) -> None:
        from tadm.eval.entropy import mean_entropy
        from tadm.eval.evaluator import load_evaluator
        from tadm.eval.gen_ppl import decode_samples, gen_ppl
        from tadm.eval.mauve import mauve_from_features, mauve_sample_problem

        sp = self.cfg.sampling
        cells = self.sampling_cells()
        for ev_name in sp.evaluators:
            ev_spec = self.evaluator_spec(ev_name)
            use_mauve = sp.mauve and sp.reference is not None
            base_spec = {"evaluator": ev_spec, "reference": sp.reference, "reference_split": sp.reference_split,
                         "reference_blocks": "whole", "mauve": use_mauve, "mauve_min_samples": sp.mauve_min_samples}
            todo = []
            data_path = self.layout.score_file(ev_name, "data", None, None, None)
            data_spec = {**base_spec, "num_samples": sp.num_samples, "length": self.length()}
            need_data = sp.reference is not None and not _done(data_path, data_spec)
            for m, seed, naive, T, K in cells:
                spec = {**base_spec, "samples": self.sample_spec(m, seed, naive, T, K)}
                path = self.layout.score_file(ev_name, self.label(m, naive), seed, T, K)
                if _done(path, spec):
                    self._skip(f"score {ev_name} {self.label(m, naive)} seed {seed} T={T} K={K}")
                else:
                    todo.append((m, seed, naive, T, K, spec, path))
            if sp.reference is not None and not need_data:
                self._skip(f"score {ev_name} data")
            if not todo and not need_data:
                continue
            self.log(f"[study] loading evaluator {ev_name} ({ev_spec})")
            evaluator = load_evaluator(ev_spec, device=self.device)
            ref_features = None
            if sp.reference is not None:
                ref_texts, ref_ids = self.reference()
                start = time.perf_counter()
                ref = gen_ppl(ref_texts, evaluator, batch_size=sp.eval_batch_size, features=use_mauve,
                              progress=self.progress)
                ref_features = ref.features
                if need_data:
                    write_json(data_path, {"spec": data_spec, "gen_ppl": ref.gen_ppl, "gen_ppl_nll": ref.nll,
                                            "gen_ppl_tokens": ref.num_tokens, "entropy": mean_entropy(ref_ids),
                                            "num_texts": len(ref_texts)})
                    self._ran(f"score {ev_name} data", time.perf_counter() - start)
            for m, seed, naive, T, K, spec, path in todo:
                start = time.perf_counter()
                saved = read_json(self.layout.sample_file(self.label(m, naive), seed, T, K))
                ids = saved["token_ids"]
                texts = decode_samples(ids, self.tokenizer())
                want_features = ref_features is not None and use_mauve
                ppl = gen_ppl(texts, evaluator, batch_size=sp.eval_batch_size, features=want_features,
                              progress=self.progress)
                record: dict[str, Any] = {"spec": spec, "gen_ppl": ppl.gen_ppl, "gen_ppl_nll": ppl.nll,
                                          "gen_ppl_tokens": ppl.num_tokens, "entropy": mean_entropy(ids),
                                          "mauve": None, "mauve_num_samples": None, "mauve_num_reference": None,
                                          "mauve_buckets": None, "mauve_note": None}
                if want_features:
                    n_ref = len(ref_features)
                    record.update(mauve_num_samples=len(texts), mauve_num_reference=n_ref)
                    problem = mauve_sample_problem(len(texts), n_ref, sp.mauve_min_samples)
                    if problem is None:
                        result = mauve_from_features(ref_features, ppl.features, min_samples=sp.mauve_min_samples)
                        record.update(mauve=result.mauve, mauve_buckets=result.num_buckets)
                    else:
                        record["mauve_note"] = problem
                write_json(path, record)
                self._ran(f"score {ev_name} {self.label(m, naive)} seed {seed} T={T} K={K}",
                          time.perf_counter() - start)

    # ---------------------------------------------------------------- 7. throughput
    def time_all(self) -> None:
        from tadm.eval.throughput import TimingCell, interleaved_throughput

        sp = self.cfg.sampling
        if sp.throughput_generations == 0:
            return
        cells = self.sampling_cells()
        spec = {"cells": [[self.label(m, n), s, T, K] for m, s, n, T, K in cells],
                "samples": [self.sample_spec(m, s, n, T, K) | {"num_samples": None, "batch_size": None}
                            for m, s, n, T, K in cells],
                "generations": sp.throughput_generations, "warmup": sp.throughput_warmup,
                "batch_size": sp.throughput_batch_size, "device": str(self.device)}
        if _done(self.layout.throughput_file, spec):
            self._skip("throughput")
            return
        timing = []
        for m, seed, naive, T, K in cells:
            model = self.model(m, seed, naive)
            timing.append(TimingCell(
                key=(self.label(m, naive), seed, T, K), model=model, seq_len=self.length(), num_steps=T,
                policy=self.refresh_policy(K), make_sampler=lambda model=model, T=T: self.sampler(model, T)[1]))
        self.log(f"[study] timing {len(timing)} cells interleaved: {sp.throughput_warmup} warm-up + "
                 f"{sp.throughput_generations} timed generations of batch {sp.throughput_batch_size} each")
        start = time.perf_counter()
        results = interleaved_throughput(timing, num_generations=sp.throughput_generations,
                                         warmup=sp.throughput_warmup, batch_size=sp.throughput_batch_size,
                                         dtype=sp.dtype, device=self.device, seed=sp.seed, progress=self.progress)
        rows = [{"model": key[0], "seed": key[1], "steps": key[2], "refresh": key[3], **r.as_dict()}
                for key, r in results.items()]
        write_json(self.layout.throughput_file, {"spec": spec, "rows": rows,
                                                  "torch_threads": torch.get_num_threads()})
        self._ran("throughput", time.perf_counter() - start)


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
    layout = study.layout
    prepare_run_dir(layout.root, what="study out_dir")
    with RunDirLock(layout.root, what="study out_dir"):
        return _run_locked(study, cfg, log, stages, command, start)


def _run_locked(study: _Study, cfg: StudyConfig, log: Callable[[str], None], stages: tuple[str, ...],
                command: str | None, start: float) -> StudyOutput:
    """The stages of :func:`run_study`, with the study directory locked."""
    from tadm.study.report import write_report

    layout = study.layout
    manifest = read_json(layout.manifest) or {}
    history = list(manifest.get("invocations", []))
    invocation = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command, "stages": list(stages),
                  "machine": machine_info(), **git_commit()}
    write_json(layout.manifest, {"config": cfg.to_dict(), "invocations": history + [invocation]})
    timings: dict[str, float] = {}
    for stage, fn in (("train", study.train_all), ("likelihood", study.evaluate_likelihoods),
                      ("sample", study.sample_all), ("score", study.score_all), ("throughput", study.time_all)):
        if stage in stages:
            t0 = time.perf_counter()
            fn()
            timings[stage] = time.perf_counter() - t0
            # recorded after every stage, so an invocation cut off later still counts what it finished
            invocation["seconds"] = {**timings, "total": time.perf_counter() - start}
            write_json(layout.manifest, {"config": cfg.to_dict(), "invocations": history + [invocation]})
    invocation["seconds"] = {**timings, "total": time.perf_counter() - start}
    invocation["ran"], invocation["skipped"] = len(study.out.ran), len(study.out.skipped)
    write_json(layout.manifest, {"config": cfg.to_dict(), "invocations": history + [invocation]})
    if "report" in stages:
        study.out.files = write_report(cfg, layout, log=log)
    study.out.seconds = time.perf_counter() - start
    return study.out
