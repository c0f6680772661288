"""``tadm study``: inputs refused when the config is loaded or before the first unit, and a study's records kept
right when a run is refused or the study is named by another path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tadm.study.runner as runner_mod
from tadm.config import ConfigError
from tadm.study import load_study_config, model_experiment_config, run_study
from tadm.study.report import _likelihood_lines
from tadm.study.runner import UNIT_MARKER, _training_identity
from tests.study.test_study import write_config

QUIET = {"progress": False, "log": lambda m: None}


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


@pytest.mark.parametrize("changes,message", [
    ({"staleness.refresh": [1, {"policy": "adaptive", "tau": 0.2}]},
     "staleness.refresh lists the fixed intervals K .* refresh policies belong in sampling.refresh"),
    ({"staleness.refresh": [2, 4]}, ("staleness.refresh must include K = 1 \\(the reference of every comparison\\), "
                                     "got \\[2, 4\\]")),
    ({"sampling.steps": [4, 4]}, "sampling.steps lists 4 twice, got \\[4, 4\\]"),
    ({"sampling.model_seeds": [5]}, ("sampling.model_seeds names seed 5, which no diffusion model is trained "
                                     "with; trained seeds: \\[0, 1\\]")),
    ({"sampling.mauve_num_buckets": "abc"}, "sampling.mauve_num_buckets must be 'auto' or an integer >= 1, got 'abc'"),
    ({"sampling.mauve_num_buckets": 0}, "sampling.mauve_num_buckets must be 'auto' or an integer >= 1, got 0"),
])
def test_bad_sweep_lists_are_refused_when_loaded(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, **changes)


def test_good_sweep_lists_load(tmp_path):
    cfg = _load(tmp_path, **{"sampling.mauve_num_buckets": 3, "sampling.model_seeds": [1], "sampling.steps": [4, 8]})
    assert cfg.sampling.mauve_num_buckets == 3 and cfg.sampling.model_seeds == [1]


def test_flat_and_nested_sampler_options_that_disagree_are_refused(tmp_path):
    sampling = {"steps": [4], "refresh": [1, 2], "num_samples": 4, "batch_size": 4, "evaluators": ["ar"],
                "sampler": {"name": "mdlm", "top_p": 0.9}, "top_p": 0.5, "device": "cpu"}
    with pytest.raises(ConfigError, match="sampling.top_p \\(0.5\\) and sampling.sampler.top_p \\(0.9\\) disagree; "
                                          "give it once, as sampling.sampler.top_p"):
        _load(tmp_path, sampling=sampling)
    sampling["top_p"] = 0.9  # the same value twice is no conflict
    assert _load(tmp_path, sampling=sampling).sampling.sampler.top_p == 0.9
    del sampling["sampler"]["top_p"]  # the flat form alone is an earlier schema's
    sampling["top_p"] = 0.5
    assert _load(tmp_path, sampling=sampling).sampling.sampler.top_p == 0.5


def test_missing_reference_is_refused_before_any_unit(tmp_path):
    cfg = _load(tmp_path, **{"sampling.reference": str(tmp_path / "nope.txt")})
    with pytest.raises(ConfigError, match="sampling.reference: corpus file or directory '.*nope.txt' does not exist"):
        run_study(cfg, **QUIET)
    assert not (tmp_path / "out").exists()


def _mark_trained(cfg) -> None:
    """Write each unit's record as a finished training would (no training: the records are what is checked)."""
    for m in cfg.models:
        for seed in cfg.seeds_of(m):
            exp = model_experiment_config(cfg, m, seed)
            exp.data.tokenizer = str(Path(cfg.out_dir) / "tokenizer")  # the study's shared BPE
            marker = Path(exp.train.out_dir) / UNIT_MARKER
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"spec": {"kind": m.kind, "config": exp.to_dict()}, "step": 3}))


def _train_stage(cfg, monkeypatch):
    monkeypatch.setattr(runner_mod, "train", lambda *a, **k: pytest.fail("trained again"))
    return run_study(cfg, stages=("train",), **QUIET)


def test_a_study_named_by_another_path_is_the_same_study(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    models = [{"name": "tadm", "kind": "tadm"}, {"name": "ar", "kind": "ar"}]
    relative = load_study_config(write_config(tmp_path / "s.yaml", "rel-study", models=models, seeds=[0]))
    _mark_trained(relative)
    assert _train_stage(relative, monkeypatch).ran == ["tokenizer"]
    for out_dir in (tmp_path / "rel-study", "./rel-study"):
        out = _train_stage(load_study_config(tmp_path / "s.yaml", [f"out_dir={out_dir}"]), monkeypatch)
        assert out.ran == [] and "train tadm seed 0" in out.skipped
    # moved: the records written under the old path still count
    moved = tmp_path / "moved"
    (tmp_path / "rel-study").rename(moved)
    out = _train_stage(load_study_config(tmp_path / "s.yaml", [f"out_dir={moved}"]), monkeypatch)
    assert out.ran == [] and "train ar seed 0" in out.skipped


def test_a_unit_recorded_before_eval_batch_size_existed_is_still_trained(tmp_path, monkeypatch):
    models = [{"name": "tadm", "kind": "tadm"}, {"name": "ar", "kind": "ar"}]
    cfg = _load(tmp_path, models=models, seeds=[0])
    _mark_trained(cfg)
    for marker in (tmp_path / "out" / "models").glob(f"*/{UNIT_MARKER}"):  # as written by an earlier version
        record = json.loads(marker.read_text())
        del record["spec"]["config"]["train"]["eval_batch_size"]
        marker.write_text(json.dumps(record))
    out = _train_stage(cfg, monkeypatch)
    assert out.ran == ["tokenizer"] and "train tadm seed 0" in out.skipped
    # an explicit validation batch other than the micro-batch those records validated on is another setting
    with pytest.raises(ConfigError, match="config.train.eval_batch_size: 4 there, 2 now"):
        _train_stage(_load(tmp_path, "train.eval_batch_size=2", models=models, seeds=[0]), monkeypatch)


def test_training_identity_keeps_a_tokenizer_outside_the_study():
    def spec(out_dir, tokenizer):
        return {"kind": "tadm", "config": {"train": {"out_dir": out_dir, "global_batch_size": 4},
                                           "data": {"tokenizer": tokenizer}}}
    a, b = spec("/a/models/t-s0", "/a/tokenizer"), spec("b/models/t-s0", "b/tokenizer")
    assert _training_identity(a) == _training_identity(b)
    assert _training_identity(spec("/a/models/t-s0", "/tok/x")) != _training_identity(spec("/a/models/t-s0", "/tok/y"))
    assert _training_identity(spec("/a/models/t-s0", "gpt2"))["config"]["data"]["tokenizer"] == "gpt2"


def test_refused_run_leaves_the_study_record_as_it_was(tmp_path):
    models = [{"name": "tadm", "kind": "tadm"}, {"name": "ar", "kind": "ar"}]
    cfg = _load(tmp_path, models=models, seeds=[0])
    _mark_trained(cfg)
    manifest = tmp_path / "out" / "study.json"
    manifest.write_text(json.dumps({"config": cfg.to_dict(), "invocations": []}))
    before = manifest.read_text()
    changed = _load(tmp_path, "train.max_steps=7", models=models, seeds=[0])
    with pytest.raises(ConfigError, match="trained with other settings; config.train.max_steps: 3 there, 7 now"):
        run_study(changed, **QUIET)
    assert manifest.read_text() == before


def test_unreadable_unit_record_is_named(tmp_path):
    models = [{"name": "tadm", "kind": "tadm"}, {"name": "ar", "kind": "ar"}]
    cfg = _load(tmp_path, models=models, seeds=[0])
    _mark_trained(cfg)
    (tmp_path / "out" / "models" / "tadm-s0" / UNIT_MARKER).write_text('{"spec": ')
    with pytest.raises(ConfigError, match="tadm-s0/study_unit.json is not a readable study unit record; restore it, "
                                          "or delete .*tadm-s0 to retrain the model"):
        run_study(cfg, stages=("train",), **QUIET)
    assert not (tmp_path / "out" / "study.json").exists()


def test_models_caption_says_which_evaluation_seeds_each_column_uses(tmp_path):
    cfg = _load(tmp_path, **{"staleness.eval_seeds": [3, 4]})
    res = {"models": [], "likelihood": [], "staleness": [], "cached": [], "samples": []}
    caption = next(line for line in _likelihood_lines(cfg, res) if line.startswith("Validation:"))
    assert "with the first evaluation seed (3)" in caption
    assert "averaged over the evaluation seeds [3, 4]" in caption
