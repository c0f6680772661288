"""Experiment configuration: dataclass schemas, YAML presets, dotted overrides, strict validation.

Only entry points (the CLI, the trainer) see an ``ExperimentConfig``; components take their own
typed arguments. A preset is a YAML file with any subset of the sections below; ``load_config``
merges it onto the defaults, then applies ``key=value`` overrides (``train.max_steps=200``).
Unknown keys and values of the wrong type raise ``ConfigError`` naming the key.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

ARCHITECTURES = ("tadm", "mdlm", "adlm", "ar")
MODEL_PRESETS = ("tiny", "small")
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


@dataclass
class ModelSection:
    """Which network to train: ``arch``-``preset`` builder plus field overrides of its config."""

    arch: str = "tadm"
    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataSection:
    """Corpus, tokenizer and packing (see ``tadm.training.data``)."""

    source: str = "brown"  # the bundled corpus, a file/dir/.jsonl, or a datasets name
    text_field: str = "text"
    tokenizer: str = "bpe"  # "bpe" (trained on the corpus), "gpt2", or a tokenizer directory
    tokenizer_vocab_size: int = 4096  # for "bpe"
    seq_len: int = 128
    val_fraction: float = 0.02
    cache_dir: str = ".tadm-cache"


@dataclass
class ObjectiveSection:
    """Noise schedule, time sampling and the T-ANELBO's stale-anchor settings (appendix "TADM:Pretrain")."""

    schedule: str = "loglinear"
    eps: float = 1e-3
    antithetic: bool = True
    gamma: float = 0.0  # anchor supervision weight: 0 = TADM-dagger, 3e-3 = TADM-double-dagger
    refresh_intervals: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    step_budgets: list[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048, 4096])
    # ADLM only: anchor targets are the "rare" tokens, i.e. those outside the most frequent ids that
    # together make up this share of the training tokens (see tadm.training.objectives.rare_token_mask).
    anchor_common_mass: float = 0.5


@dataclass
class OptimSection:
    """AdamW and the learning-rate schedule (paper: lr 3e-4, betas (0.9, 0.999), no weight decay)."""

    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 2500
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


# Where training metrics go (tadm.training.metrics.MetricsLogger); metrics.jsonl is always written.
LOGGERS = ("jsonl", "tensorboard", "wandb")


@dataclass
class TrainSection:
    """Loop length, batching, logging, checkpointing, EMA, precision and seed.

    ``micro_batch_size`` left unset (``None``) is derived from the world size: each of the ``W``
    ranks takes ``global_batch_size / W`` sequences per step in one micro-batch (no gradient
    accumulation), so ``torchrun --nproc_per_node=W`` runs any preset whose global batch ``W``
    divides. An explicit value is kept as given: accumulation = global / (micro * W), which must
    be a whole number.

    Validation scores ``eval_batches`` batches of ``eval_batch_size`` held-out blocks (unset:
    ``global_batch_size``), batch ``i`` with its own seeded noise, so the same weights give the
    same validation NELBO whatever the world size and micro-batch size. A batch larger than the
    micro-batch is scored in micro-batch pieces (its noise drawn for the whole batch), which
    bounds memory without changing the number.

    ``loggers`` names where metrics go, any of :data:`LOGGERS`: ``jsonl`` (``out_dir/metrics.jsonl``,
    the source of truth, written whether listed or not), ``tensorboard`` (``out_dir/tensorboard``
    event files) and ``wandb`` (Weights & Biases, run files in ``out_dir/wandb``; project
    ``wandb_project``, mode from ``WANDB_MODE``). A missing optional package is a warning, not an
    error. The older ``tensorboard: true`` is read as ``"tensorboard"`` added to ``loggers``.
    """

    max_steps: int = 1000
    global_batch_size: int = 32
    micro_batch_size: Optional[int] = None  # per device; None: global / world size, no accumulation
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    eval_batch_size: Optional[int] = None  # blocks per validation batch; None: global_batch_size
    save_every: int = 500
    ema: float = 0.9999  # 0 disables EMA (evaluate and save the raw weights)
    seed: int = 0
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    out_dir: str = "runs/tadm"
    overwrite: bool = False  # start afresh in an out_dir that already holds a run
    save_best: bool = False  # also save the EMA model with the best validation NELBO to out_dir/best
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # any of LOGGERS; jsonl is always written
    wandb_project: str = "tadm"
    tensorboard: bool = False  # older spelling of "tensorboard" in loggers; moved there on load

    def __post_init__(self) -> None:
        if self.tensorboard:
            if "tensorboard" not in self.loggers:
                self.loggers = [*self.loggers, "tensorboard"]
            self.tensorboard = False


class RecipeConfig:
    """The root of a recipe's config (a dataclass of sections), saved as a plain dict beside its results."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ExperimentConfig(RecipeConfig):
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)


def _keys(schema: type) -> str:
    """The keys of a config section, in schema order: ``arch, preset, overrides``."""
    return ", ".join(f.name for f in fields(schema))


def config_error(err: OmegaConfBaseException, origin: str, error: type[ConfigError] = ConfigError) -> ConfigError:
    """One line naming the key (or ``origin``) of an OmegaConf error, as ``error``; an unknown key also gets the
    keys its section has."""
    key = getattr(err, "full_key", None)
    schema = getattr(err, "object_type", None)
    if isinstance(err, ConfigKeyError) and key and is_dataclass(schema):
        shown = key if len(key) <= 60 else key[:57] + "..."
        section = f"section '{key.rpartition('.')[0]}'" if "." in key else "the config"
        return error(f"{origin}: unknown key '{shown}'; {section} has: {_keys(schema)}")
    first = str(err).splitlines()[0]
    empty = re.match(r"Incompatible value 'None' for field of type '(\w+)'", first)
    if empty and key:  # `key=` in an override, or `key:` in a file
        return error(f"{origin}: {key} is empty; it needs a value of type {empty.group(1)}")
    where = f" (key '{key}')" if key else ""
    return error(f"{origin}: {first}{where}")


def _range_text(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
    error: type[ConfigError] = ConfigError,
) -> None:
    """Raise ``error`` unless ``value`` is a finite number within the bounds (NaN and inf never are).

    The message names the key, the valid range and the value, e.g. ``optim.lr must be a finite
    number > 0, got nan``; ``note`` is appended (e.g. "(0 disables clipping)").
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        note = f" {note}" if note else ""
        bounds = _range_text(low, high, low_open, high_open)
        raise error(f"{name} must be a finite number{' ' + bounds if bounds else ''}{note}, got {value}")


SEED_MAX = 2**32 - 1  # the widest range numpy's and faiss's seeds take (torch's is wider)


def check_seed(name: str, value: int, *, error: type[ConfigError] = ConfigError) -> None:
    """A seed is an integer in [0, :data:`SEED_MAX`]."""
    if not 0 <= value <= SEED_MAX:
        raise error(f"{name} must be an integer in [0, {SEED_MAX}], got {value}")


def _positive_int(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value}")


BPE_MIN_VOCAB = 258  # a byte-level BPE's 256 byte symbols, <|endoftext|> and <|mask|>


def _validate_data(data: DataSection) -> None:
    _positive_int("data.seq_len", data.seq_len)
    if data.tokenizer == "bpe" and data.tokenizer_vocab_size < BPE_MIN_VOCAB:
        raise ConfigError(f"data.tokenizer_vocab_size must be >= {BPE_MIN_VOCAB} for data.tokenizer=bpe (256 byte "
                          f"symbols, <|endoftext|> and <|mask|>), got {data.tokenizer_vocab_size}")
    check_range("data.val_fraction", data.val_fraction, 0, 1, low_open=True, high_open=True)


def _validate_objective(objective: ObjectiveSection) -> None:
    check_range("objective.gamma", objective.gamma, 0)
    check_range("objective.eps", objective.eps, 0, 1, low_open=True, high_open=True)
    check_range("objective.anchor_common_mass", objective.anchor_common_mass, 0, 1, low_open=True)
    for name in ("refresh_intervals", "step_budgets"):
        values = getattr(objective, name)
        if not values or any(v < 1 for v in values):
            raise ConfigError(f"objective.{name} must be a non-empty list of integers >= 1, got {list(values)}")


def validate_optim(optim: OptimSection, *, error: type[ConfigError] = ConfigError) -> None:
    """Every value of an optimiser section finite and in range (shared by pretraining and post-training)."""
    check_range("optim.lr", optim.lr, 0, low_open=True, error=error)
    if len(optim.betas) != 2:
        raise error(f"optim.betas must be two numbers in [0, 1), got {list(optim.betas)}")
    for i, beta in enumerate(optim.betas):
        check_range(f"optim.betas[{i}]", beta, 0, 1, high_open=True, error=error)
    check_range("optim.eps", optim.eps, 0, low_open=True, error=error)
    if optim.lr_schedule not in ("constant", "cosine"):
        raise error(f"optim.lr_schedule {optim.lr_schedule!r} is unknown; valid: constant, cosine")
    if optim.warmup_steps < 0:
        raise error(f"optim.warmup_steps must be >= 0, got {optim.warmup_steps}")
    check_range("optim.min_lr_ratio", optim.min_lr_ratio, 0, 1, error=error)
    check_range("optim.grad_clip", optim.grad_clip, 0, note="(0 disables clipping)", error=error)
    check_range("optim.weight_decay", optim.weight_decay, 0, error=error)


def check_loggers(name: str, loggers: Sequence[str], *, error: type[ConfigError] = ConfigError) -> None:
    """Every entry of ``loggers`` (the key ``name``) one of :data:`LOGGERS` (shared with post-training)."""
    unknown = [str(n) for n in loggers if n not in LOGGERS]
    if unknown:
        raise error(f"{name} has unknown logger(s) {', '.join(map(repr, unknown))}; valid: {', '.join(LOGGERS)}")


def _validate_train(train: TrainSection) -> None:
    for name in ("max_steps", "global_batch_size", "log_every", "eval_every", "eval_batches", "save_every"):
        _positive_int(f"train.{name}", getattr(train, name))
    if train.eval_batch_size is not None:  # None: train.global_batch_size
        _positive_int("train.eval_batch_size", train.eval_batch_size)
    if train.micro_batch_size is not None:  # None: derived from the world size when the run starts
        _positive_int("train.micro_batch_size", train.micro_batch_size)
        if train.global_batch_size % train.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size ({train.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size ({train.micro_batch_size})"
            )
    check_loggers("train.loggers", train.loggers)
    check_seed("train.seed", train.seed)
    if not train.wandb_project.strip():
        raise ConfigError("train.wandb_project must not be empty")
    check_range("train.ema", train.ema, 0, 1, high_open=True, note="(0 disables EMA)")
    if train.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision {train.precision!r} is unknown; valid: auto, fp32, bf16")
    device = train.device
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ConfigError(f"train.device {device!r} is unknown; valid: auto, cpu, cuda, cuda:N")
    if not train.out_dir.strip():
        raise ConfigError("train.out_dir must not be empty")


def validate_experiment_config(cfg: ExperimentConfig) -> None:
    """Every section's values: names, ranges (finite numbers only) and settings that must fit together."""
    if cfg.model.arch not in ARCHITECTURES:
        raise ConfigError(f"model.arch {cfg.model.arch!r} is unknown; valid: {', '.join(ARCHITECTURES)}")
    if cfg.model.preset not in MODEL_PRESETS:
        raise ConfigError(f"model.preset {cfg.model.preset!r} is unknown; valid: {', '.join(MODEL_PRESETS)}")
    _validate_data(cfg.data)
    _validate_objective(cfg.objective)
    validate_optim(cfg.optim)
    _validate_train(cfg.train)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "overrides":
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _same(saved: Any, current: Any) -> bool:
    """Equal values; two spellings of one existing file or directory (relative, absolute) count as equal."""
    if saved == current:
        return True
    paths = [Path(v) for v in (saved, current) if isinstance(v, str) and v and Path(v).exists()]
    return len(paths) == 2 and paths[0].resolve() == paths[1].resolve()


def check_resumable(saved: dict[str, Any], current: dict[str, Any], fixed: Sequence[str], state_path: Path,
                    error: type[ConfigError] = ConfigError, hint: str = "") -> None:
    """Raise ``error`` naming each key under ``fixed`` (sections or dotted keys) whose value differs between
    the config a run was saved with and the ``current`` one: such a run cannot be resumed. Two spellings of
    one existing path are the same value; ``hint`` ends the message."""
    old, new = _flatten(saved), _flatten(current)
    differ = sorted(k for k in set(old) | set(new)
                    if any(k == f or k.startswith(f + ".") for f in fixed) and not _same(old.get(k), new.get(k)))
    if differ:
        details = "; ".join(f"{k}: saved {old.get(k)!r}, now {new.get(k)!r}" for k in differ)
        raise error(f"cannot resume from {state_path}: the config changed ({details}){hint}")


PRESET_DIR = Path(__file__).resolve().parent / "configs"


POSTTRAIN_PRESET_PREFIX = "posttrain-"  # shipped post-training presets; the others are pretraining experiments


def list_presets(posttrain: bool = False) -> list[str]:
    """Names of the pretraining (or, with ``posttrain``, post-training) presets shipped inside the package
    (``src/tadm/configs/*.yaml``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if p.stem.startswith(POSTTRAIN_PRESET_PREFIX) == posttrain)


def preset_path(name: str) -> Path:
    """Path of the shipped preset ``name`` ("tadm-brown-cpu" or "tadm-brown-cpu.yaml").

    Raises:
        FileNotFoundError: no such preset; the message lists the presets that exist.
    """
    path = PRESET_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        every = list_presets() + list_presets(posttrain=True)
        raise FileNotFoundError(f"no preset {name!r}; shipped presets: {', '.join(every)}")
    return path


def resolve_config_path(
    path_or_preset: str | Path,
    *,
    preset: Callable[[str], Path] = preset_path,
    presets: Callable[[], list[str]] = list_presets,
    kind: str = "",
) -> Path:
    """A YAML file path if it exists, else the shipped preset of that name (clear error if neither).

    ``preset`` and ``presets`` look up and list another family of shipped presets (e.g. studies),
    ``kind`` names it in the error ("study").
    """
    path = Path(path_or_preset)
    if path.is_file():
        return path
    try:
        return preset(str(path_or_preset))
    except FileNotFoundError:
        kind = f"{kind} " if kind else ""
        raise FileNotFoundError(
            f"{kind}config {str(path_or_preset)!r} is neither a file nor a shipped {kind}preset "
            f"(presets: {', '.join(presets())})"
        ) from None


def _read_yaml(path: Path, error: type[ConfigError]) -> Any:
    """``OmegaConf.load(path)``, a mapping; a syntax error becomes one line naming the file, line and column."""
    try:
        loaded = OmegaConf.load(path)
    except OmegaConfBaseException as err:
        raise config_error(err, str(path), error) from None
    except yaml.YAMLError as err:
        raise error(f"{path}: not valid YAML: {_yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise error(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start})") from None
    if not isinstance(loaded, DictConfig):
        raise error(f"{path}: a config is a YAML mapping of sections (section: {{key: value}}), not a list")
    if not loaded:
        raise error(f"{path} is empty: a config is a YAML mapping of sections (section: {{key: value}})")
    return loaded


def _yaml_problem(err: yaml.YAMLError, located: bool = True) -> str:
    """A YAML error's problem and, when known and ``located``, its line and column."""
    mark = getattr(err, "problem_mark", None) if located else None
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return (getattr(err, "problem", None) or (str(err).splitlines() or [type(err).__name__])[0]) + where


def dotlist_config(overrides: Sequence[str], error: type[ConfigError] = ConfigError) -> DictConfig:
    """``key=value`` overrides as one config (``OmegaConf.from_dotlist``); a value that is not valid
    YAML (``train.loggers=[jsonl``) is ``error`` naming the override."""
    merged = OmegaConf.create()
    for override in overrides:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([override]))
        except yaml.YAMLError as err:
            problem = _yaml_problem(err, located=False)
            raise error(f"override {override!r}: the value is not valid YAML: {problem}") from None
    return merged


def _container_mismatch(base: Any, new: Any, key: str = "") -> str | None:
    """Where ``new`` puts a mapping on a list of ``base``, or a list on a mapping, said in words (OmegaConf's merge
    only says "incompatible container types"); None when there is no such key."""
    if OmegaConf.is_config(new):
        new = OmegaConf.to_container(new)
    if isinstance(new, dict) and OmegaConf.is_list(base):
        indexed = " (an override cannot set one item of a list: give the whole list)" if all(
            str(k).isdigit() for k in new) else ""
        return f"{key} must be a list, got a mapping {new!r}{indexed}"
    if isinstance(new, list) and OmegaConf.is_dict(base):
        return f"{key} must be a mapping of its keys, got a list {new!r}"
    if isinstance(new, dict) and OmegaConf.is_dict(base):
        for name, value in new.items():
            try:
                child = base[name]
            except Exception:  # a missing or unknown key: the merge's other checks name it
                continue
            found = _container_mismatch(child, value, f"{key}.{name}" if key else str(name))
            if found:
                return found
    return None


def _merge(merged: Any, new: Any, origin: str, error: type[ConfigError]) -> Any:
    """``OmegaConf.merge(merged, new)``, its errors as ``error`` naming the key and ``origin``."""
    try:
        return OmegaConf.merge(merged, new)
    except OmegaConfBaseException as err:
        raise config_error(err, origin, error) from None
    except TypeError as err:  # a mapping merged onto a list, or the reverse
        raise error(f"{origin}: {_container_mismatch(merged, new) or err}") from None


def _check_sections(loaded: Any, schema: type, origin: str, error: type[ConfigError], prefix: str = "") -> None:
    """Each section of ``schema`` that ``loaded`` holds must be a mapping of its keys (OmegaConf would report a
    scalar, a list or an empty section without naming the section)."""
    hints = get_type_hints(schema)
    for f in fields(schema):
        if f.name not in loaded or not is_dataclass(hints[f.name]):
            continue
        value, name = loaded[f.name], prefix + f.name
        if not isinstance(value, DictConfig):
            plain = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value  # a list: ListConfig
            got = "nothing (an empty section)" if value is None else repr(plain)
            raise error(f"{origin}: section '{name}' must be a mapping of its keys ({_keys(hints[f.name])}), got {got}")
        _check_sections(value, hints[f.name], origin, error, prefix=f"{name}.")


def _migrate(loaded: Any, legacy: dict[str, str]) -> Any:
    """``loaded`` (a YAML mapping) with the keys of an earlier schema moved to their place now."""
    data = OmegaConf.to_container(loaded)
    if not isinstance(data, dict):
        return loaded
    for old, new in legacy.items():
        *parents, leaf = old.split(".")
        holder = data
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or leaf not in holder or isinstance(holder[leaf], dict):
            continue  # absent, or already the new form
        value = holder.pop(leaf)
        target = data
        *new_parents, new_leaf = new.split(".")
        for part in new_parents:
            target = target.setdefault(part, {}) if isinstance(target.get(part), (dict, type(None))) else {}
        target[new_leaf] = value
    return OmegaConf.create(data)


def _migrate_override(override: str, legacy: dict[str, str]) -> str:
    key, _, value = override.partition("=")
    new = legacy.get(key.strip())
    return f"{new}={value}" if new is not None and not value.strip().startswith("{") else override


def load_structured(
    schema: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    error: type[ConfigError] = ConfigError,
    validate: Callable[[T], None] | None = None,
    resolve: Callable[[str | Path], Path] = resolve_config_path,
    legacy: dict[str, str] | None = None,
) -> T:
    """Defaults of the dataclass ``schema`` <- YAML file ``path`` <- ``key=value`` overrides, then ``validate``.

    ``resolve`` turns ``path`` into a file (default: a file, else a shipped preset of that name).
    ``legacy`` maps keys of an earlier schema to their place now (``"sampling.top_p":
    "sampling.sampler.top_p"``; a key mapped to ``KEY.name`` moves a plain value under the new
    section's ``name``), so that old files and overrides still load.
    Unknown keys, values of the wrong type and a ValueError raised by a section's own checks
    (``__post_init__``) become ``error`` with the key and where it came from in one line; a missing
    file is a FileNotFoundError.
    """
    merged = OmegaConf.structured(schema)
    origin = "defaults"
    if path is not None:
        path = resolve(path)
        origin = str(path)
        loaded = _read_yaml(path, error)
        if legacy:
            loaded = _migrate(loaded, legacy)
        _check_sections(loaded, schema, origin, error)
        merged = _merge(merged, loaded, origin, error)  # the file's own errors come before those of the overrides
    bad = [o for o in overrides if not o.partition("=")[1] or not o.partition("=")[0].strip()]
    if bad:
        raise error(f"overrides must look like section.key=value, got {bad[0]!r}")
    if legacy:
        overrides = [_migrate_override(o, legacy) for o in overrides]
    if overrides:
        origin = "overrides"
        given = dotlist_config(overrides, error)
        _check_sections(given, schema, origin, error)
        merged = _merge(merged, given, origin, error)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise config_error(err, origin, error) from None
    except ConfigError:
        raise
    except ValueError as err:  # a section's own validation in __post_init__
        raise error(f"{origin}: {err}") from None
    assert isinstance(cfg, schema)
    if validate is not None:
        validate(cfg)
    return cfg


# The objective keys each architecture's loss reads (tadm.training.objectives); the others are ignored by it.
OBJECTIVE_KEYS_USED = {
    "tadm": ("schedule", "eps", "antithetic", "gamma", "refresh_intervals", "step_budgets"),
    "adlm": ("schedule", "eps", "antithetic", "gamma", "anchor_common_mass"),
    "mdlm": ("schedule", "eps", "antithetic"),
    "ar": (),
}


def check_objective_keys(cfg: ExperimentConfig) -> None:
    """Refuse objective settings, changed from their defaults, that ``model.arch``'s loss ignores. ``tadm train``
    checks the config it was given; code that shares one objective section across architectures (a study)
    does not."""
    default, used = ObjectiveSection(), OBJECTIVE_KEYS_USED.get(cfg.model.arch, ())
    ignored = [f"objective.{f.name}={getattr(cfg.objective, f.name)}" for f in fields(ObjectiveSection)
               if f.name not in used and getattr(cfg.objective, f.name) != getattr(default, f.name)]
    if ignored:
        reads = ", ".join(used) if used else "none of them"
        verb, pronoun = ("has", "it") if len(ignored) == 1 else ("have", "them")
        raise ConfigError(f"{', '.join(ignored)} {verb} no effect on model.arch {cfg.model.arch} (its loss reads "
                          f"objective: {reads}); remove {pronoun}")


def short_run_warnings(optim: OptimSection, train: TrainSection) -> list[str]:
    """One line per setting that a run of ``train.max_steps`` steps cannot use as meant (the paper-scale defaults,
    warm-up 2,500 steps and EMA 0.9999, inherited by a short run): a warm-up longer than the run, whose learning
    rate then never reaches ``optim.lr``, and an EMA whose saved weights would still be mostly the initial ones."""
    steps, lines = train.max_steps, []
    if optim.warmup_steps > steps:
        reached = steps / optim.warmup_steps  # the linear warm-up's factor after the run's last step
        lines.append(f"optim.warmup_steps={optim.warmup_steps} exceeds train.max_steps={steps}: the learning rate "
                     f"only reaches {100 * reached:.0f}% of optim.lr={optim.lr:g} by the end of the run; set "
                     "optim.warmup_steps below train.max_steps")
    initial = train.ema ** steps  # the share of the initial weights left in the EMA after the run
    if initial > 0.5:
        lines.append(f"train.ema={train.ema:g} over train.max_steps={steps}: the saved (EMA) weights are still "
                     f"{100 * initial:.0f}% the initial ones; lower train.ema (e.g. 0.99) or set it to 0 for a short run")
    return lines


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Defaults <- YAML file or shipped preset ``path`` <- ``key=value`` overrides, validated strictly."""
    return load_structured(ExperimentConfig, path, overrides, validate=validate_experiment_config)


def save_config(cfg: ExperimentConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (saved beside every checkpoint and result)."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
