"""Helpers shared by the ``tadm`` subcommands: argument types and the user-error exception."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any, Callable

from tadm.config import SEED_MAX
from tadm.devices import resolve_device, resolve_dtype
from tadm.sampling import SAMPLERS, build_sampler
from tadm.sampling.base import TIME_GRIDS
from tadm.sampling.categorical import NUCLEUS_RULES
from tadm.sampling.refresh import parse_refresh, parse_refresh_list
from tadm.specs import find_tokenizer, find_tokenizer_dir


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


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: one integer >= ``minimum`` or a comma list of them ("128", "32,128")."""
    check = int_at_least(minimum)

    def parse(value: str) -> list[int]:
        parts = [part.strip() for part in value.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r} (an empty item)")
        return [check(part) for part in parts]

    return parse


def seed_value(value: str) -> int:
    """An argparse type for a seed: an integer in [0, SEED_MAX] (numpy and faiss take no wider)."""
    number = int_at_least(0)(value)
    if number > SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be <= {SEED_MAX}, got {number}")
    return number


def seed_list(value: str) -> list[int]:
    """An argparse type: one seed or a comma list of them (see :func:`seed_value`)."""
    return [seed_value(str(number)) for number in int_list(0)(value)]


class FlatList(argparse.Action):
    """``nargs="+"`` of a list type, flattened: ``-T 32 128``, ``-T 32,128``, ``-T 32,64 128`` and ``-T 32 -T 128``
    all work (a repeated flag adds to the list; the first replaces the default)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, None)
        earlier = [] if earlier is None or earlier is self.default else list(earlier)
        merged = earlier + [v for value in values for v in value]
        twice = [str(v) for n, v in enumerate(merged) if v in merged[:n]]
        if twice and not hasattr(merged[0], "key"):  # refresh policies: parse_refresh_list names theirs
            raise argparse.ArgumentError(self, f"{', '.join(dict.fromkeys(twice))} is listed twice")
        setattr(namespace, self.dest, merged)


class RefreshList(FlatList):
    """:class:`FlatList` of refresh policies (``-K``) that keeps the texts given, so that flags which change
    every policy (``--skip-unchanged``) can tell what a spec set itself."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            parsed = [parse_refresh_list(value) for value in values]
        except ValueError as err:
            raise argparse.ArgumentError(self, str(err)) from None
        namespace.refresh_texts = [*getattr(namespace, "refresh_texts", []), *values]
        super().__call__(parser, namespace, parsed, option_string)


def positive_float(value: str) -> float:
    """An argparse type accepting finite numbers > 0 (NaN and inf are refused by name)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not (0 < number < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return number


def nonempty(value: str) -> str:
    """An argparse type for a path or name: an empty value (which would mean the current directory) is refused."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _output_path(value: str, directory: bool) -> str:
    """The checks of :func:`output_dir` (``directory``) or :func:`output_file` on ``value``."""
    nonempty(value)
    path = Path(value)
    if directory and path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is an existing file; give a directory")
    if not directory and path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a directory; give a file name")
    if any(parent.exists() and not parent.is_dir() for parent in path.parents):
        raise argparse.ArgumentTypeError(f"{value}: a parent of it is an existing file")
    return value


def output_dir(value: str) -> str:
    """An argparse type for an output directory: not empty, and neither it nor a parent an existing file."""
    return _output_path(value, directory=True)


def output_file(value: str) -> str:
    """An argparse type for a file to write: not empty, not an existing directory, and its parent not a file."""
    return _output_path(value, directory=False)


def iso_date(value: str) -> str:
    """An argparse type: a calendar date YYYY-MM-DD (kept as that string, which sorts as the date does)."""
    try:
        return datetime.date.fromisoformat(value).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date YYYY-MM-DD, got {value!r}") from None


def read_text_file(flag: str, path: str | Path) -> str:
    """The UTF-8 text of the file given as ``flag``; a missing path, a directory or a binary file is one line."""
    path = Path(path)
    if path.is_dir():
        raise CLIError(f"{flag} {path} is a directory; give a file")
    if not path.is_file():
        raise CLIError(f"{flag} {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CLIError(f"{flag} {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                       f"{err.start})") from None


def print_files(summary: str, files: dict[str, Any]) -> int:
    """Print what a run did, then one indented ``label: path`` line per file it wrote; exit status 0."""
    print(summary)
    for label, path in files.items():
        print(f"  {label}: {path}")
    return 0


def print_json(records: list[dict[str, Any]]) -> int:
    """Print one JSON object for one record, else a JSON list; exit status 0."""
    print(json.dumps(records[0] if len(records) == 1 else records))
    return 0


def optional_tokenizer(model: str | None, tokenizer: str | None) -> Any:
    """The tokenizer given by --tokenizer, else the saved one of checkpoint ``model``, else None (neither is there)."""
    if tokenizer is None and (model is None or find_tokenizer_dir(model) is None):
        return None
    return find_tokenizer(model, tokenizer)


def config_parser(sub: argparse._SubParsersAction, name: str, *, preset: str, overrides: str,
                  **parser_kwargs: Any) -> argparse.ArgumentParser:
    """Subcommand ``name`` that reads CONFIG (a YAML file or a shipped preset name) and dotted KEY=VALUE overrides."""
    p = sub.add_parser(name, **parser_kwargs)
    p.add_argument("config", help=f"YAML file or shipped preset name, e.g. {preset}")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=f"dotted config overrides, e.g. {overrides}")
    return p


def fidelity_args(p: argparse.ArgumentParser, *, unset: bool = False) -> None:
    """--nucleus and --time-grid: fidelity to the released ReMDM sampler (see tadm.sampling.remdm).

    ``unset``: default None, so a sampler without these options (entropy-bound) is not handed them.
    """
    p.add_argument("--nucleus", choices=NUCLEUS_RULES, default=None if unset else "released",
                   help="nucleus rule: 'released' (ReMDM code: cumulative mass <= p, plus the top-1; default) or "
                        "'standard' (also keeps the token crossing p)")
    p.add_argument("--time-grid", choices=TIME_GRIDS, default=None if unset else "paper",
                   help="'paper' (t = i/T, alpha from the schedule; default) or 'released' (ReMDM code: "
                        "t = linspace(1, 1e-5, T+1), alpha = 1 - t, final argmax call)")


def refresh_policy_args(p: argparse.ArgumentParser) -> None:
    """The long form of one refresh policy (``-K adaptive:tau=0.2`` is the short one): --refresh-policy and its
    parameters, turned into the same refresh spec by :func:`refresh_policies`."""
    p.add_argument("--refresh-policy", choices=("fixed", "schedule", "adaptive"), default=None,
                   help="when to recompute the anchor: 'fixed' (every K steps, Algorithm 1; default), "
                        "'schedule' (at --refresh-steps) or 'adaptive' (when the canvas drifted by --tau)")
    p.add_argument("--refresh-steps", default=None, metavar="I,I,...",
                   help="schedule policy: comma-separated reverse step indices i that refresh (must include T; "
                        "steps above T are never reached)")
    p.add_argument("--tau", type=float, default=None,
                   help="adaptive policy: refresh when this share of canvas positions changed since the anchor")
    p.add_argument("--min-interval", type=positive_int, default=1, help="adaptive policy: fewest steps between refreshes")
    p.add_argument("--max-interval", type=positive_int, default=None, help="adaptive policy: most steps between refreshes")


def _long_form(args: argparse.Namespace) -> str | None:
    """The refresh spec of the --refresh-policy flags, or None when they are not used."""
    name = getattr(args, "refresh_policy", None) or "fixed"
    unset = {"--refresh-steps": None, "--tau": None, "--min-interval": 1, "--max-interval": None}
    given = {flag for flag, default in unset.items() if getattr(args, flag[2:].replace("-", "_"), default) != default}
    own = {"fixed": set(), "schedule": {"--refresh-steps"}, "adaptive": {"--tau", "--min-interval", "--max-interval"}}[name]
    if given - own:
        raise CLIError(f"{', '.join(sorted(given - own))} do(es) not apply to --refresh-policy {name}")
    if name == "fixed":
        return None
    if name == "schedule":
        if args.refresh_steps is None:
            raise CLIError("--refresh-policy schedule needs --refresh-steps (e.g. --refresh-steps 128,120,96,64)")
        steps = [s.strip() for s in args.refresh_steps.split(",") if s.strip()]
        if not steps or not all(s.isdigit() for s in steps):
            raise CLIError(f"--refresh-steps: expected comma-separated integers (e.g. 128,120,96,64), "
                           f"got {args.refresh_steps!r}")
        return "schedule:steps=" + "/".join(steps)
    if args.tau is None:
        raise CLIError("--refresh-policy adaptive needs --tau (a share of positions, e.g. 0.05)")
    bound = f":max_interval={args.max_interval}" if args.max_interval is not None else ""
    return f"adaptive:tau={args.tau}:min_interval={args.min_interval}{bound}"


def refresh_policies(args: argparse.Namespace) -> list:
    """The refresh policies of -K/--refresh (each value one spec or a comma list; tadm.sampling.refresh), or of the
    --refresh-policy flags, with --skip-unchanged where a command has it."""
    given = list(args.refresh)
    keys = ",".join(p.key for p in given)
    if getattr(args, "refresh_policy", None) == "fixed" and any(p.name != "fixed" for p in given):
        raise CLIError(f"-K/--refresh {keys} and --refresh-policy fixed name two policies; give one")
    long_form = _long_form(args)
    if long_form is not None:
        if keys != "1":
            raise CLIError(f"-K/--refresh {keys} and --refresh-policy {args.refresh_policy} name two policies; "
                           f"give one (e.g. -K {long_form})")
        given = [parse_refresh(long_form)]
    try:
        if getattr(args, "skip_unchanged", False):
            both = next((text for text in getattr(args, "refresh_texts", []) if "skip_unchanged" in text), None)
            if both is not None:
                raise CLIError(f"--skip-unchanged and -K {both} both set skip_unchanged; give one")
            given = [parse_refresh({**p.config(), "skip_unchanged": True}) for p in given]
        return parse_refresh_list(given)
    except ValueError as error:
        raise CLIError(f"-K/--refresh: {error}") from None


def check_refresh_applies(model: Any, policies: list, name: str) -> None:
    """A CLIError when a masked model without an anchor network (MDLM: 0 anchor layers) is given a refresh policy
    other than K = 1: every policy would run the same layers, and their timings would differ by noise only.
    Skipping unchanged canvases (skip_unchanged) does change what runs, and is allowed."""
    if model.layer_split.anchor == 0 and any(p.key != "1" and not p.skip_unchanged for p in policies):
        raise CLIError(f"-K/--refresh: model {name!r} has no anchor network (0 anchor layers), so every refresh "
                       "policy runs the same layers; leave -K at 1")


def policy_from_args(args: argparse.Namespace):
    """The one refresh policy of a command that takes one (see :func:`refresh_policies`)."""
    policies = refresh_policies(args)
    if len(policies) != 1:
        raise CLIError(f"-K/--refresh: this command takes one refresh policy, got {', '.join(p.key for p in policies)}")
    return policies[0]


# ------------------------------------------------------------------------- flags shared by commands
def arg_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type that reports the ValueError of ``convert`` as a usage error (its message unchanged)."""

    def parse(value: str) -> Any:
        try:
            return convert(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _checked_dtype(value: str) -> str:
    resolve_dtype(value)
    return value


# --device: auto, cpu, cuda or cuda:N (see tadm.specs), checked against this machine;
# --dtype: auto, fp32, bf16, fp16 (or float32, bfloat16, float16), kept as given
device_type = arg_type(lambda value: str(resolve_device(value)))
dtype_type = arg_type(_checked_dtype)
# one refresh spec or a comma list of them (``4``, ``1,2,4``, ``adaptive:tau=0.3``)
refresh_specs = arg_type(parse_refresh_list)


def device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device_type, default="auto", metavar="DEVICE",
                   help="auto (default: CUDA when available, else CPU), cpu, cuda or cuda:N")


def dtype_arg(p: argparse.ArgumentParser, default: str = "auto", what: str = "dtype") -> None:
    p.add_argument("--dtype", type=dtype_type, default=default, metavar="DTYPE",
                   help=f"{what}: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16 (default: {default})")


def steps_arg(p: argparse.ArgumentParser, *, many: bool = False, **kwargs) -> None:
    """-T/--steps: reverse steps T (one, or with ``many`` a list: comma-separated or space-separated, like -K)."""
    kwargs.setdefault("help", "reverse steps T, comma-separated (e.g. 128,256)" if many else "reverse steps T")
    if many:
        p.add_argument("-T", "--steps", type=int_list(1), nargs="+", action=FlatList, metavar="T[,T]", **kwargs)
    else:
        p.add_argument("-T", "--steps", type=positive_int, metavar="T", **kwargs)


def refresh_arg(p: argparse.ArgumentParser, *, many: bool = False, default: str = "1", **kwargs) -> None:
    """-K/--refresh: refresh policies, the same syntax on every command: specs separated by commas (or spaces),
    each ``4``, ``fixed:K=4``, ``adaptive:tau=0.3[:max_interval=16]`` or ``schedule:steps=48/40/24``."""
    what = "refresh policies, comma-separated" if many else "the refresh policy (one)"
    kwargs.setdefault("help", f"{what}: K (e.g. 4), or adaptive:tau=0.3, schedule:steps=48/40/24 "
                              f"(default: {default})")
    p.add_argument("-K", "--refresh", nargs="+", action=RefreshList, default=refresh_specs(default),
                   metavar="K[,K]" if many else "K", **kwargs)


def masked_samplers() -> list[str]:
    """The registered samplers of masked models that read log-probabilities (what tadm's own models give), sorted.

    LLaDA's and Dream's samplers read raw logits and serve post-trained backbones instead.
    """
    return sorted(name for name, entry in SAMPLERS.items()
                  if entry.needs == "mask_id" and entry.sampler_class.consumes == "log_probs")


def sampler_args(p: argparse.ArgumentParser, default: str) -> None:
    """--sampler and the masked samplers' options; unset options keep the sampler's defaults."""
    valid = masked_samplers()
    p.add_argument("--sampler", default=default, help=f"one of: {', '.join(valid)} (default: {default})")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: the sampler's)")
    p.add_argument("--eta", type=float, default=None, help="ReMDM remasking strength in [0, 1] (default: the sampler's)")
    p.add_argument("--schedule", default=None, help="noise schedule: loglinear, linear, cosine (default: loglinear)")
    fidelity_args(p, unset=True)


def sampler_from_args(args: argparse.Namespace, name: str, model) -> object:
    """The sampler ``name`` for ``model`` with the options given on the command line (tadm.sampling.registry)."""
    options = {"top_p": args.top_p, "eta": args.eta, "schedule": args.schedule, "nucleus": args.nucleus,
               "time_grid": args.time_grid}
    given = {key: value for key, value in options.items() if value is not None}
    if given.get("time_grid") == "released" and "schedule" in given:
        raise CLIError("--schedule has no effect with --time-grid released (its alpha is 1 - t)")
    try:
        return build_sampler(name, model, **given)
    except ValueError as err:
        flags = ", ".join(f"--{key.replace('_', '-')}" for key in given)
        raise CLIError(f"--sampler {name}: {err}" + (f" (given: {flags})" if flags else "")) from None
