"""``tadm sample``: generate with anchor-cache inference (Algorithm 1) from a checkpoint or a builder."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from tadm.cli.common import (CLIError, check_refresh_applies, device_arg, optional_tokenizer, policy_from_args,
                             positive_int, refresh_arg, refresh_policy_args, sampler_args, sampler_from_args,
                             seed_value, steps_arg)
from tadm.sampling import generate
from tadm.specs import resolve_model


RANDOM_MODEL = "tadm-tiny"  # what `tadm sample` without --model samples


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text with anchor-cache inference (paper Algorithm 1)",
        description="Sample from a checkpoint directory or a model builder (random weights), with --prompt after a "
                    "prompt. Prints each sample's text up to its first end-of-text token (token ids for a model "
                    "without a tokenizer), then the layer calls; --json prints the whole token ids and texts.",
    )
    p.add_argument("--model", default=None, help="checkpoint dir, Hub id, or builder name (e.g. tadm-tiny, random "
                                                 "weights); without it, a tadm-tiny with random weights, as a smoke test")
    sampler_args(p, default="mdlm")
    steps_arg(p, default=128)
    refresh_arg(p, default=1)
    refresh_policy_args(p)
    p.add_argument("--length", "-L", type=positive_int, default=None, help="tokens per sample (default: model maximum)")
    p.add_argument("--batch-size", "-B", type=positive_int, default=1)
    p.add_argument("--seed", type=seed_value, default=0)
    p.add_argument("--skip-unchanged", action="store_true", help="reuse the last prediction if the canvas is unchanged")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="generate after TEXT: tokenized with the model's tokenizer after BOS and kept at every step "
                        "(--length counts it)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for decoding (default: the checkpoint's, if any)")
    device_arg(p)
    p.add_argument("--progress", action="store_true", help="show a progress bar over reverse steps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _canvas_length(args: argparse.Namespace, model: Any) -> int:
    """``--length``, or the model's own; checked against the model, which must be a masked diffusion LM."""
    if model.mask_token_id is None:
        raise CLIError(f"model {args.model!r} has no mask token: it is not a masked diffusion model")
    max_len = model.max_seq_len
    length = args.length if args.length is not None else max_len
    if length < 1 or length > max_len:
        raise CLIError(f"--length {length} does not fit the model (1..{max_len})")
    return length


def _prompt_ids(args: argparse.Namespace, tokenizer: Any, length: int) -> list[int] | None:
    """``--prompt`` as the canvas's prefix, BOS first (a document starts so in training); None without one."""
    if args.prompt is None:
        return None
    if tokenizer is None:
        raise CLIError(f"--prompt needs the model's tokenizer, and model {args.model!r} has none saved with it: "
                       "pass --tokenizer DIR")
    ids = [tokenizer.bos_id, *tokenizer.encode(args.prompt)]
    if len(ids) >= length:
        raise CLIError(f"--prompt is {len(ids) - 1} tokens, which with BOS leaves nothing to generate in --length "
                       f"{length}: shorten it or give a larger --length")
    return ids


def run(args: argparse.Namespace) -> int:
    random_model = args.model is None
    args.model = RANDOM_MODEL if random_model else args.model
    model = resolve_model(args.model, device=args.device)
    length = _canvas_length(args, model)
    sampler = sampler_from_args(args, args.sampler, model)
    policy = policy_from_args(args)
    check_refresh_applies(model, [policy], args.model)
    saved = getattr(model, "tokenizer_dir", None)  # the tokenizer saved with the checkpoint, a Hub one's included
    tokenizer = optional_tokenizer(str(saved) if saved is not None else args.model, args.tokenizer)  # None: ids
    if tokenizer is not None and tokenizer.vocab_size != model.vocab_size:
        raise CLIError(f"tokenizer vocabulary ({tokenizer.vocab_size}) != model vocabulary ({model.vocab_size})")
    prefix = _prompt_ids(args, tokenizer, length)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    try:
        policy.check_steps(args.steps)
    except ValueError as err:
        raise CLIError(str(err)) from None
    if random_model:  # said once every input has been checked, so that an error stays one line
        print(f"tadm sample: no --model given: sampling {RANDOM_MODEL} with random weights (pass --model DIR for a "
              "trained one)", file=sys.stderr)
    out = generate(
        model,
        sampler,
        batch_size=args.batch_size,
        seq_len=length,
        num_steps=args.steps,
        policy=policy,
        generator=generator,
        device=args.device,
        progress=args.progress,
        prefix=prefix,
    )
    ids = out.tokens.tolist()
    texts = [tokenizer.decode(row) for row in ids] if tokenizer is not None else None  # all of it, as Gen PPL scores
    tokens_per_second = out.tokens.numel() / max(out.seconds, 1e-9)
    if args.json:
        record = {
            "model": args.model, "sampler": args.sampler, "steps": args.steps, "refresh": out.refresh_interval,
            "refresh_policy": policy.config(), "length": length, "batch_size": args.batch_size, "seed": args.seed,
            "token_ids": ids, "layer_calls": out.layer_calls.as_dict(), "refresh_steps": out.refresh_steps,
            "seconds": out.seconds, "tokens_per_second": tokens_per_second,
        }
        if texts is not None:
            record["texts"] = texts
        if prefix is not None:
            record.update(prompt=args.prompt, prompt_tokens=len(prefix))
        print(json.dumps(record))
        return 0
    for n, row in enumerate(ids):
        print(f"--- sample {n} ---")  # its text, prompt included, up to its first end-of-text token
        print(tokenizer.decode_until_eos(row) if tokenizer is not None else " ".join(map(str, row)))
    calls = out.layer_calls
    print(
        f"layer calls: total={calls.total} (shared={calls.shared}, anchor={calls.anchor}, "
        f"denoiser={calls.denoiser}); anchor refreshes={calls.anchor_refreshes} ({out.policy}); "
        f"{out.seconds:.2f}s, {tokens_per_second:.1f} tokens/s"
    )
    return 0
