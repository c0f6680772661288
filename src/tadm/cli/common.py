"""Helpers shared by the ``tadm`` subcommands: argument types and the user-error exception."""

from __future__ import annotations

import argparse
from typing import Callable


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type accepting integers >= ``minimum``, with a message naming the bad value."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {number}")
        return number

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def positive_float(value: str) -> float:
    """An argparse type accepting finite numbers > 0 (NaN and inf are refused by name)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not (0 < number < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return number


def fidelity_args(p: argparse.ArgumentParser) -> None:
    """--nucleus and --time-grid: fidelity to the released ReMDM sampler (see tadm.sampling.remdm)."""
    from tadm.sampling.base import TIME_GRIDS
    from tadm.sampling.categorical import NUCLEUS_RULES

    p.add_argument("--nucleus", choices=NUCLEUS_RULES, default="released",
                   help="nucleus rule: 'released' (ReMDM code: cumulative mass <= p, plus the top-1; default) or "
                        "'standard' (also keeps the token crossing p)")
    p.add_argument("--time-grid", choices=TIME_GRIDS, default="paper",
                   help="'paper' (t = i/T, alpha from the schedule; default) or 'released' (ReMDM code: "
                        "t = linspace(1, 1e-5, T+1), alpha = 1 - t, final argmax call)")


def refresh_policy_args(p: argparse.ArgumentParser) -> None:
    """--refresh-policy and its parameters (tadm.sampling.refresh); -K/--refresh is the fixed policy's K."""
    from tadm.sampling.refresh import REFRESH_POLICIES

    p.add_argument("--refresh-policy", choices=tuple(REFRESH_POLICIES), default="fixed",
                   help="when to recompute the anchor: 'fixed' (every K steps, Algorithm 1; default), "
                        "'schedule' (at --refresh-steps) or 'adaptive' (when the canvas drifted by --tau)")
    p.add_argument("--refresh-steps", default=None, metavar="I,I,...",
                   help="schedule policy: comma-separated reverse step indices i that refresh (must include T)")
    p.add_argument("--tau", type=float, default=None,
                   help="adaptive policy: refresh when this share of canvas positions changed since the anchor")
    p.add_argument("--min-interval", type=positive_int, default=1, help="adaptive policy: fewest steps between refreshes")
    p.add_argument("--max-interval", type=positive_int, default=None, help="adaptive policy: most steps between refreshes")


def policy_from_args(args: argparse.Namespace):
    """The refresh policy named by ``refresh_policy_args`` (with -K/--refresh and --skip-unchanged)."""
    from tadm.sampling.refresh import get_refresh_policy

    name = args.refresh_policy
    skip = bool(getattr(args, "skip_unchanged", False))
    K = getattr(args, "refresh", 1)
    given = {flag for flag, value in (("--refresh-steps", args.refresh_steps), ("--tau", args.tau),
                                      ("--max-interval", args.max_interval)) if value is not None}
    if args.min_interval != 1:
        given.add("--min-interval")
    own = {"fixed": set(), "schedule": {"--refresh-steps"}, "adaptive": {"--tau", "--min-interval", "--max-interval"}}[name]
    if given - own:
        raise CLIError(f"{', '.join(sorted(given - own))} do(es) not apply to --refresh-policy {name}")
    if name != "fixed" and K != 1:
        raise CLIError(f"-K/--refresh {K} is the fixed policy's interval; --refresh-policy {name} does not use it")
    try:
        if name == "fixed":
            return get_refresh_policy("fixed", interval=K, skip_unchanged=skip)
        if name == "schedule":
            if args.refresh_steps is None:
                raise CLIError("--refresh-policy schedule needs --refresh-steps (e.g. --refresh-steps 128,120,96,64)")
            try:
                steps = [int(s) for s in args.refresh_steps.split(",") if s.strip()]
            except ValueError:
                raise CLIError(f"--refresh-steps {args.refresh_steps!r}: expected comma-separated integers") from None
            return get_refresh_policy("schedule", steps=steps, skip_unchanged=skip)
        if args.tau is None:
            raise CLIError("--refresh-policy adaptive needs --tau (a share of positions, e.g. 0.05)")
        return get_refresh_policy("adaptive", tau=args.tau, min_interval=args.min_interval,
                                  max_interval=args.max_interval, skip_unchanged=skip)
    except ValueError as error:
        raise CLIError(str(error)) from None


# ------------------------------------------------------------------------- flags shared by commands
def device_type(value: str) -> str:
    """An argparse type for --device: auto, cpu, cuda or cuda:N (see tadm.specs), checked against this machine."""
    from tadm.specs import resolve_device

    try:
        return str(resolve_device(value))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def dtype_type(value: str) -> str:
    """An argparse type for --dtype: auto, fp32, bf16, fp16 (or float32, bfloat16, float16)."""
    from tadm.specs import resolve_dtype

    try:
        resolve_dtype(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def device_arg(p: argparse.ArgumentParser) -> None:
    """--device, default auto (CUDA when available, else CPU)."""
    p.add_argument("--device", type=device_type, default="auto", metavar="DEVICE",
                   help="auto (default: CUDA when available, else CPU), cpu, cuda or cuda:N")


def dtype_arg(p: argparse.ArgumentParser, default: str = "auto", what: str = "dtype") -> None:
    """--dtype in tadm's one vocabulary."""
    p.add_argument("--dtype", type=dtype_type, default=default, metavar="DTYPE",
                   help=f"{what}: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16 (default: {default})")


def steps_arg(p: argparse.ArgumentParser, *, many: bool = False, **kwargs) -> None:
    """-T/--steps: reverse steps T (one, or a list with ``many``)."""
    kwargs.setdefault("help", "reverse steps T" + (" (one or more)" if many else ""))
    p.add_argument("-T", "--steps", type=positive_int, nargs="+" if many else None, metavar="T", **kwargs)


def refresh_arg(p: argparse.ArgumentParser, *, many: bool = False, **kwargs) -> None:
    """-K/--refresh: the fixed policy's anchor refresh interval K (one, or a list with ``many``)."""
    kwargs.setdefault("help", "anchor refresh interval K" + (" (one or more)" if many else " (fixed policy)"))
    p.add_argument("-K", "--refresh", type=positive_int, nargs="+" if many else None, metavar="K", **kwargs)


def sampler_args(p: argparse.ArgumentParser, default: str, *, names: tuple[str, ...] = ()) -> None:
    """--sampler and the masked samplers' options; unset options keep the sampler's defaults."""
    from tadm.sampling import SAMPLERS

    valid = names or tuple(sorted(name for name, entry in SAMPLERS.items() if entry.needs == "mask_id"))
    p.add_argument("--sampler", default=default, help=f"one of: {', '.join(valid)} (default: {default})")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: the sampler's)")
    p.add_argument("--eta", type=float, default=None, help="ReMDM remasking strength in [0, 1] (default: the sampler's)")
    p.add_argument("--schedule", default=None, help="noise schedule: loglinear, linear, cosine (default: loglinear)")
    fidelity_args(p)


def sampler_from_args(args: argparse.Namespace, name: str, model) -> object:
    """The sampler ``name`` for ``model`` with the options given on the command line (tadm.sampling.registry)."""
    from tadm.sampling import get_sampler

    options = {"top_p": args.top_p, "eta": args.eta, "schedule": args.schedule, "nucleus": args.nucleus,
               "time_grid": args.time_grid}
    given = {key: value for key, value in options.items() if value is not None}
    try:
        return get_sampler(name, model.mask_token_id, **given)
    except ValueError as err:
        flags = ", ".join(f"--{key.replace('_', '-')}" for key in given)
        raise CLIError(f"--sampler {name}: {err}" + (f" (given: {flags})" if flags else "")) from None
