"""``tadm posttrain``: train a fusion adapter on a frozen base model, or sample with one.

    tadm posttrain train CONFIG [key=value ...]
    tadm posttrain plan CONFIG [key=value ...] [--inference-prompt N] [--json]
    tadm posttrain sample --base PATH [--adapter DIR] --prompt TEXT [-K 2] [--naive] [--json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from tadm import posttrain
from tadm.cli.common import (CLIError, config_parser, device_arg, dtype_arg, policy_from_args, positive_int,
                             read_text_file, refresh_arg, refresh_policy_args, seed_value, steps_arg)
from tadm.hf import load_hf_tokenizer
from tadm.posttrain.model import SplitSpec
from tadm.posttrain.plan import plan_posttrain
from tadm.posttrain.prompting import encode_prompts
from tadm.posttrain.config import load_posttrain_config
from tadm.posttrain.trainer import run_posttrain
from tadm.tasks.generation import BlockGenerator, GenerationSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "posttrain",
        help="TADM:Post-train: train a fusion adapter on a frozen base model, or sample with one",
        description="Post-train the paired-attention fusion of a split pretrained diffusion LM, or generate with it.",
    )
    actions = p.add_subparsers(dest="posttrain_command", required=True, metavar="ACTION")

    t = config_parser(
        actions, "train", preset="posttrain-diffusiongemma", overrides="train.max_steps=100 data.train_file=x.jsonl",
        help="train the fusion (run under torchrun for data parallelism)",
        description="Post-train a fusion adapter from a YAML preset (a file, or a shipped preset such as posttrain-tiny) plus key=value overrides.",
    )
    t.set_defaults(func=run_train)

    pl = config_parser(
        actions, "plan", preset="posttrain-diffusiongemma", overrides="train.micro_batch_size=2",
        help="parameter counts and GPU memory per process of a post-training config, without weights",
        description="Build the config's split model on the meta device (no weights, no memory, no download) and "
                    "estimate GPU memory per process for one training step and for inference at batch 1 and 8.",
    )
    pl.add_argument("--inference-prompt", type=positive_int, default=512, metavar="N",
                    help="prompt tokens of the inference rows (default: 512)")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(func=run_plan)

    _add_sample_parser(actions)


def _add_sample_parser(actions: argparse._SubParsersAction) -> None:
    """``tadm posttrain sample``: block-wise generation with a base and an optional adapter."""
    s = actions.add_parser(
        "sample",
        help="block-wise generation with anchor caching (Algorithms 1 and 2)",
        description="Generate after prompts with a base model, optionally with a post-trained adapter.",
    )
    s.add_argument("--base", required=True, help="base model directory or hub id")
    s.add_argument("--adapter", default=None, help="adapter directory written by 'tadm posttrain train'")
    s.add_argument("--backbone", default="diffusion-gemma", help="backbone kind of the base model")
    s.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --base)")
    s.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    s.add_argument("--prompt-file", default=None, help="a text file with one prompt per line")
    s.add_argument("--raw", action="store_true", help="encode prompts as plain text, without the chat template")
    refresh_arg(s, default=1)
    refresh_policy_args(s)
    steps_arg(s, default=48, help="denoising steps T per canvas (paper: 48)")
    s.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="generation budget (default 256); whole canvases are generated, so it is rounded up to a "
                        "multiple of the canvas length")
    s.add_argument("--canvas-length", type=positive_int, default=None, help="tokens per canvas (default: model's)")
    s.add_argument("--entropy-bound", type=float, default=None, help="eta of Algorithm 2 (default: 0.1)")
    s.add_argument("--temperature-max", type=float, default=None, help="tau at n = T (default: 0.8)")
    s.add_argument("--temperature-min", type=float, default=None, help="tau as n -> 0 (default: 0.4)")
    s.add_argument("--naive", action="store_true", help="naive reuse baseline: the denoiser reads the stale anchor")
    s.add_argument(
        "--split",
        default=None,
        metavar="SHARED,ANCHOR",
        help="layer split without an adapter (default 2,20; the rest are denoiser layers)",
    )
    s.add_argument("--no-self-conditioning", action="store_true")
    s.add_argument("--adaptive-stopping", action="store_true", help="stop a canvas once stable and confident")
    s.add_argument("--seed", type=seed_value, default=0)
    device_arg(s)
    dtype_arg(s, what="weights dtype")
    s.add_argument("--progress", action="store_true")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=run_sample)


def run_train(args: argparse.Namespace) -> int:
    config = load_posttrain_config(args.config, args.overrides)
    adapter = run_posttrain(config)
    print(f"adapter written to {adapter}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    config = load_posttrain_config(args.config, args.overrides)
    plan = plan_posttrain(config, inference_prompt=args.inference_prompt)
    if args.json:
        print(json.dumps({
            "base": plan.base, "architecture_from": plan.source, "total_parameters": plan.total_parameters,
            "backbone_parameters": plan.backbone_parameters, "trainable_parameters": plan.fusion_parameters,
            "split": dict(zip(("shared", "anchor", "denoiser"), plan.split)),
            "memory": [{"what": e.what, "bytes": e.items, "total_bytes": e.total} for e in plan.estimates]}))
        return 0
    print(plan.table())
    return 0


def _parse_split(text: str | None):
    if text is None:
        return None  # load_time_anchored's default split (2,20) unless an adapter fixes one
    try:
        shared, anchor = (int(v) for v in text.split(","))
    except ValueError:
        raise CLIError(f"--split expects SHARED,ANCHOR (two integers), got {text!r}") from None
    return SplitSpec(shared, anchor)


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file is not None:
        lines = [line for line in read_text_file("--prompt-file", args.prompt_file).splitlines() if line.strip()]
        if not lines:
            raise CLIError(f"--prompt-file {args.prompt_file} has no prompt: give one prompt per line")
        prompts += lines
    if not prompts:
        raise CLIError("give at least one --prompt or a --prompt-file")
    return prompts


def run_sample(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    if args.backbone != "diffusion-gemma":
        raise CLIError(f"--backbone {args.backbone} cannot encode a prompt: posttrain sample continues prompts of a "
                       "DiffusionGemma-class base ('diffusion-gemma'); sample tadm's own models with tadm sample")
    try:
        model, note = posttrain.load_time_anchored(args.base, adapter=args.adapter, split=_parse_split(args.split),
                                                   naive=args.naive, dtype=args.dtype, device=args.device)
    except ValueError as err:
        if args.adapter is None and args.split is None and "split" in str(err):
            raise CLIError(f"{err}: without --adapter the split is --split SHARED,ANCHOR (default 2,20, the paper's "
                           "for 30 layers); give one that fits this base") from None
        raise
    try:
        tokenizer = load_hf_tokenizer(args.tokenizer or args.base)
    except FileNotFoundError as err:
        if args.tokenizer is not None:
            raise
        raise CLIError(f"{err}: pass --tokenizer DIR, the base model's tokenizer") from None
    if not args.raw and not getattr(tokenizer, "chat_template", None):
        raise CLIError(f"the tokenizer of {args.tokenizer or args.base} has no chat template: pass --raw to encode "
                       "prompts as plain text, or --tokenizer DIR with a chat tokenizer")
    ids, mask = encode_prompts(tokenizer, prompts, chat=not args.raw,
                               vocab_size=model.config.text_config.vocab_size)
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    options = {"entropy_bound": args.entropy_bound, "temperature_max": args.temperature_max,
               "temperature_min": args.temperature_min}
    policy = policy_from_args(args)
    try:
        settings = GenerationSettings(policy=policy, steps=args.steps, canvas_length=args.canvas_length,
                                      sampler_options={k: v for k, v in options.items() if v is not None},
                                      self_conditioning=not args.no_self_conditioning,
                                      adaptive_stopping=args.adaptive_stopping)
        generator = BlockGenerator(model, tokenizer, settings, name=str(args.base))
    except ValueError as err:
        raise CLIError(str(err)) from None
    seed = torch.Generator(device=args.device).manual_seed(args.seed)
    out = generator.generate(rows, args.max_new_tokens, generator=seed, progress=args.progress)
    _print_samples(args, prompts, tokenizer, out, policy, note)
    return 0


def _print_samples(args: argparse.Namespace, prompts: list[str], tokenizer: Any, out: Any, policy: Any,
                   note: str | None) -> None:
    """The replies (cut at the end of the response) and the layer calls, as text or (``--json``) one JSON object."""
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in out.tokens]
    calls = out.layer_calls
    if args.json:
        print(json.dumps({
            "base": str(args.base), "adapter": args.adapter, "fusion_mode": "naive" if args.naive else "paired",
            "refresh": policy.key, "refresh_policy": policy.config(), "steps": args.steps, "seed": args.seed,
            "prompts": prompts, "texts": texts, "token_ids": out.tokens, "layer_calls": calls,
            "encoder_layer_calls": out.encoder_layer_calls, "seconds": out.seconds, "note": note,
        }))
        return
    if note:
        print(f"note: {note}")
    for n, (prompt, text) in enumerate(zip(prompts, texts)):
        print(f"--- sample {n}: {prompt!r} ---")
        print(text)
    print(
        f"layer calls: total={calls['total']} (shared={calls['shared']}, anchor={calls['anchor']}, "
        f"denoiser={calls['denoiser']}); anchor refreshes={calls['anchor_refreshes']}; {out.seconds:.2f}s"
    )
