"""``tadm eval tasks``: the post-training table and the naive-reuse comparison (sec. "TADM:Post-train").

A run is benchmarks x methods x K x seeds. Methods, with a post-training base (``base``):

* ``baseline`` - the base itself (DiffusionGemma in the paper's table): K = 1 with the fusion off, so
  the anchor is recomputed at every step and read as is, which is the unmodified backbone;
* ``tadm`` - the base with its fusion adapter at each K (needs ``adapter``);
* ``naive`` - naive reuse of the stale anchor, fusion off, at each K (with ``naive``).

With one of tadm's own models (``model``) every row is ``tadm`` at each K (K = 1 recomputes the
anchor at every step). One model is loaded per base/adapter pair; every K, seed and the naive
switch reuse it through the generators' ``with_settings``.

K is any refresh spec (``2``, ``adaptive:tau=0.3``; :func:`tadm.sampling.refresh.parse_refresh`).
Each (task, method, K, seed) *unit* writes ``OUT/units/<task>/<method>-K<key>-seed<S>.json`` through
the shared :class:`~tadm.records.UnitStore`, holding its spec (model, data hash, settings), every
prompt, response and check, the accuracy and the generation stats. A later run skips units whose
file holds the same spec, so a cut-off run resumes.
With a judge, each unit's corruption is written beside it (``...judge.json``, verdicts cached in
``OUT/judge-cache``). :mod:`tadm.tasks.task_tables` then writes the two tables.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tadm.records import UnitStore, git_commit, machine_info
from tadm.sampling.refresh import RefreshPolicy, parse_refresh, parse_refresh_list
from tadm.tasks import register_lm_eval_model
from tadm.tasks.benchmarks import Benchmark, build_prompt, parse_task_list, score, timed_out
from tadm.tasks.datasets import TaskData, load_task
from tadm.tasks.judge import DegenerationJudge, make_judge_client
from tadm.tasks.model_args import TadmModelArgs
from tadm.tasks.sandbox import (CodeLimits, code_execution_allowed, containment, not_allowed_message,
                                uncontained_message)
from tadm.tasks.task_tables import write_tables

__all__ = ["Method", "TaskRunConfig", "TaskRunResult", "methods", "run_tasks"]

Log = Callable[[str], None]
PAPER_CANVAS_LENGTH = 256  # the paper's canvas of a post-training base
# a --model's tokenizer is the one saved in or beside its checkpoint directory: there is no --tokenizer here
MODEL_TOKENIZER_HINT = ("--model takes the tokenizer saved in or beside a checkpoint directory, and a builder name "
                        "(random weights) has none; give a trained checkpoint directory")


@dataclass
class TaskRunConfig:
    """Everything a run needs; defaults are the paper's (three seeds, K = 1, 2, 3, T = 48, canvas 256)."""

    tasks: list[str] | str | None = None  # None: all six
    refresh: list[Any] = field(default_factory=lambda: [1, 2, 3])  # refresh specs
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    naive: bool = False
    base: str | None = None
    adapter: str | None = None
    model: str | None = None
    split: str | None = None  # "S:A" for a base without an adapter (an adapter fixes its own split)
    data_dir: str | None = None
    limit: int | None = None
    steps: int = 48
    canvas_length: int | None = None  # of a --base (None: the paper's 256); a --model samples at its own length
    max_gen_toks: int | None = None  # a cap on the benchmarks' generation lengths (None: the paper's)
    batch_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    judge: str | None = None  # None / "none", "local", "local:PATH", "local-free:PATH" or an http(s) URL
    judge_model: str | None = None
    judge_concurrency: int = 4
    code_timeout: float = 10.0
    code_memory_mb: int = 1024
    allow_code_execution: bool = False  # the opt-in to run model-written code (the environment can grant it)
    allow_uncontained_code: list[str] = field(default_factory=list)  # gaps of the code sandbox the user accepts
    out_dir: str = "tadm-tasks"

    def policies(self) -> list[RefreshPolicy]:
        return parse_refresh_list(list(self.refresh))

    def base_canvas_length(self) -> int | None:
        """The canvas length of a --base (the paper's 256 unless set); None for a --model (its own)."""
        return (self.canvas_length or PAPER_CANVAS_LENGTH) if self.base else None

    def code_limits(self) -> CodeLimits:
        return CodeLimits(self.code_timeout, self.code_memory_mb, self.allow_code_execution,
                          tuple(self.allow_uncontained_code))

    def check(self, log: Log | None = None) -> list[Benchmark]:
        """The benchmarks to run; a ValueError for settings that cannot run.

        Code benchmarks need the opt-in (:func:`~tadm.tasks.sandbox.code_execution_allowed`): named
        ones without it are an error; with no task list they are skipped, and ``log`` says so.
        """
        benches = parse_task_list(self.tasks)
        code = [b.name for b in benches if b.runs_code]
        limits = self.code_limits()
        if code and not code_execution_allowed(self.allow_code_execution):
            if self.tasks is not None:
                raise ValueError(not_allowed_message(f"{', '.join(code)} (its check)"))
            benches = [b for b in benches if not b.runs_code]
            if log is not None:
                log(f"skipped {', '.join(code)}: they run model-written code; add --allow-code-execution "
                    f"(or set TADM_ALLOW_CODE_EXEC=1) to run them in the sandbox")
        elif code and (gaps := uncontained_message(containment(), limits.allow_uncontained)) is not None:
            raise ValueError(f"{', '.join(code)}: {gaps}")
        runs_code = any(b.runs_code for b in benches)
        unused = [flag for flag, given in (("--code-timeout", self.code_timeout != TaskRunConfig.code_timeout),
                                           ("--allow-uncontained-code", bool(self.allow_uncontained_code))) if given]
        if unused and not runs_code:
            raise ValueError(f"{' and '.join(unused)} apply to the code tasks (humaneval, livecodebench), and this "
                             "run has none")
        judge = self.judge
        if judge not in (None, "", "none", "local", "local-free") and not judge.startswith(
                ("local:", "local-free:", "http://", "https://")):
            raise ValueError(f"unknown judge {judge!r}: use none, local, local:PATH, local-free:PATH, or an "
                             "http(s):// URL with --judge-model NAME")
        url = bool(judge) and judge.startswith(("http://", "https://"))
        if url and not self.judge_model:
            raise ValueError("--judge URL needs --judge-model (the model name the endpoint serves)")
        if self.judge_model and not url:
            raise ValueError(f"--judge-model names the model served at a --judge URL; --judge is {judge or 'none'!r}")
        if (self.model is None) == (self.base is None):
            raise ValueError("give exactly one of --base (a post-training base) and --model (a tadm model)")
        if self.model is not None and (self.adapter or self.naive or self.split or self.canvas_length is not None):
            raise ValueError("--adapter, --split, --naive and --canvas-length apply to a post-training base (--base)")
        if self.adapter is not None and self.split is not None:
            raise ValueError("give --adapter or --split, not both: an adapter fixes its own split")
        try:
            for policy in self.policies():
                policy.check_steps(self.steps)
        except ValueError as err:
            raise ValueError(f"K: {err}") from None
        if not self.seeds or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.seeds):
            raise ValueError(f"seeds must be a non-empty list of integers >= 0, got {self.seeds!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        return benches


@dataclass(frozen=True)
class Method:
    """A row family: ``name`` (baseline, tadm, naive) at a refresh ``policy``, on the adapter's model or not."""

    name: str
    policy: RefreshPolicy
    adapter: bool
    naive: bool = False

    @property
    def K(self) -> int | str:
        """The policy as rows record it: an int for a fixed interval K, else the policy's key."""
        return self.policy.record

    @property
    def key(self) -> str:
        return f"{self.name}-K{self.policy.key}"


def methods(cfg: TaskRunConfig) -> list[Method]:
    """The methods a run covers, in table order."""
    policies = cfg.policies()
    if cfg.model is not None:
        return [Method("tadm", p, False) for p in policies]
    has = cfg.adapter is not None
    rows = [Method("baseline", parse_refresh(1), has, naive=True)]  # a fresh anchor at every step: the base itself
    rows += [Method("tadm", p, True) for p in policies] if has else []
    rows += [Method("naive", p, has, naive=True) for p in policies] if cfg.naive else []
    return rows


# ------------------------------------------------------------------------------------------ units
def _data_hash(data: TaskData) -> str:
    payload = json.dumps([[asdict(e) for e in data.examples], [asdict(e) for e in data.shots]], sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def budget(cfg: TaskRunConfig, bench: Benchmark) -> int:
    """The generation length of ``bench`` (the paper's), capped by ``max_gen_toks``."""
    return min(bench.max_gen_toks, cfg.max_gen_toks) if cfg.max_gen_toks else bench.max_gen_toks


def unit_spec(cfg: TaskRunConfig, bench: Benchmark, data: TaskData, method: Method, seed: int) -> dict[str, Any]:
    """What a unit's result depends on; a stored result with another spec is recomputed."""
    return {"task": bench.name, "method": method.name, "K": method.K, "seed": seed, "base": cfg.base,
            "adapter": cfg.adapter if method.adapter else None, "split": cfg.split, "model": cfg.model,
            "steps": cfg.steps, "canvas_length": cfg.base_canvas_length(),
            "max_gen_toks": budget(cfg, bench), "batch_size": cfg.batch_size, "data": data.source,
            "data_sha": _data_hash(data), "examples": len(data.examples), "shots": len(data.shots),
            **({"code_timeout": cfg.code_timeout, "code_memory_mb": cfg.code_memory_mb} if bench.runs_code else {})}


# ------------------------------------------------------------------------------------- generation
@dataclass
class _Request:
    """The parts of an lm-eval ``Instance`` that :class:`~tadm.tasks.lm_eval_model.TadmLM` reads."""

    args: tuple[str, dict[str, Any]]
    task_name: str
    doc_id: int


def load_generator(cfg: TaskRunConfig, with_adapter: bool) -> Any:
    """The generator of ``cfg``'s base (with its adapter when ``with_adapter``) or of its own model."""
    args = TadmModelArgs.from_kwargs(model=cfg.model, base=cfg.base, adapter=cfg.adapter if with_adapter else None,
                                     split=None if with_adapter else cfg.split, steps=cfg.steps,
                                     canvas_length=cfg.base_canvas_length(),
                                     device=cfg.device, dtype=cfg.dtype)
    return args.load_generator(tokenizer_hint=MODEL_TOKENIZER_HINT)


def _generator_for(generator: Any, cfg: TaskRunConfig, method: Method) -> Any:
    settings = TadmModelArgs.from_kwargs(require_model=False, policy=method.policy, steps=cfg.steps,
                                         canvas_length=cfg.base_canvas_length()).settings()
    if cfg.base is not None:
        return generator.with_settings(settings, naive=method.naive)
    return generator.with_settings(settings)


def _contexts(lm: Any, prompts: list[str]) -> list[str]:
    """Prompts through the chat template, thinking off (paper: no-think), when the tokenizer has one."""
    if getattr(getattr(lm.generator, "tokenizer", None), "chat_template", None) is None:
        return prompts
    return [lm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]


def run_unit(generator: Any, cfg: TaskRunConfig, bench: Benchmark, data: TaskData, seed: int) -> dict[str, Any]:
    """Generate and check every example of ``data`` with ``generator`` and ``seed``."""
    tokens = budget(cfg, bench)
    # the lm-eval model class, so that one sampler path answers both harnesses (needs the tasks extra)
    lm = register_lm_eval_model()(generator=generator, seed=seed, batch_size=cfg.batch_size, max_gen_toks=tokens)
    prompts = [build_prompt(bench, ex, data.shots_for(ex)) for ex in data.examples]
    gen_kwargs = {"until": list(bench.until), "max_gen_toks": tokens}
    requests = [_Request((c, dict(gen_kwargs)), bench.name, n) for n, c in enumerate(_contexts(lm, prompts))]
    texts = lm.generate_until(requests, disable_tqdm=True)
    records = []
    for ex, prompt, text in zip(data.examples, prompts, texts):
        checked = score(bench, ex, text, limits=cfg.code_limits())
        records.append({"id": ex.id, "prompt": prompt, "response": text, "gold": ex.answer,
                        "correct": checked.correct, "extracted": checked.extracted, "detail": checked.detail})
    correct = sum(r["correct"] for r in records)
    return {"accuracy": correct / len(records), "correct": correct, "n": len(records),
            "stats": lm.summary(), "records": records}


@dataclass
class _Unit:
    bench: Benchmark
    data: TaskData
    method: Method
    seed: int
    spec: dict[str, Any]
    path: Path  # relative to the run's directory


def _units(cfg: TaskRunConfig, benches: list[Benchmark]) -> list[_Unit]:
    units = []
    for bench in benches:
        data = load_task(bench, cfg.data_dir, cfg.limit)
        for method in methods(cfg):
            for seed in cfg.seeds:
                units.append(_Unit(bench, data, method, seed, unit_spec(cfg, bench, data, method, seed),
                                   Path("units") / bench.name / f"{method.key}-seed{seed}.json"))
    return units


def _generate_all(cfg: TaskRunConfig, store: UnitStore, units: list[_Unit],
                  load: Callable[[TaskRunConfig, bool], Any], log: Log) -> int:
    """Run the units without a result of the same spec, one model load per base/adapter pair."""
    ran = 0
    for with_adapter in (False, True):
        todo = [u for u in units if u.method.adapter == with_adapter and not store.done(u.path, u.spec)]
        if not todo:
            continue
        register_lm_eval_model()  # without lm-eval, fail before a model load that may take minutes
        generator = load(cfg, with_adapter)
        for unit in todo:
            result = run_unit(_generator_for(generator, cfg, unit.method), cfg, unit.bench, unit.data, unit.seed)
            store.save(unit.path, unit.spec, result)
            cut = result["stats"].get("prompts_cut", 0)
            timeouts = sum(timed_out(r["detail"]) for r in result["records"])
            log(f"{unit.bench.name} {unit.method.key} seed {unit.seed}: accuracy {result['accuracy']:.3f} "
                f"({result['correct']}/{result['n']}), {result['stats']['tokens_per_second']:.1f} tok/s"
                + (f"; {cut} prompts cut to fit the canvas (lower --max-gen-toks to keep them whole)" if cut else "")
                + (f"; {timeouts} of {result['n']} programs timed out at --code-timeout {cfg.code_timeout:g} s: "
                   "the accuracy measures the time limit (raise --code-timeout)" if 2 * timeouts > result["n"] else ""))
            ran += 1
    return ran


def _judge_client(cfg: TaskRunConfig) -> Any:
    judge = cfg.judge
    if judge.startswith(("http://", "https://")):  # with a judge_model: TaskRunConfig.check
        return make_judge_client(url=judge, model=cfg.judge_model)
    return make_judge_client(judge)


DEFAULT_JUDGE_WARNING = ("the default local judge (SmolLM2-135M-Instruct) does not tell degenerate from clean text "
                         "(it flags every response of a labelled check; docs/results/judge-agreement-cpu.md): "
                         "its corruption numbers are not evidence")


def _judge_all(cfg: TaskRunConfig, store: UnitStore, units: list[_Unit], log: Log) -> str:
    """Corruption of each unit's responses (degeneration judge), written beside the unit's result; the judge's id."""
    judge = DegenerationJudge(_judge_client(cfg), cache_dir=store.path("judge-cache"),
                              concurrency=cfg.judge_concurrency)
    if cfg.judge in ("local", "local-free"):
        log(f"note: {DEFAULT_JUDGE_WARNING}")
    for unit in units:
        path = unit.path.with_suffix(".judge.json")
        spec = {"unit": unit.spec, "judge": judge.client.judge_id}
        if store.done(path, spec):
            continue
        records = store.load(unit.path)["records"]
        result = judge.evaluate([(r["prompt"], r["response"]) for r in records])
        store.save(path, spec, {"summary": result.summary.as_dict(), "verdicts": [v.as_dict() for v in result.verdicts]})
        log(f"{unit.bench.name} {unit.method.key} seed {unit.seed}: corruption {result.summary.corruption:.3f}")
    return judge.client.judge_id


@dataclass
class TaskRunResult:
    """The run's units (their stored payloads), how many ran now, and the files written."""

    units: list[dict[str, Any]]
    ran: int
    files: dict[str, Path]


def _payload(store: UnitStore, unit: _Unit) -> dict[str, Any]:
    stored = store.load(unit.path)
    judged = store.load(unit.path.with_suffix(".judge.json"))
    return {"task": unit.bench.name, "method": unit.method.name, "K": unit.method.K, "seed": unit.seed,
            "max_gen_toks": stored["spec"].get("max_gen_toks"),
            "accuracy": stored["accuracy"], "n": stored["n"], "stats": stored["stats"],
            "correct": [bool(r["correct"]) for r in stored["records"]],
            "timeouts": sum(timed_out(str(r.get("detail", ""))) for r in stored["records"]),
            "prompts": [r.get("prompt", r.get("id")) for r in stored["records"]],
            "judge": judged.get("summary") if judged is not None else None,
            "provenance": stored.get("provenance")}


def run_tasks(cfg: TaskRunConfig, *, load: Callable[[TaskRunConfig, bool], Any] | None = None,
              log: Log = print, command: str | None = None) -> TaskRunResult:
    """Run (or resume) every unit of ``cfg``, judge them if asked, and write the tables into ``out_dir``.

    ``load(cfg, with_adapter)`` returns a generator (default: :func:`load_generator`); tests pass a fake.
    ``command`` (the command line that runs this) is written with the machine, commit and wall time.
    """
    started = time.perf_counter()
    benches = cfg.check(log)
    store = UnitStore(Path(cfg.out_dir))
    units = _units(cfg, benches)
    ran = _generate_all(cfg, store, units, load or load_generator, log)
    judge_id = _judge_all(cfg, store, units, log) if cfg.judge not in (None, "", "none") else None
    payloads = [_payload(store, u) for u in units]
    home = str(Path.home())
    provenance = {"command": command, "machine": machine_info(), **git_commit(),
                  "judge": judge_id.replace(home, "~") if judge_id and home not in ("", "/") else judge_id,
                  "judge_note": DEFAULT_JUDGE_WARNING if cfg.judge in ("local", "local-free") else None,
                  "sandbox": containment().describe() if any(b.runs_code for b in benches) else None,
                  "wall_seconds": round(time.perf_counter() - started, 1)}
    files = write_tables(payloads, benches, methods(cfg), store.root, config=asdict(cfg), provenance=provenance)
    return TaskRunResult(payloads, ran, files)
