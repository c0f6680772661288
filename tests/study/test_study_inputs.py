"""``tadm study``: inputs refused when the config is loaded or before the first unit, and a study's records kept
right when a run is refused or the study is named by another path."""

from __future__ import annotations

import pytest

from tadm.config import ConfigError
from tadm.study import load_study_config
from tests.study.test_study import write_config


def _load(tmp_path, *overrides, **changes):
    return load_study_config(write_config(tmp_path / "s.yaml", tmp_path / "out", **changes), list(overrides))


@pytest.mark.parametrize("override,message", [
    ("train.out_dir=/somewhere/else", ("models\\[0\\].overrides sets train.out_dir, which the study sets for every "
                                       "unit; use the study's out_dir instead")),
    ("train.seed=5", "models\\[0\\].overrides sets train.seed, .* use seeds or models\\[\\].seeds instead"),
    ("model.arch=mdlm", "models\\[0\\].overrides sets model.arch, .* use models\\[\\].kind instead"),
    ("+model.preset=small", "models\\[0\\].overrides sets model.preset, .* use size instead"),
    ("train={max_steps: 2}", "models\\[0\\].overrides sets train.out_dir"),
])
def test_per_model_overrides_of_keys_the_study_sets_are_refused(tmp_path, override, message):
    models = [{"name": "tadm", "kind": "tadm", "overrides": [override]}, {"name": "ar", "kind": "ar"}]
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, models=models)


def test_per_model_overrides_of_other_keys_still_apply(tmp_path):
    models = [{"name": "adlm", "kind": "adlm", "overrides": ["objective.gamma=0.01", "optim.lr=0.001"]},
              {"name": "ar", "kind": "ar"}]
    cfg = _load(tmp_path, models=models)
    assert cfg.models[0].overrides == ["objective.gamma=0.01", "optim.lr=0.001"]


@pytest.mark.parametrize("override,message", [
    ("train.out_dir=/x", "train.out_dir is set by the study for every unit, got '/x'; use the study's out_dir"),
    ("train.seed=5", "train.seed is set by the study for every unit, got 5; use seeds or models\\[\\].seeds"),
    ("objective.gamma=0.1", "objective.gamma is set by model kind 'tadm' .* got 0.1; use models\\[\\].overrides"),
])
def test_study_level_keys_replaced_for_every_unit_are_refused(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, override)


def test_study_level_gamma_is_kept_where_no_kind_sets_it(tmp_path):
    models = [{"name": "fresh", "kind": "tadm-fresh"}, {"name": "ar", "kind": "ar"}]
    assert _load(tmp_path, "objective.gamma=0.1", models=models).objective.gamma == 0.1
