"""Command-line entry point: ``tadm sample | compute`` (and more as the library grows)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from tadm.sampling.protocol import LayerSplit


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _nonnegative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


# ---------------------------------------------------------------------------------------------- compute
def _add_compute(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compute",
        help="analytic Transformer-layer calls of anchor-cache inference (paper Eq. 9 / Table 2)",
        description="Layer calls C = T (L_S + L_D) + ceil(T/K) L_A for one generation, normalised to a baseline.",
    )
    p.add_argument("--shared-layers", type=_nonnegative_int, default=0, metavar="N")
    p.add_argument("--anchor-layers", type=_nonnegative_int, required=True, metavar="N")
    p.add_argument("--denoiser-layers", type=_nonnegative_int, required=True, metavar="N")
    p.add_argument("--steps", type=_positive_int, nargs="+", required=True, metavar="T")
    p.add_argument("--refresh", type=_positive_int, nargs="+", default=[1], metavar="K")
    p.add_argument(
        "--baseline-layers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="normalise to an uncached N-layer model (paper: 12, MDLM); default: this split at K=1",
    )
    p.add_argument("--json", action="store_true", help="print JSON (one object for one (T, K), else a list)")
    p.set_defaults(func=_run_compute)


def _run_compute(args: argparse.Namespace) -> int:
    from tadm.eval.compute import compute_row

    split = LayerSplit(args.shared_layers, args.anchor_layers, args.denoiser_layers)
    rows = [
        compute_row("model", split, t, k, baseline_layers=args.baseline_layers)
        for t in args.steps
        for k in args.refresh
    ]
    if args.json:
        dicts = []
        for row in rows:
            d = row.as_dict()
            d.pop("name")
            d.update(shared_layers=split.shared, anchor_layers=split.anchor, denoiser_layers=split.denoiser)
            dicts.append(d)
        print(json.dumps(dicts[0] if len(dicts) == 1 else dicts))
        return 0
    print(f"layer split: shared={split.shared} anchor={split.anchor} denoiser={split.denoiser}")
    print(f"{'T':>6} {'K':>4} {'layer calls':>12} {'baseline':>10} {'relative':>9}")
    for row in rows:
        print(
            f"{row.num_steps:>6} {row.refresh_interval:>4} {row.layer_calls:>12} "
            f"{row.baseline_layer_calls:>10} {row.relative:>8.2f}x"
        )
    return 0


# ----------------------------------------------------------------------------------------------- sample
def _add_sample(sub: argparse._SubParsersAction) -> None:
    from tadm.sampling.registry import SAMPLERS

    p = sub.add_parser(
        "sample",
        help="generate text with anchor-cache inference (paper Algorithm 1)",
        description="Sample from a checkpoint directory or a model builder (random weights).",
    )
    p.add_argument("--model", default="tadm-tiny", help="checkpoint dir, hub name, or builder name (e.g. tadm-tiny)")
    p.add_argument("--sampler", default="mdlm", help=f"one of: {', '.join(sorted(SAMPLERS))}")
    p.add_argument("--steps", "-T", type=int, default=128, help="reverse steps T")
    p.add_argument("--refresh", "-K", type=int, default=1, help="anchor refresh interval K")
    p.add_argument("--length", "-L", type=int, default=None, help="tokens per sample (default: model maximum)")
    p.add_argument("--batch-size", "-B", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: sampler's)")
    p.add_argument("--eta", type=float, default=None, help="ReMDM remasking strength")
    p.add_argument("--schedule", default="loglinear", help="noise schedule: loglinear, linear, cosine")
    p.add_argument("--skip-unchanged", action="store_true", help="reuse the last prediction if the canvas is unchanged")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for decoding (default: the checkpoint's, if any)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--progress", action="store_true", help="show a progress bar over reverse steps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_sample)


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


def _run_sample(args: argparse.Namespace) -> int:
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
    kwargs = {"schedule": args.schedule}
    if args.top_p is not None:
        kwargs["top_p"] = args.top_p
    if args.eta is not None:
        if not args.sampler.startswith("remdm"):
            raise CLIError(f"--eta applies to ReMDM samplers, not {args.sampler!r}")
        kwargs["eta"] = args.eta
    sampler = get_sampler(args.sampler, mask_id, **kwargs)
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
        refresh_interval=args.refresh,
        generator=generator,
        device=args.device,
        skip_unchanged=args.skip_unchanged,
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
            "refresh": args.refresh,
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
        f"denoiser={calls.denoiser}); anchor refreshes={calls.anchor_refreshes}; "
        f"{out.seconds:.2f}s, {tokens_per_second:.1f} tokens/s"
    )
    return 0


# ------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tadm", description="Time-anchored diffusion language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_sample(sub)
    _add_compute(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError) as err:
        print(f"tadm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
