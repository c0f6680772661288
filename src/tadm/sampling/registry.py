"""Name-based choice of a sampler: the one place that maps a name to a sampler and its config.

Every sampler has a config dataclass holding its settings (``MDLMSamplerConfig``,
``ReMDMSamplerConfig``, ``EntropyBoundSamplerConfig``, ``LLaDASamplerConfig``, ``DreamSamplerConfig``). A name picks the class, the config and the
name's own defaults (``remdm-loop`` starts from eta = 0.02, the paper's value at T >= L); options
given by a caller (Python, CLI flags, a YAML section) override those defaults and are checked by
the config, so a typo or a value out of range is an error naming it::

    sampler = build_sampler("remdm-cap", model, top_p=0.9)          # what the model gives, filled in
    config = sampler_config("remdm-cap", top_p=0.9)
    sampler = sampler_from_config("remdm-cap", config, mask_id=model.mask_token_id)
    sampler = get_sampler("entropy-bound", vocab_size=model.vocab_size, entropy_bound=0.1)

Masked samplers (MDLM, ReMDM, LLaDA's, Dream's) need the model's mask id; the uniform-state
entropy-bound sampler needs its vocabulary size. LLaDA's ("llada") and Dream's ("dream-origin",
"dream-maskgit-plus", "dream-topk-margin", "dream-entropy") samplers read raw logits, like the
entropy-bound one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tadm.protocol import check_network
from tadm.sampling.base import Sampler
from tadm.sampling.dream import DreamSampler, DreamSamplerConfig
from tadm.sampling.entropy_bound import EntropyBoundSampler, EntropyBoundSamplerConfig
from tadm.sampling.llada import LLaDASampler, LLaDASamplerConfig
from tadm.sampling.mdlm import MDLMSampler, MDLMSamplerConfig
from tadm.sampling.remdm import ReMDMSampler, ReMDMSamplerConfig

__all__ = ["SAMPLERS", "SamplerEntry", "build_sampler", "get_sampler", "sampler_config", "sampler_from_config",
           "sampler_options"]


@dataclass(frozen=True)
class SamplerEntry:
    """A registered sampler: its class, its config class and the defaults its name fixes.

    ``fixed`` are config fields the name decides (a ReMDM strategy) and a caller may not set;
    ``defaults`` are the name's starting values, which a caller may override; ``needs`` is what
    the sampler needs from the model: ``"mask_id"`` or ``"vocab_size"``.
    """

    sampler_class: type
    config_class: type
    needs: str = "mask_id"
    fixed: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)

    def options(self) -> tuple[str, ...]:
        """The config fields a caller may set."""
        return tuple(f.name for f in dataclasses.fields(self.config_class) if f.name not in self.fixed)


def _remdm(strategy: str, **defaults: Any) -> SamplerEntry:
    return SamplerEntry(ReMDMSampler, ReMDMSamplerConfig, fixed={"strategy": strategy}, defaults=defaults)


def _dream(alg: str) -> SamplerEntry:
    return SamplerEntry(DreamSampler, DreamSamplerConfig, fixed={"alg": alg})


SAMPLERS: dict[str, SamplerEntry] = {
    "mdlm": SamplerEntry(MDLMSampler, MDLMSamplerConfig),
    "remdm-cap": _remdm("cap"),
    "remdm-rescale": _remdm("rescale"),
    "remdm-conf": _remdm("conf"),
    "remdm-loop": _remdm("loop", eta=0.02),
    "entropy-bound": SamplerEntry(EntropyBoundSampler, EntropyBoundSamplerConfig, needs="vocab_size"),
    "llada": SamplerEntry(LLaDASampler, LLaDASamplerConfig),
    "dream-origin": _dream("origin"),
    "dream-maskgit-plus": _dream("maskgit_plus"),
    "dream-topk-margin": _dream("topk_margin"),
    "dream-entropy": _dream("entropy"),
}


def _entry(name: str) -> SamplerEntry:
    try:
        return SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; valid: {', '.join(sorted(SAMPLERS))}") from None


def sampler_config(name: str, **options: Any) -> Any:
    """The validated config of sampler ``name`` with ``options`` over the name's defaults.

    Raises ValueError for an unknown name, an option the sampler does not have (the message lists
    the valid ones) or a value the config rejects.
    """
    entry = _entry(name)
    unknown = sorted(set(options) - set(entry.options()))
    if unknown:
        raise ValueError(
            f"sampler {name!r} has no option(s) {', '.join(unknown)}; valid: {', '.join(entry.options())}"
        )
    return entry.config_class(**{**entry.defaults, **options, **entry.fixed})


def sampler_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``options`` that sampler ``name`` has, without ``None`` values.

    For settings shared by several samplers (a sweep's ``top_p`` and ``eta`` under the ``auto``
    rule): options the sampler lacks are dropped only when they are ``None``; a set value the
    sampler cannot use is an error, as in :func:`sampler_config`.
    """
    entry = _entry(name)
    given = {key: value for key, value in options.items() if value is not None}
    unusable = sorted(set(given) - set(entry.options()))
    if unusable:
        raise ValueError(f"sampler {name!r} does not use {', '.join(unusable)}; valid: {', '.join(entry.options())}")
    return given


def sampler_from_config(name: str, config: Any, *, mask_id: int | None = None, vocab_size: int | None = None) -> Sampler:
    """The sampler ``name`` with ``config`` (from :func:`sampler_config`) for a model's mask id or vocabulary."""
    entry = _entry(name)
    if not isinstance(config, entry.config_class):
        raise TypeError(f"sampler {name!r} takes a {entry.config_class.__name__}, got {type(config).__name__}")
    needed = mask_id if entry.needs == "mask_id" else vocab_size
    if needed is None:
        raise ValueError(f"sampler {name!r} needs the model's {entry.needs}")
    return entry.sampler_class.from_config(needed, config)


def build_sampler(name: str, model: Any, **options: Any) -> Sampler:
    """Sampler ``name`` for ``model`` with ``options`` over its defaults: what it needs of the model
    (the mask id of masked samplers, the vocabulary size of the entropy-bound one) is filled in.

    Raises ValueError when the model cannot serve the sampler: no mask id for a masked sampler, or
    no raw logits (``predict_logits``) for the entropy-bound one.
    """
    entry = _entry(name)
    value = model.mask_token_id if entry.needs == "mask_id" else model.vocab_size
    if value is None:
        raise ValueError(f"sampler {name!r} needs a model with a {entry.needs.replace('_', ' ')}; "
                         f"{type(model).__name__} has none")
    sampler = sampler_from_config(name, sampler_config(name, **options), **{entry.needs: value})
    if sampler.consumes == "logits":
        try:
            check_network(model, "predict_logits")
        except TypeError:
            raise ValueError(f"sampler {name!r} reads raw logits (predict_logits), which {type(model).__name__} "
                             f"does not give: use it with a post-trained backbone (tadm posttrain sample)") from None
    return sampler


def get_sampler(name: str, mask_id: int | None = None, *, vocab_size: int | None = None, **options: Any) -> Sampler:
    """Build sampler ``name`` (see ``SAMPLERS``) with ``options`` over its defaults.

    Masked samplers take the model's ``mask_id``; ``"entropy-bound"`` takes ``vocab_size``.
    :func:`build_sampler` reads either from the model.
    """
    return sampler_from_config(name, sampler_config(name, **options), mask_id=mask_id, vocab_size=vocab_size)
