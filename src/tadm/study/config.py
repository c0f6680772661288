"""The schema of a staleness study (``tadm study CONFIG``): which models, how they train, how they are evaluated.

A study trains several model kinds at equal width, depth, data and token budget and evaluates them
for the paper's central claim: a model trained with stale anchors keeps its quality as the refresh
interval K grows. A study file is YAML with these sections (every key optional except ``models``):

* ``name``, ``out_dir``, ``seeds`` (training seeds; every model is trained once per seed unless it
  names its own ``seeds``);
* ``models``: a list of ``{name, kind, seeds?, overrides?}``; ``kind`` is one of :data:`MODEL_KINDS`
  and ``overrides`` are ``section.key=value`` strings applied to that model's training config (not the
  keys the study sets for every unit: :data:`STUDY_SET_KEYS`);
* ``size``: width and depth shared by every model (MDLM and AR get ``anchor_layers +
  denoiser_layers`` blocks);
* ``data``, ``objective``, ``optim``, ``train``: the sections of a ``tadm train`` config
  (:mod:`tadm.config`), shared by every model (``train.out_dir`` and ``train.seed`` are set per unit, and
  ``objective.gamma`` per kind for tadm and adlm: giving them here is refused);
* ``staleness``: the stale-anchor likelihood curves (:func:`tadm.eval.likelihood.stale_anchor_nelbo`)
  and the cached-process bound (:func:`~tadm.eval.likelihood.cached_process_nelbo`), whose ``refresh`` entries
  are fixed intervals K and must include K = 1;
* ``sampling``: the K x T sampling sweep, its evaluators, MAUVE reference and throughput timing;
  ``sampling.refresh`` entries are a fixed interval K or a refresh-policy mapping
  (``{policy: adaptive, tau: 0.3, max_interval: 16}``, :mod:`tadm.sampling.refresh`), and must include K = 1.

Unknown keys, wrong types and unknown model kinds fail with a one-line message naming the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tadm.config import (PRESET_DIR, ConfigError, DataSection, ExperimentConfig, ModelSection, ObjectiveSection,
                         OptimSection, RecipeConfig, TrainSection, config_error, dotlist_config, load_structured,
                         resolve_config_path, validate_experiment_config)
from tadm.eval.pipeline import SamplingSettings
from tadm.nn import DiTSizes
from tadm.sampling.refresh import parse_refresh_list

__all__ = ["MODEL_KINDS", "IN_DOMAIN_EVALUATOR", "StalenessSection", "SamplingSection", "StudyConfig", "StudyModel",
           "StudySize", "list_study_presets", "load_study_config", "model_experiment_config", "study_preset_path"]

STUDY_PRESET_DIR = PRESET_DIR / "studies"


def list_study_presets() -> list[str]:
    """Names of the study presets shipped inside the package (``src/tadm/configs/studies/*.yaml``)."""
    return sorted(p.stem for p in STUDY_PRESET_DIR.glob("*.yaml"))


def study_preset_path(name: str) -> Path:
    """Path of the shipped study preset ``name``; FileNotFoundError listing the presets otherwise."""
    path = STUDY_PRESET_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        raise FileNotFoundError(f"no study preset {name!r}; shipped: {', '.join(list_study_presets())}")
    return path

# kind -> (architecture, what it is)
MODEL_KINDS: dict[str, tuple[str, str]] = {
    "tadm": ("tadm", "TADM-dagger: T-ANELBO with stale anchors (K drawn from objective.refresh_intervals), gamma = 0"),
    "tadm-fresh": ("tadm", "TADM trained with fresh anchors only (K = 1): the ablation of stale-anchor training"),
    "adlm": ("adlm", "ADLM: fresh anchors, its own ANELBO with rare-token anchor supervision"),
    "mdlm": ("mdlm", "MDLM: one DiT stack of anchor_layers + denoiser_layers blocks, no anchor"),
    "ar": ("ar", "autoregressive Transformer of anchor_layers + denoiser_layers causal blocks"),
}
# Training keys the study sets for every unit, and where a study gives them instead.
STUDY_SET_KEYS = {"train.out_dir": "the study's out_dir", "train.seed": "seeds or models[].seeds",
                  "model.arch": "models[].kind", "model.preset": "size"}
IN_DOMAIN_EVALUATOR = "ar"  # evaluator name that means "the study's own AR model"
ADLM_GAMMA = 3e-3  # ADLM's anchor-loss weight unless a model overrides objective.gamma


@dataclass
class StudyModel:
    """One trained model of the study."""

    name: str = ""
    kind: str = ""
    seeds: list[int] | None = None  # None: the study's seeds
    overrides: list[str] = field(default_factory=list)  # section.key=value for this model's training config


@dataclass
class StudySize:
    """Width and depth shared by every model (equal-size comparison).

    The width fields are :class:`~tadm.nn.DiTSizes`' own (with the study's small defaults) and are
    validated there, when each model's training config is built; the layer split is the study's.
    """

    hidden_size: int = 128
    num_heads: int = 4
    anchor_layers: int = 4
    denoiser_layers: int = 2
    cond_dim: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0


@dataclass
class StalenessSection:
    """Stale-anchor likelihood of every anchored model on held-out blocks."""

    steps: list[int] = field(default_factory=lambda: [32, 128])  # T of t' = min(1, t + k / T)
    max_age: int = 7  # k = 0 .. max_age
    refresh: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # K of the discrete cached-process bound
    discrete_steps: int | None = None  # T of that bound (default: the smallest of ``steps``)
    naive: bool = True  # also evaluate each TADM with its fusion bypassed (naive reuse)
    uninformative: bool = True  # also the bound with an anchor from a fully masked canvas
    t_samples: int = 2
    batch_size: int = 16
    max_blocks: int = 64
    eval_seeds: list[int] = field(default_factory=lambda: [0])


@dataclass
class SamplingSection(SamplingSettings):
    """The K x T sampling sweep of every diffusion model, scored by every evaluator (the shared
    :class:`~tadm.eval.pipeline.SamplingSettings`, nested ``sampler:`` section included), plus which training
    seeds are sampled and whether each TADM is also sampled with naive reuse."""

    evaluators: list[str] = field(default_factory=lambda: ["smollm2-135m", IN_DOMAIN_EVALUATOR])
    model_seeds: list[int] | None = None  # training seeds whose models are sampled (None: the first seed)
    naive: bool = False  # also sample each TADM with naive reuse


@dataclass
class StudyConfig(RecipeConfig):
    name: str = "study"
    out_dir: str = "runs/study"
    seeds: list[int] = field(default_factory=lambda: [0])
    models: list[StudyModel] = field(default_factory=list)
    size: StudySize = field(default_factory=StudySize)
    data: DataSection = field(default_factory=DataSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    staleness: StalenessSection = field(default_factory=StalenessSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)

    def model(self, name: str) -> StudyModel:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def seeds_of(self, model: StudyModel) -> list[int]:
        return list(model.seeds) if model.seeds is not None else list(self.seeds)

    def sampled_seeds(self, model: StudyModel) -> list[int]:
        wanted = self.sampling.model_seeds
        seeds = self.seeds_of(model)
        return seeds[:1] if wanted is None else [s for s in seeds if s in wanted]


def _positive_ints(name: str, values: Sequence[int], minimum: int = 1) -> None:
    if not values or any(isinstance(v, bool) or int(v) != v or v < minimum for v in values):
        raise ConfigError(f"{name} must be a non-empty list of integers >= {minimum}, got {list(values)}")
    twice = sorted({v for n, v in enumerate(values) if v in list(values)[:n]})
    if twice:  # a repeated seed would count one model as two in every mean and spread
        raise ConfigError(f"{name} lists {', '.join(map(str, twice))} twice, got {list(values)}")


def _at_least(section: object, prefix: str, names: Sequence[str], minimum: int = 1) -> None:
    """Each named field of ``section`` is >= ``minimum`` (or None where the schema allows it)."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value < minimum:
            raise ConfigError(f"{prefix}.{name} must be >= {minimum}, got {value}")


def _validate_models(models: list[StudyModel]) -> None:
    """Each ``models[]`` entry: a unique name, a known kind, its seeds, and overrides that the study does not set."""
    if not models:
        raise ConfigError("models is empty: list at least one {name, kind}")
    seen: set[str] = set()
    for n, m in enumerate(models):
        if not m.name or not m.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"models[{n}].name {m.name!r} must be a non-empty name of letters, digits, '-' and '_'")
        if m.name in seen:
            raise ConfigError(f"models[{n}].name {m.name!r} is given twice")
        seen.add(m.name)
        if m.kind not in MODEL_KINDS:
            raise ConfigError(f"models[{n}].kind {m.kind!r} is unknown; valid: {', '.join(MODEL_KINDS)}")
        if m.seeds is not None:
            _positive_ints(f"models[{n}].seeds", m.seeds, minimum=0)
        bad = [o for o in m.overrides if "=" not in o]
        if bad:
            raise ConfigError(f"models[{n}].overrides must look like section.key=value, got {bad[0]!r}")
        for override in m.overrides:
            key = override.partition("=")[0].strip().lstrip("+~")
            taken = next((k for k in STUDY_SET_KEYS if k == key or k.startswith(f"{key}.")), None)
            if taken is not None:
                raise ConfigError(f"models[{n}].overrides sets {taken}, which the study sets for every unit; "
                                  f"use {STUDY_SET_KEYS[taken]} instead")


def _validate_study(cfg: StudyConfig) -> None:
    for key in ("name", "out_dir"):
        if not getattr(cfg, key).strip():
            raise ConfigError(f"{key} must not be empty")
    _positive_ints("seeds", cfg.seeds, minimum=0)
    _validate_models(cfg.models)
    _refuse_replaced_keys(cfg)
    _check_size(cfg.size)
    st = cfg.staleness
    _positive_ints("staleness.steps", st.steps)
    if any(isinstance(k, bool) or not isinstance(k, int) for k in st.refresh):
        raise ConfigError(f"staleness.refresh lists the fixed intervals K of the cached-process bound (integers >= 1), "
                          f"got {list(st.refresh)!r}; refresh policies belong in sampling.refresh")
    try:  # the fixed intervals K of the cached-process bound
        parse_refresh_list(list(st.refresh))
    except ValueError as err:
        raise ConfigError(f"staleness.refresh: {err}") from None
    if 1 not in st.refresh:
        raise ConfigError(f"staleness.refresh must include K = 1 (the reference of every comparison), got "
                          f"{list(st.refresh)}")
    _positive_ints("staleness.eval_seeds", st.eval_seeds, minimum=0)
    _at_least(st, "staleness", ["max_age"], minimum=0)
    _at_least(st, "staleness", ["discrete_steps", "t_samples", "batch_size", "max_blocks"])
    sp = cfg.sampling
    try:
        sp.validate("sampling")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _positive_ints("sampling.steps", sp.steps)  # a T listed twice would give each of its cells twice
    buckets = sp.mauve_num_buckets
    if buckets != "auto" and (isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1):
        raise ConfigError(f"sampling.mauve_num_buckets must be 'auto' or an integer >= 1, got {buckets!r}")
    if sp.model_seeds is not None:
        _positive_ints("sampling.model_seeds", sp.model_seeds, minimum=0)
        trained = sorted({s for m in cfg.models if MODEL_KINDS[m.kind][0] != "ar" for s in cfg.seeds_of(m)})
        unknown = [s for s in sp.model_seeds if s not in trained]
        if unknown:
            raise ConfigError(f"sampling.model_seeds names seed {unknown[0]}, which no diffusion model is trained "
                              f"with; trained seeds: {trained}")
    kinds = {m.kind for m in cfg.models}
    if IN_DOMAIN_EVALUATOR in sp.evaluators and "ar" not in kinds:
        raise ConfigError(f"sampling.evaluators names {IN_DOMAIN_EVALUATOR!r} (the in-domain AR) but no model has "
                          "kind 'ar'")
    for m in cfg.models:
        model_experiment_config(cfg, m, cfg.seeds_of(m)[0])  # every derived training config must validate


def _refuse_replaced_keys(cfg: StudyConfig) -> None:
    """Study-wide training keys that :func:`model_experiment_config` replaces for every unit (or, for
    ``objective.gamma``, for every model of kind tadm or adlm) must keep their defaults."""
    train = TrainSection()
    for key, value, default in (("train.out_dir", cfg.train.out_dir, train.out_dir),
                                ("train.seed", cfg.train.seed, train.seed)):
        if value != default:
            raise ConfigError(f"{key} is set by the study for every unit, got {value!r}; use "
                              f"{STUDY_SET_KEYS[key]} instead")
    replaced = [m.kind for m in cfg.models if m.kind in ("tadm", "adlm")]
    if replaced and cfg.objective.gamma != ObjectiveSection().gamma:
        raise ConfigError(f"objective.gamma is set by model kind {replaced[0]!r} (tadm: 0, adlm: {ADLM_GAMMA}), got "
                          f"{cfg.objective.gamma}; use models[].overrides: [objective.gamma=...] instead")


def _width(size: StudySize) -> dict[str, Any]:
    """The :class:`~tadm.nn.DiTSizes` fields that ``size`` sets (everything but the layer split)."""
    return {f.name: getattr(size, f.name) for f in fields(DiTSizes) if hasattr(size, f.name)}


def _check_size(size: StudySize) -> None:
    """The width validated by :class:`~tadm.nn.DiTSizes` itself; the layer counts >= 1."""
    _at_least(size, "size", ["anchor_layers", "denoiser_layers"])
    try:
        DiTSizes(**_width(size))
    except ValueError as err:
        raise ConfigError(str(err).replace("DiTSizes.", "size.")) from None


def model_experiment_config(cfg: StudyConfig, model: StudyModel, seed: int) -> ExperimentConfig:
    """The ``tadm train`` config of one (model, seed) unit of the study, validated.

    Width and depth come from ``size``; data, optimisation and the training loop from the study's
    shared sections; ``kind`` fixes the architecture and objective (``tadm-fresh``: refresh
    intervals [1]; ``tadm``: gamma 0; ``adlm``: gamma 3e-3 unless overridden); then the model's own
    ``overrides``. Output goes to ``out_dir/models/NAME-sSEED``.
    """
    arch, _ = MODEL_KINDS[model.kind]
    s = cfg.size
    if arch in ("tadm", "adlm"):
        sizes: dict[str, Any] = {"anchor_layers": s.anchor_layers, "denoiser_layers": s.denoiser_layers}
    else:
        sizes = {"num_layers": s.anchor_layers + s.denoiser_layers}
    sizes.update(_width(s))
    by_kind = {"tadm-fresh": {"refresh_intervals": [1]}, "tadm": {"gamma": 0.0}, "adlm": {"gamma": ADLM_GAMMA}}
    # the shared sections go in as they are: OmegaConf copies them, and only copies are changed
    base = ExperimentConfig(
        model=ModelSection(arch=arch, preset="tiny", overrides=sizes), data=cfg.data, optim=cfg.optim,
        objective=replace(cfg.objective, **by_kind.get(model.kind, {})),
        train=replace(cfg.train, seed=int(seed), out_dir=str(Path(cfg.out_dir) / "models" / f"{model.name}-s{seed}")),
    )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(base), dotlist_config(model.overrides))
        out = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise config_error(err, f"models {model.name!r} overrides") from None
    assert isinstance(out, ExperimentConfig)
    try:
        validate_experiment_config(out)
    except ConfigError as err:
        raise ConfigError(f"model {model.name!r}: {err}") from None
    return out


def load_study_config(path: str | Path, overrides: Sequence[str] = ()) -> StudyConfig:
    """Defaults <- YAML file or shipped preset (``study-brown-cpu``) <- ``key=value`` overrides, validated."""
    resolve = partial(resolve_config_path, preset=study_preset_path, presets=list_study_presets, kind="study")
    if path is not None:
        _refuse_legacy_conflicts(resolve(path))
    return load_structured(StudyConfig, path, overrides, validate=_validate_study, resolve=resolve, legacy=LEGACY_KEYS)


# Keys of studies written before the sampler became a nested section, and where they live now.
LEGACY_KEYS = {"sampling.sampler": "sampling.sampler.name", "sampling.top_p": "sampling.sampler.top_p",
               "sampling.eta": "sampling.sampler.eta", "sampling.nucleus": "sampling.sampler.nucleus",
               "sampling.time_grid": "sampling.sampler.time_grid"}


def _refuse_legacy_conflicts(path: Path) -> None:
    """A study file that gives a sampler option both flat (``sampling.top_p``) and in the nested section
    (``sampling.sampler.top_p``) with different values is refused: the flat one would silently win."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # the loader reports it
    for old, new in LEGACY_KEYS.items():
        *parents, leaf = old.split(".")
        holder, nested = data, data
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        for part in new.split(".")[:-1]:
            nested = nested.get(part) if isinstance(nested, dict) else None
        new_leaf = new.split(".")[-1]
        if (not isinstance(holder, dict) or leaf not in holder or isinstance(holder[leaf], dict)
                or not isinstance(nested, dict) or new_leaf not in nested or nested[new_leaf] == holder[leaf]):
            continue
        raise ConfigError(f"{path}: {old} ({holder[leaf]!r}) and {new} ({nested[new_leaf]!r}) disagree; give it once, "
                          f"as {new}")
