"""Sampler configs and the registry: names, defaults, strict options and bad values."""

import math
from types import SimpleNamespace

import pytest

from tadm.sampling import (
    SAMPLERS,
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    MDLMSampler,
    MDLMSamplerConfig,
    ReMDMSampler,
    ReMDMSamplerConfig,
    build_sampler,
    sampler_from_config,
    get_sampler,
    sampler_config,
)
from tadm.sampling.registry import sampler_options

MASK = 9


@pytest.mark.parametrize(
    "name, cls, config_cls",
    [
        ("mdlm", MDLMSampler, MDLMSamplerConfig),
        ("remdm-cap", ReMDMSampler, ReMDMSamplerConfig),
        ("remdm-rescale", ReMDMSampler, ReMDMSamplerConfig),
        ("remdm-conf", ReMDMSampler, ReMDMSamplerConfig),
        ("remdm-loop", ReMDMSampler, ReMDMSamplerConfig),
        ("entropy-bound", EntropyBoundSampler, EntropyBoundSamplerConfig),
    ],
)
def test_every_registered_sampler_is_built_from_its_config(name, cls, config_cls):
    needs = {"vocab_size": 10} if name == "entropy-bound" else {"mask_id": MASK}
    sampler = get_sampler(name, **needs)
    assert type(sampler) is cls and isinstance(sampler.config, config_cls)
    assert sampler.config == sampler_config(name)
    rebuilt = sampler_from_config(name, sampler.config, **needs)
    assert rebuilt.config == sampler.config


def test_build_sampler_reads_what_the_sampler_needs_from_the_model():
    masked = SimpleNamespace(mask_token_id=7, vocab_size=12)
    assert build_sampler("remdm-cap", masked, top_p=0.8).mask_id == 7
    assert build_sampler("remdm-cap", masked, top_p=0.8).config == sampler_config("remdm-cap", top_p=0.8)
    # the entropy-bound sampler reads raw logits, which only a post-trained backbone gives
    # (tests/posttrain/test_entropy_bound.py builds it for one)
    with pytest.raises(ValueError, match=r"sampler 'entropy-bound' reads raw logits \(predict_logits\), which "
                                         r"SimpleNamespace does not give: use it with a post-trained backbone"):
        build_sampler("entropy-bound", masked)
    with pytest.raises(ValueError, match="sampler 'mdlm' needs a model with a mask id; SimpleNamespace has none"):
        build_sampler("mdlm", SimpleNamespace(mask_token_id=None, vocab_size=12))


def test_name_fixes_the_strategy_and_its_defaults():
    assert get_sampler("remdm-rescale", MASK).strategy == "rescale"
    assert get_sampler("remdm-loop", MASK).eta == 0.02  # the paper's loop eta, overridable
    assert get_sampler("remdm-loop", MASK, eta=0.05).eta == 0.05
    assert get_sampler("remdm-cap", MASK).eta == 0.04
    with pytest.raises(ValueError, match="has no option.*strategy"):
        sampler_config("remdm-cap", strategy="loop")


def test_unknown_options_and_names_are_errors_listing_the_valid_ones():
    with pytest.raises(ValueError, match=r"sampler 'mdlm' has no option\(s\) eta; valid: schedule, top_p"):
        get_sampler("mdlm", MASK, eta=0.1)
    with pytest.raises(ValueError, match="unknown sampler 'remdm'; valid: dream-entropy, .*entropy-bound, llada, mdlm"):
        get_sampler("remdm", MASK)
    with pytest.raises(ValueError, match="needs the model's vocab_size"):
        get_sampler("entropy-bound", MASK)
    with pytest.raises(ValueError, match="needs the model's mask_id"):
        get_sampler("mdlm")
    with pytest.raises(TypeError, match="takes a ReMDMSamplerConfig"):
        sampler_from_config("remdm-cap", MDLMSamplerConfig(), mask_id=MASK)


@pytest.mark.parametrize(
    "name, option, value, message",
    [
        ("remdm-cap", "eta", math.nan, r"eta must be a finite number in \[0, 1\], got nan"),
        ("remdm-loop", "eta", math.inf, r"eta must be a finite number in \[0, 1\], got inf"),
        ("remdm-rescale", "eta", 5.0, r"eta must be a finite number in \[0, 1\], got 5.0"),
        ("remdm-cap", "eta", -0.1, r"eta must be a finite number in \[0, 1\]"),
        ("remdm-cap", "top_p", math.nan, r"top_p must be a finite number in \(0, 1\]"),
        ("mdlm", "top_p", 0.0, r"top_p must be a finite number in \(0, 1\], got 0.0"),
        ("mdlm", "top_p", "0.9", r"top_p must be a number"),
        ("remdm-loop", "t_on", math.nan, r"t_on must be a finite number in \[0, 1\]"),
        ("remdm-cap", "window", 1, "window must be true or false"),
        ("mdlm", "time_grid", "linear", "unknown time grid"),
        ("mdlm", "schedule", "exp", "schedule"),
        ("entropy-bound", "entropy_bound", math.nan, r"entropy_bound must be a finite number in \(0, inf\)"),
        ("entropy-bound", "temperature_min", -1.0, r"temperature_min must be a finite number in \[0, inf\)"),
        ("entropy-bound", "temperature_max", 0.1, "temperature_min <= temperature_max"),
        ("entropy-bound", "num_steps", 0, "number of steps T must be an integer >= 1"),
        ("entropy-bound", "categorical", "topk", "unknown categorical draw"),
    ],
)
def test_bad_values_are_errors_naming_value_and_range(name, option, value, message):
    with pytest.raises(ValueError, match=message):
        sampler_config(name, **{option: value})


def test_bad_mask_id_is_an_error():
    with pytest.raises(ValueError, match="mask_id must be an integer >= 0"):
        get_sampler("remdm-cap", -1)


def test_shared_options_drop_only_unset_values():
    options = {"top_p": 0.9, "eta": None, "nucleus": "released"}
    assert sampler_options("mdlm", options) == {"top_p": 0.9, "nucleus": "released"}
    assert sampler_options("remdm-cap", {**options, "eta": 0.01})["eta"] == 0.01
    with pytest.raises(ValueError, match="sampler 'mdlm' does not use eta"):
        sampler_options("mdlm", {**options, "eta": 0.01})


def test_registry_covers_the_paper_samplers():
    assert set(SAMPLERS) == {"mdlm", "remdm-cap", "remdm-rescale", "remdm-conf", "remdm-loop", "entropy-bound",
                             "llada", "dream-origin", "dream-maskgit-plus", "dream-topk-margin", "dream-entropy"}
