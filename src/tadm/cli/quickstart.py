"""``tadm quickstart``: train a small TADM on the bundled corpus, then sample it at K = 1, 2, 4, 8 and bound its
likelihood per K (the README's main command; what it prints is in the parser's description)."""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from tadm.cli.common import (CLIError, masked_samplers, nonnegative_int, output_dir, positive_int, refresh_arg,
                             refresh_policies, seed_value, steps_arg)
from tadm.config import ConfigError, load_config, preset_path
from tadm.eval.evaluator import load_evaluator
from tadm.eval.gen_ppl import gen_ppl
from tadm.eval.likelihood import CachedBoundResult, cached_process_nelbo, packed_eval_blocks
from tadm.nn import load_model
from tadm.sampling import build_sampler, generate
from tadm.sampling.refresh import parse_refresh
from tadm.training.data import load_texts
from tadm.training.tokenization import TextTokenizer
from tadm.training.trainer import build_training_model, train

PRESET = "tadm-brown-cpu"
QUICKSTART_FLAGS = {"train.out_dir": "--out", "data.source": "--source", "train.max_steps": "--train-steps"}
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quickstart",
        help="train a small TADM on the bundled Brown corpus and sample it at K = 1, 2, 4, 8",
        description=f"Train a small TADM (the {PRESET} preset) on the bundled Brown corpus, then sample it at "
                    "K = 1, 2, 4, 8. Training takes about five minutes on 2 CPU cores. It prints a table of measured "
                    "tokens/s, exact Transformer-layer calls, the likelihood bound of the cached reverse process on "
                    "held-out blocks (what a stale anchor costs) and quality proxies per refresh interval K, next "
                    "to the same model before training, then a sentence on what the table shows and sample text.",
    )
    p.add_argument("--out", type=output_dir, default="runs/quickstart", help="output directory, model in OUT/final (default: "
                                                            "runs/quickstart)")
    p.add_argument("--train-steps", type=positive_int, default=None, metavar="N",
                   help=f"training steps (default: the {PRESET} preset's)")
    p.add_argument("--source", default=None, help="train on another corpus (file, dir, .jsonl) instead of Brown")
    p.add_argument("--samples", type=positive_int, default=8, metavar="N", help="sequences generated per K (default: 8)")
    steps_arg(p, default=32, help="reverse steps T of the samples and of the bound (default: 32)")
    refresh_arg(p, many=True, default="1,2,4,8")
    p.add_argument("--bound-blocks", type=nonnegative_int, default=32, metavar="N",
                   help="held-out blocks the likelihood bound reads (default: 32, about a minute of CPU time; "
                        "0 skips it)")
    p.add_argument("--sampler", default="remdm-cap",
                   help=f"one of: {', '.join(masked_samplers())} (default: remdm-cap)")
    p.add_argument("--seed", type=seed_value, default=0, help="seed of sampling and of the untrained baseline (default: 0)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in OUT (done anyway when OUT holds a training state: a finished run is "
                        "sampled again without training)")
    p.set_defaults(func=run)


def _words(texts: Iterable[str]) -> Iterator[str]:
    return (w for text in texts for w in _WORD.findall(text.lower()))


def word_validity(texts: list[str], vocabulary: set[str]) -> float:
    """Share of the words in ``texts`` that occur in the training corpus (a cheap quality proxy)."""
    words = list(_words(texts))
    return sum(w in vocabulary for w in words) / max(len(words), 1)


def unigram_entropy(rows: list[list[int]]) -> float:
    """Mean per-sample unigram entropy of token ids, in nats (the paper's entropy metric)."""
    values = [-sum(c / len(row) * math.log(c / len(row)) for c in Counter(row).values()) for row in rows]
    return sum(values) / max(len(values), 1)


def _load_local_evaluator():
    """The prepared SmolLM2 evaluator if present (``tadm eval prepare-evaluator``), else None."""
    try:
        return load_evaluator()
    except (FileNotFoundError, ImportError):
        return None


def _sample_table(model, tokenizer, args, policies, vocabulary, label: str, evaluator=None) -> list[dict]:
    rows = []
    length = model.config.max_seq_len
    for n, policy in enumerate(policies):
        sampler = build_sampler(args.sampler, model)
        kwargs = dict(batch_size=args.samples, seq_len=length, num_steps=args.steps, policy=policy)
        generate(model, sampler, generator=torch.Generator().manual_seed(10_000 + n), **{**kwargs, "num_steps": 4})
        start = time.perf_counter()
        out = generate(model, sampler, generator=torch.Generator().manual_seed(args.seed), **kwargs)
        seconds = time.perf_counter() - start
        ids = out.tokens.tolist()
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
        rows.append(
            {
                "model": label,
                "K": policy.fixed_interval or policy.key,  # an int K for a fixed interval
                "tokens_per_s": out.tokens.numel() / seconds,
                "layer_calls": out.layer_calls.total,
                "anchor_refreshes": out.layer_calls.anchor_refreshes,
                "word_validity": word_validity(texts, vocabulary),
                "entropy": unigram_entropy(ids),
                "gen_ppl": gen_ppl(texts, evaluator).gen_ppl if evaluator is not None else None,
                "texts": texts,
                "shown": tokenizer.decode_until_eos(ids[0]),  # the first sample, up to its end-of-text token
            }
        )
    return rows


def _held_out_blocks(cfg: Any, tokenizer: Any, count: int) -> Any:
    """The validation split training held out (its packed blocks), or None when ``count`` is 0 or it has none."""
    if count == 0:
        return None
    try:
        return packed_eval_blocks(cfg.data.source, tokenizer, cfg.data.seq_len, cache_dir=cfg.data.cache_dir,
                                  split="val", val_fraction=cfg.data.val_fraction)
    except ValueError as err:  # a corpus too small to hold out a whole block
        print(f"no likelihood bound: {err}")
        return None


def _add_bounds(rows: list[dict], model: Any, untrained: Any, blocks: Any, args: argparse.Namespace
                ) -> CachedBoundResult:
    """Fill each row's ``bound``: the discrete-time bound (nats/token) of the cached reverse process of Algorithm 1 at
    the rows' T on the held-out ``blocks``; for the trained model at a fixed K also ``bound_increase`` over K = 1 and
    its standard error over blocks (``bound_se``), both as fractions of the K = 1 bound. Rows of other refresh
    policies get None: the bound is that of a fixed K. Returns the trained model's bounds."""
    fixed = sorted({r["K"] for r in rows if r["model"] == "trained" and isinstance(r["K"], int)} | {1})
    common = dict(num_steps=args.steps, max_blocks=args.bound_blocks, batch_size=16, seed=args.seed)
    trained = cached_process_nelbo(model, blocks, refresh_intervals=fixed, **common)
    before = cached_process_nelbo(untrained, blocks, refresh_intervals=(1,), **common)
    base = trained.bounds[1]
    for r in rows:
        r.update(bound=None, bound_increase=None, bound_se=None)
        if r["model"] == "untrained":
            r["bound"] = before.bounds[1]
        elif isinstance(r["K"], int):
            rise, error = trained.difference(r["K"])
            r.update(bound=trained.bounds[r["K"]], bound_increase=rise / base, bound_se=error / base)
    return trained


def bound_sentence(trained: CachedBoundResult, layer_calls: dict[Any, int]) -> str:
    """One sentence on what the bound column shows, decided by the numbers: whether the bound rises from K = 1 to the
    largest K by more than two standard errors (and by at least 0.005 %, what the table shows), and at every step
    between them by no less than minus two standard errors."""
    ks = sorted(trained.bounds)
    if len(ks) < 2:
        return ""
    top, base = ks[-1], trained.bounds[1]
    rise, error = trained.difference(top)
    steps = [trained.difference(b, a) for a, b in zip(ks, ks[1:])]
    where = (f"The likelihood bound (nats/token of the {trained.num_steps}-step cached reverse process on "
             f"{trained.num_sequences} held-out blocks; lower is better)")
    change = f"K = 1: {base:.3f}, K = {top}: {trained.bounds[top]:.3f}, {100 * rise / base:+.2f} % ± {100 * error / base:.2f}"
    calls = (f", while the layer calls fall from {layer_calls[1]} to {layer_calls[top]}"
             if 1 in layer_calls and top in layer_calls else "")
    if math.isnan(error):
        return f"{where}: {change} (one block gives no estimate of the noise)."
    if rise <= 2 * error or rise < 5e-5 * base:  # within the noise, or too small to show in the table's 0.01 %
        return f"{where} does not rise with K beyond its noise ({change}): this model makes little use of its anchor."
    every = all(step > -2 * step_error for step, step_error in steps)
    return (f"{where} rises with K{'' if every else ' overall, though not at every K beyond its noise'} ({change})"
            f"{calls}: reusing a stale anchor saves compute and costs likelihood.")


def _train(cfg: Any, resume: bool) -> Any:
    """:func:`train`, its config errors in the words of this command's flags rather than the preset's keys."""
    try:
        return train(cfg, resume=resume)
    except ConfigError as err:
        text = str(err)
        for key, flag in QUICKSTART_FLAGS.items():
            text = text.replace(key, flag)
        raise CLIError(text + ("; a run in --out continues with its own settings: choose another --out to change "
                               "them" if "cannot resume" in text else "")) from None


def _training_line(result: Any, seconds: float) -> str:
    """What training did (0 more steps when the run in --out was finished) and its best validation bound."""
    ran, val = result.step - result.start_step, result.best_val_nelbo
    done = f"trained {ran} steps" if ran == result.step else f"trained {ran} more steps ({result.step} in all)"
    bound = f"; validation NELBO {val:.3f} nats/token (perplexity bound {math.exp(val):.1f})" if val is not None else ""
    return f"{done} in {seconds / 60:.1f} min{bound}"


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    given = (("train.out_dir", out_dir), ("train.max_steps", args.train_steps), ("data.source", args.source))
    overrides = [f"{key}={value}" for key, value in given if value is not None]
    cfg = load_config(preset_path(PRESET), overrides)
    policies = refresh_policies(args)  # a bad -K or --sampler is reported before training, not after it
    masked = masked_samplers()
    if args.sampler not in masked:
        raise CLIError(f"--sampler {args.sampler!r}: quickstart samples a masked model; valid: {', '.join(masked)}")
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    print(f"[1/4] training {PRESET} for {cfg.train.max_steps} steps on {cfg.data.source!r} -> {out_dir}")
    result = _train(cfg, resume=args.resume or (out_dir / "training_state.pt").exists())
    train_seconds = time.perf_counter() - started

    print("[2/4] sampling the trained model and the same architecture before training")
    model = load_model(result.model_dir).eval()
    tokenizer = TextTokenizer.load(result.model_dir)
    vocabulary = set(_words(load_texts(cfg.data.source)))
    torch.manual_seed(args.seed)
    untrained = build_training_model(cfg, tokenizer).eval()
    evaluator = _load_local_evaluator()
    rows = _sample_table(untrained, tokenizer, args, [parse_refresh(1)], vocabulary, "untrained", evaluator)
    rows += _sample_table(model, tokenizer, args, policies, vocabulary, "trained", evaluator)

    blocks = _held_out_blocks(cfg, tokenizer, args.bound_blocks)
    bounds = None
    if blocks is not None:
        print(f"[3/4] the likelihood bound per K on {min(len(blocks), args.bound_blocks)} held-out blocks")
        bounds = _add_bounds(rows, model, untrained, blocks, args)

    print("[4/4] results")
    print(_training_line(result, train_seconds))
    print(f"sampler {args.sampler}, T = {args.steps}, {args.samples} x {model.config.max_seq_len} tokens per row")
    print("| model     |  K | tokens/s | layer calls | anchor refreshes |  bound | vs K = 1          | words in corpus "
          "| entropy | Gen PPL |")
    print("|-----------|---:|---------:|------------:|-----------------:|-------:|:------------------|----------------:"
          "|--------:|--------:|")
    for r in rows:
        ppl = f"{r['gen_ppl']:>7.0f}" if r["gen_ppl"] is not None else "    n/a"
        bound = f"{r['bound']:>6.3f}" if r.get("bound") is not None else "   n/a"
        rise = (f"{100 * r['bound_increase']:+.2f} % ± {100 * r['bound_se']:.2f}"
                if r.get("bound_increase") is not None and r["K"] != 1 else "")
        print(f"| {r['model']:<9} | {r['K']:>2} | {r['tokens_per_s']:>8.0f} | {r['layer_calls']:>11} | "
              f"{r['anchor_refreshes']:>16} | {bound} | {rise:<17} | {100 * r['word_validity']:>14.1f}% | "
              f"{r['entropy']:>7.2f} | {ppl} |")
    if bounds is not None:
        print(bound_sentence(bounds, {r["K"]: r["layer_calls"] for r in rows if r["model"] == "trained"}))
    if evaluator is None:
        print("(Gen PPL: `pip install -e '.[eval]' && tadm eval prepare-evaluator` once scores samples with SmolLM2-135M)")
    keys = [p.fixed_interval or p.key for p in policies]
    for r in rows:
        if r["model"] == "untrained" or r["K"] in (keys[0], keys[-1]):
            print(f"\n--- {r['model']}, K = {r['K']} ---\n{r['shown'][:600]}")
    summary = {
        "train_steps": result.step,
        "train_seconds": train_seconds,
        "best_val_nelbo": result.best_val_nelbo,
        "model_dir": str(result.model_dir),
        "sampler": args.sampler,
        "steps": args.steps,
        "rows": rows,
        "bound": None if bounds is None else {**bounds.as_dict(), "block_bounds": bounds.block_bounds},
        "total_seconds": time.perf_counter() - started,
    }
    (out_dir / "quickstart.json").write_text(json.dumps(summary, indent=2))
    print(f"\nmodel: {result.model_dir}   results: {out_dir / 'quickstart.json'}   "
          f"total {summary['total_seconds'] / 60:.1f} min")
    return 0
