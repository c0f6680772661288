"""``tadm sample``: generate with anchor-cache inference (Algorithm 1) from a checkpoint or a builder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tadm.cli.common import CLIError, fidelity_args, policy_from_args, refresh_policy_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tadm.sampling.registry import SAMPLERS

    p = sub.add_parser(
        "sample",
        help="generate text with anchor-cache inference (paper Algorithm 1)",
        description="Sample from a checkpoint directory or a model builder (random weights).",
    )
    p.add_argument("--model", default="tadm-tiny", help="checkpoint dir, hub name, or builder name (e.g. tadm-tiny)")
    p.add_argument("--sampler", default="mdlm", help=f"one of: {', '.join(sorted(SAMPLERS))}")
    p.add_argument("--steps", "-T", type=int, default=128, help="reverse steps T")
    p.add_argument("--refresh", "-K", type=int, default=1, help="anchor refresh interval K (fixed policy)")
    refresh_policy_args(p)
    p.add_argument("--length", "-L", type=int, default=None, help="tokens per sample (default: model maximum)")
    p.add_argument("--batch-size", "-B", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: sampler's)")
    p.add_argument("--eta", type=float, default=None, help="ReMDM remasking strength")
    p.add_argument("--schedule", default="loglinear", help="noise schedule: loglinear, linear, cosine")
    fidelity_args(p)
    p.add_argument("--skip-unchanged", action="store_true", help="reuse the last prediction if the canvas is unchanged")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for decoding (default: the checkpoint's, if any)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--progress", action="store_true", help="show a progress bar over reverse steps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _load_any_model(name_or_path: str):
    from tadm.nn import MODEL_BUILDERS, build_model, load_model

    if name_or_path in MODEL_BUILDERS:
        return build_model(name_or_path)
    path = Path(name_or_path)
    if path.exists():
        return load_model(path)
    if "/" in name_or_path and not name_or_path.startswith((".", "/")):
        return load_model(name_or_path)  # a hub id
    raise CLIError(
        f"--model {name_or_path!r} is neither a checkpoint directory nor a builder name "
        f"(builders: {', '.join(sorted(MODEL_BUILDERS))})"
    )


def _load_tokenizer(args: argparse.Namespace):
    candidate = args.tokenizer
    if candidate is None and Path(args.model).is_dir() and (Path(args.model) / "tokenizer.json").exists():
        candidate = args.model
    if candidate is None:
        return None
    from tadm.training.tokenization import TextTokenizer

    if not Path(candidate).exists():
        raise CLIError(f"--tokenizer {candidate!r}: no such directory")
    return TextTokenizer.load(candidate)


def run(args: argparse.Namespace) -> int:
    import torch

    from tadm.sampling import generate, get_sampler

    model = _load_any_model(args.model).to(args.device).eval()
    mask_id = model.mask_token_id
    if mask_id is None:
        raise CLIError(f"model {args.model!r} has no mask token: it is not a masked diffusion model")
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    length = args.length if args.length is not None else max_len
    if length is None:
        raise CLIError("--length is required for this model")
    if length < 1 or (max_len is not None and length > max_len):
        raise CLIError(f"--length {length} does not fit the model (1..{max_len})")
    kwargs = {"schedule": args.schedule, "nucleus": args.nucleus, "time_grid": args.time_grid}
    if args.top_p is not None:
        kwargs["top_p"] = args.top_p
    if args.eta is not None:
        if not args.sampler.startswith("remdm"):
            raise CLIError(f"--eta applies to ReMDM samplers, not {args.sampler!r}")
        kwargs["eta"] = args.eta
    sampler = get_sampler(args.sampler, mask_id, **kwargs)
    policy = policy_from_args(args)
    tokenizer = _load_tokenizer(args)
    if tokenizer is not None and tokenizer.vocab_size != model.vocab_size:
        raise CLIError(f"tokenizer vocabulary ({tokenizer.vocab_size}) != model vocabulary ({model.vocab_size})")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out = generate(
        model,
        sampler,
        batch_size=args.batch_size,
        seq_len=length,
        num_steps=args.steps,
        policy=policy,
        generator=generator,
        device=args.device,
        time_conditioned=bool(getattr(getattr(model, "config", None), "time_conditioning", False)),
        progress=args.progress,
    )
    ids = out.tokens.tolist()
    texts = [tokenizer.decode(row) for row in ids] if tokenizer is not None else None
    tokens_per_second = out.tokens.numel() / max(out.seconds, 1e-9)
    if args.json:
        record = {
            "model": args.model,
            "sampler": args.sampler,
            "steps": args.steps,
            "refresh": out.refresh_interval,
            "refresh_policy": policy.config(),
            "length": length,
            "batch_size": args.batch_size,
            "seed": args.seed,
            "token_ids": ids,
            "layer_calls": out.layer_calls.as_dict(),
            "refresh_steps": out.refresh_steps,
            "seconds": out.seconds,
            "tokens_per_second": tokens_per_second,
        }
        if texts is not None:
            record["texts"] = texts
        print(json.dumps(record))
        return 0
    for n, row in enumerate(texts if texts is not None else ids):
        print(f"--- sample {n} ---")
        print(row if texts is not None else " ".join(map(str, row)))
    calls = out.layer_calls
    print(
        f"layer calls: total={calls.total} (shared={calls.shared}, anchor={calls.anchor}, "
        f"denoiser={calls.denoiser}); anchor refreshes={calls.anchor_refreshes} ({out.policy}); "
        f"{out.seconds:.2f}s, {tokens_per_second:.1f} tokens/s"
    )
    return 0
