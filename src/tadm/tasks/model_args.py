"""The settings of the ``tadm`` lm-eval model, as given by ``--model_args key=value,...`` or a dict.

lm-eval splits ``--model_args`` at commas and converts numbers and ``true``/``false``, so list-like
values use colons: ``split=2:20``, ``refresh_steps=48:40:24``. From Python (``simple_evaluate`` with a
``model_args`` dict, or :class:`~tadm.tasks.lm_eval_model.TadmLM` directly) lists and a ready
refresh ``policy`` (a :class:`~tadm.sampling.RefreshPolicy` or its config mapping) are accepted too.

Exactly one of ``model`` (tadm's own model: a checkpoint directory, Hub id or builder name) and
``base`` (a post-training base such as DiffusionGemma, optionally with ``adapter``) is given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

from tadm.posttrain.adapter_io import ADAPTER_CONFIG_NAME
from tadm.sampling.refresh import RefreshPolicy, parse_refresh
from tadm.sampling.registry import sampler_config
from tadm.devices import resolve_device, resolve_dtype
from tadm.hf import check_hf_source
from tadm.specs import check_model_source
from tadm.tasks.generation import (BASE_STEPS, OWN_MODEL_STEPS, TOKENIZER_HINT, BlockGenerator, GenerationSettings,
                                   PrefixGenerator)

__all__ = ["SAMPLER_OPTION_KEYS", "TadmModelArgs", "parse_batch_size", "parse_ints", "repeated_keys"]

SAMPLER_OPTION_KEYS = ("entropy_bound", "temperature_max", "temperature_min", "categorical",
                       "top_p", "eta", "schedule", "nucleus", "time_grid")
_INT_LIMITS = {"steps": 1, "canvas_length": 1, "max_gen_toks": 1, "min_interval": 1, "max_interval": 1,
               "seed": 0, "mc_samples": 1, "likelihood_steps": 1}
_OPTIONAL_INTS = ("steps", "canvas_length", "max_interval", "likelihood_steps")
_BOOL_KEYS = ("naive", "skip_unchanged", "self_conditioning", "adaptive_stopping", "thinking", "greedy_check")
# the long form's parameters and the refresh_policy each belongs to
_LONG_FORM = {"refresh_steps": "schedule", "tau": "adaptive", "min_interval": "adaptive", "max_interval": "adaptive"}
# settings of block generation (a base) and their defaults: tadm's own models sample one canvas without them
_BASE_ONLY = {"canvas_length": None, "self_conditioning": True, "adaptive_stopping": False}
# settings of log-likelihood requests and their defaults: only tadm's own models answer those
_OWN_MODEL_ONLY = {"mc_samples": 64, "likelihood_steps": None, "greedy_check": False}


def parse_ints(value: Any, what: str) -> tuple[int, ...] | None:
    """``"2:20"``, ``"48 40"``, ``2``, ``[2, 20]`` -> a tuple of ints; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what} expects integers, got {value!r}")
    if isinstance(value, int):
        return (value,)
    parts = value.replace(":", " ").replace(";", " ").split() if isinstance(value, str) else list(value)
    try:
        return tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"{what} expects colon-separated integers (e.g. 2:20), got {value!r}") from None


def repeated_keys(items: Iterable[str]) -> list[str]:
    """The keys named more than once in ``key=value`` items, each item possibly a comma list (``"K=2,K=3"``)."""
    keys = [part.split("=", 1)[0].strip() for item in items for part in str(item).split(",") if "=" in part]
    return sorted({key for key in keys if keys.count(key) > 1})


def parse_batch_size(value: Any, max_batch_size: Any = None) -> int:
    """lm-eval's ``batch_size``: an int, or ``auto``/``auto:N`` (then ``max_batch_size``, else 1)."""
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        value = max_batch_size if max_batch_size is not None else 1
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"batch_size must be an integer or 'auto', got {value!r}") from None
    if size < 1:
        raise ValueError(f"batch_size must be >= 1, got {size}")
    return size


@dataclass
class TadmModelArgs:
    """Every model argument of the ``tadm`` lm-eval model (see the README section "Task evaluation").

    Model: ``model`` | ``base`` [+ ``adapter``], ``backbone`` (base kind, default diffusion-gemma),
    ``tokenizer``, ``split`` (S:A without an adapter), ``naive`` (naive-reuse baseline: fusion off).
    Refresh: ``K``, any refresh spec (``2``, ``adaptive:tau=0.3``, ``schedule:steps=48/40/24``), or
    the long form ``refresh_policy`` schedule (``refresh_steps``) or adaptive (``tau``,
    ``min_interval``, ``max_interval``); ``skip_unchanged``; ``policy`` (Python: a policy or mapping).
    Sampler: ``steps`` (T), ``canvas_length`` (L), ``sampler`` and its options (entropy-bound:
    ``entropy_bound``, ``temperature_max``, ``temperature_min``; masked: ``top_p``, ``eta``, ...),
    ``self_conditioning``, ``adaptive_stopping``. Run: ``seed``, ``batch_size``, ``device``,
    ``dtype``, ``max_gen_toks`` (default budget), ``thinking`` (chat template's thinking mode).
    Log-likelihood requests (tadm's own models, :mod:`tadm.tasks.likelihood`): ``mc_samples``
    (Monte-Carlo draws per request, default 64), ``likelihood_steps`` (T of the discrete bound; default:
    the continuous bound at K = 1, the sampler's ``steps`` at K > 1), ``greedy_check`` (compute
    ``is_greedy``); their draws are seeded from ``seed``.
    """

    model: str | None = None
    base: str | None = None
    adapter: str | None = None
    backbone: str = "diffusion-gemma"
    tokenizer: str | None = None
    split: Any = None
    naive: bool = False
    K: Any = 1  # a refresh spec: 4, "adaptive:tau=0.3", ...
    refresh_policy: str = "fixed"
    refresh_steps: Any = None
    tau: float | None = None
    min_interval: int = 1
    max_interval: int | None = None
    skip_unchanged: bool = False
    policy: Any = None
    steps: int | None = None
    canvas_length: int | None = None
    sampler: str | None = None
    entropy_bound: float | None = None
    temperature_max: float | None = None
    temperature_min: float | None = None
    categorical: str | None = None
    top_p: float | None = None
    eta: float | None = None
    schedule: str | None = None
    nucleus: str | None = None
    time_grid: str | None = None
    self_conditioning: bool = True
    adaptive_stopping: bool = False
    seed: int = 0
    batch_size: Any = 1
    max_batch_size: Any = None
    device: str | None = "auto"
    dtype: str = "auto"
    max_gen_toks: int = 256
    thinking: bool = False
    mc_samples: int = 64
    likelihood_steps: int | None = None
    greedy_check: bool = False

    @classmethod
    def from_kwargs(cls, *, require_model: bool = True, **kwargs: Any) -> TadmModelArgs:
        """The settings from keyword arguments; an unknown key is an error listing the valid ones.

        ``require_model=False`` is for a ready generator: then no model may be named.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"tadm model: unknown model_args {', '.join(unknown)}; valid: {', '.join(names)}")
        args = cls(**{k: v for k, v in kwargs.items() if v is not None})  # None: the default
        args.check(require_model)
        return args

    def check(self, require_model: bool = True) -> None:
        """Every value checked before anything loads: a ValueError naming the key, the value and what is valid.

        Zero, negative, NaN and unknown values are errors, never a silent default.
        """
        if not require_model and (self.model is not None or self.base is not None):
            raise ValueError("tadm model: a ready generator was given; model=/base= must not be")
        if require_model and (self.model is None) == (self.base is None):
            raise ValueError("tadm model: give exactly one of model=... (a tadm checkpoint or builder name) "
                             "and base=... (a post-training base such as DiffusionGemma)")
        if self.model is not None and (self.adapter or self.naive or self.split is not None):
            raise ValueError("tadm model: adapter, naive and split apply to a post-training base (base=...)")
        for name, low in _INT_LIMITS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INTS:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"tadm model: {name} must be an integer >= {low}, got {value!r}")
        for name in _BOOL_KEYS:
            value = getattr(self, name)
            if not (isinstance(value, bool) or value in (0, 1)):
                raise ValueError(f"tadm model: {name} must be true or false, got {value!r}")
        if self.model is not None:
            given = [f"{key}={getattr(self, key)}" for key, default in _BASE_ONLY.items()
                     if getattr(self, key) != default]
            if given:
                one = len(given) == 1
                raise ValueError(f"tadm model: {', '.join(given)} {'applies' if one else 'apply'} only to a "
                                 "post-training base (base=...); tadm's own models (model=...) sample one canvas "
                                 f"of their max_seq_len, so drop {'it' if one else 'them'}")
        parse_batch_size(self.batch_size, self.max_batch_size)
        if self.base is not None:
            given = [f"{key}={getattr(self, key)}" for key, default in _OWN_MODEL_ONLY.items()
                     if getattr(self, key) != default]
            if given:
                raise ValueError(f"tadm model: {', '.join(given)} set(s) how tadm's own models (model=...) answer "
                                 "log-likelihood requests; a post-training base (base=...) answers generation tasks "
                                 "only, so drop it")
            self.split_pair()
        try:
            resolve_dtype(self.dtype)
            resolve_device(self.device or "auto")
            policy = self.build_policy()
            if self.model is not None or self.base is not None:  # else a ready generator's steps are unknown here
                policy.check_steps(self.steps or (BASE_STEPS if self.base is not None else OWN_MODEL_STEPS))
            self.sampler_settings()
        except ValueError as err:
            raise ValueError(f"tadm model: {err}") from None

    def check_sources(self) -> None:
        """The named model, base, adapter and tokenizer exist (local paths) or could be Hub ids; a one-line
        FileNotFoundError otherwise. Nothing is loaded."""
        if self.model is not None:
            check_model_source(self.model)
        if self.base is not None:
            check_hf_source(self.base, "base")
        if self.adapter is not None:
            check_hf_source(self.adapter, "adapter", files=(ADAPTER_CONFIG_NAME,))
        if self.tokenizer is not None:
            check_hf_source(self.tokenizer, "tokenizer", files=("tokenizer.json", "tokenizer_config.json",
                                                                 "tadm_tokenizer.json"))

    def sampler_settings(self) -> Any:
        """The sampler's validated config (its name's defaults under the options given)."""
        name = self.sampler or ("entropy-bound" if self.base is not None else "mdlm")
        if self.base is not None and name != "entropy-bound":
            raise ValueError(f"a post-training base samples with 'entropy-bound' (Algorithm 2), not {name!r}")
        options = {key: getattr(self, key) for key in SAMPLER_OPTION_KEYS if getattr(self, key) is not None}
        if name == "entropy-bound" and self.steps is not None:
            options["num_steps"] = self.steps
        return sampler_config(name, **options)

    def split_pair(self) -> tuple[int, int] | None:
        pair = parse_ints(self.split, "split")
        if pair is not None and len(pair) != 2:
            raise ValueError(f"split expects SHARED:ANCHOR (two integers), got {self.split!r}")
        return pair

    def build_policy(self) -> RefreshPolicy:
        """The refresh policy (:func:`~tadm.sampling.refresh.parse_refresh`): ``policy`` if given, else ``K``,
        else the long form ``refresh_policy`` with its parameters."""
        name = self.refresh_policy
        given = [key for key in _LONG_FORM if getattr(self, key) is not None
                 and not (key == "min_interval" and self.min_interval == 1)]
        if self.policy is not None:
            extra = given + [key for key, default in (("K", 1), ("refresh_policy", "fixed"), ("skip_unchanged", False))
                             if str(getattr(self, key)) != str(default)]
            if extra:
                raise ValueError(f"policy is the whole refresh policy; drop {', '.join(extra)}")
            return parse_refresh(self.policy)
        stray = [key for key in given if _LONG_FORM[key] != name]
        if stray and name in ("fixed", *_LONG_FORM.values()):
            key, owner = stray[0], _LONG_FORM[stray[0]]
            if name != "fixed":
                where, hint = f"refresh_policy={name}", f"drop {key}"
            elif str(self.K) == "1":
                where, hint = "K=1 (the default)", f"add refresh_policy={owner}, or drop {key}"
            else:
                where, hint = f"K={self.K}", f"give it inside K (e.g. K={owner}:...:{key}=...), or drop {key}"
            raise ValueError(f"{key}={getattr(self, key)} is a parameter of refresh_policy={owner}, not of {where}; "
                             f"{hint}")
        if name == "fixed":
            policy = parse_refresh(self.K)
        elif str(self.K) != "1":
            raise ValueError(f"K={self.K} and refresh_policy={name} name two policies; give one "
                             f"(e.g. K={name}:...)")
        elif name == "schedule":
            steps = parse_ints(self.refresh_steps, "refresh_steps")
            if not steps:
                raise ValueError("refresh_policy=schedule needs refresh_steps (e.g. refresh_steps=48:40:24)")
            policy = parse_refresh({"policy": "schedule", "steps": list(steps)})
        elif name == "adaptive" and self.tau is None:
            raise ValueError("refresh_policy=adaptive needs tau (a share of changed positions, e.g. tau=0.05)")
        else:
            policy = parse_refresh({"policy": name, "tau": self.tau, "min_interval": self.min_interval,
                                    "max_interval": self.max_interval})
        return parse_refresh({**policy.config(), "skip_unchanged": True}) if self.skip_unchanged else policy

    def load_generator(self, tokenizer_hint: str = TOKENIZER_HINT) -> Any:
        """The generator these settings name: a :class:`BlockGenerator` (``base``) or a :class:`PrefixGenerator`
        (whose missing tokenizer is an error ending in ``tokenizer_hint``)."""
        device = resolve_device(self.device or "auto")
        if self.base is not None:
            return BlockGenerator.load(self.base, self.settings(), adapter=self.adapter, backbone=self.backbone,
                                       tokenizer=self.tokenizer, split=self.split_pair(), naive=bool(self.naive),
                                       device=device, dtype=self.dtype)
        return PrefixGenerator.load(self.model, self.settings(), tokenizer=self.tokenizer, device=device,
                                    tokenizer_hint=tokenizer_hint)

    def settings(self) -> GenerationSettings:
        """The generator's settings: refresh policy and sampler options."""
        options = {key: getattr(self, key) for key in SAMPLER_OPTION_KEYS if getattr(self, key) is not None}
        return GenerationSettings(policy=self.build_policy(), steps=self.steps, canvas_length=self.canvas_length,
                                  sampler=self.sampler, sampler_options=options,
                                  self_conditioning=bool(self.self_conditioning),
                                  adaptive_stopping=bool(self.adaptive_stopping))
