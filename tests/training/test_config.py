"""Experiment configs: every shipped preset loads and builds its model; strict validation; overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tadm.config import PRESET_DIR, ConfigError, ExperimentConfig, load_config, save_config, short_run_warnings
from tadm.posttrain import load_posttrain_config
from tadm.training.trainer import build_training_model, objective_config

CONFIGS = PRESET_DIR
# Every pretraining preset: the configs launched with `tadm train` (others, e.g. posttrain-*.yaml,
# belong to other commands with their own schemas).
SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml") if "tadm train " in p.read_text())


class FakeTokenizer:
    """Just the vocabulary facts the model builder checks (GPT-2 + mask, or a 4096-id BPE)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.mask_id = vocab_size - 1


def test_the_expected_presets_ship() -> None:
    expected = {"tadm-owt-small.yaml", "tadm-tiny.yaml", "mdlm-tiny.yaml", "adlm-tiny.yaml", "ar-tiny.yaml",
                "tadm-brown-cpu.yaml"}
    assert expected <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads_and_builds(name: str) -> None:
    path = CONFIGS / name
    header = path.read_text().splitlines()
    launch = [line for line in header if line.startswith("#") and f"tadm train {name.removesuffix('.yaml')}" in line]
    assert launch, f"{name} needs its launch command in a header comment"
    cfg = load_config(path)
    vocab = 50258 if cfg.data.tokenizer == "gpt2" else cfg.data.tokenizer_vocab_size
    objective_config(cfg)
    with torch.device("meta"):  # sizes only, no memory
        model = build_training_model(cfg, FakeTokenizer(vocab))  # type: ignore[arg-type]
    assert model.vocab_size == vocab
    assert model.config.max_seq_len >= cfg.data.seq_len
    assert cfg.train.out_dir == f"runs/{name.removesuffix('.yaml')}"
    assert short_run_warnings(cfg.optim, cfg.train) == []  # a shipped run warms up and averages within its steps


def test_a_minimal_yaml_that_inherits_paper_scale_schedules_is_warned_about(tmp_path: Path) -> None:
    minimal = tmp_path / "mine.yaml"
    minimal.write_text("model: {arch: tadm}\n")
    cfg = load_config(minimal)  # the defaults: 1,000 steps, the paper's 2,500 warm-up steps and EMA 0.9999
    assert short_run_warnings(cfg.optim, cfg.train) == [
        "optim.warmup_steps=2500 exceeds train.max_steps=1000: the learning rate only reaches 40% of optim.lr=0.0003 "
        "by the end of the run; set optim.warmup_steps below train.max_steps",
        "train.ema=0.9999 over train.max_steps=1000: the saved (EMA) weights are still 90% the initial ones; lower "
        "train.ema (e.g. 0.99) or set it to 0 for a short run",
    ]
    fixed = load_config(minimal, ["optim.warmup_steps=1000", "train.ema=0.99"])  # warm-up may end on the last step
    assert short_run_warnings(fixed.optim, fixed.train) == []
    paper = load_config(minimal, ["train.max_steps=1000000"])  # the paper's schedule on the paper's run length
    assert short_run_warnings(paper.optim, paper.train) == []


def test_owt_small_is_the_paper_setting() -> None:
    cfg = load_config(CONFIGS / "tadm-owt-small.yaml")
    assert (cfg.model.arch, cfg.model.preset, cfg.data.source, cfg.data.tokenizer) == (
        "tadm", "small", "openwebtext", "gpt2")
    assert (cfg.data.seq_len, cfg.train.global_batch_size, cfg.train.max_steps) == (1024, 512, 1_000_000)
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.eps, cfg.optim.weight_decay) == (3e-4, [0.9, 0.999], 1e-8, 0.0)
    assert (cfg.optim.warmup_steps, cfg.optim.grad_clip, cfg.train.ema, cfg.train.precision) == (
        2500, 1.0, 0.9999, "bf16")
    assert cfg.objective.refresh_intervals == [1, 2, 4, 8]
    assert cfg.objective.step_budgets == [128, 256, 512, 1024, 2048, 4096]
    # validation keeps its cost: 16 batches of 16 blocks, not 16 of the 512-sequence global batch
    assert (cfg.train.eval_batches, cfg.train.eval_batch_size) == (16, 16)
    with torch.device("meta"):
        model = build_training_model(cfg, FakeTokenizer(50258))  # type: ignore[arg-type]
    # 224M inference parameters (the paper's count; gamma = 0 builds no anchor LM head)
    assert sum(p.numel() for p in model.parameters()) == model.inference_parameters() == 223_960_146
    assert (model.config.anchor_layers, model.config.denoiser_layers, model.config.hidden_size) == (12, 6, 768)


def test_overrides_and_round_trip(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "tadm-tiny.yaml", ["train.max_steps=7", "objective.refresh_intervals=[1,3]",
                                                   "model.overrides.hidden_size=64", "train.save_best=true"])
    assert cfg.train.max_steps == 7 and cfg.objective.refresh_intervals == [1, 3]
    assert cfg.model.overrides == {"hidden_size": 64} and cfg.train.save_best is True
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert load_config() == ExperimentConfig()


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.max_stepz=3", "max_stepz"),
        ("optim.nope=1", "optim.nope"),
        ("train.max_steps=lots", "train.max_steps"),
        ("train.global_batch_size=30", "multiple of"),
        ("objective.anchor_common_mass=0", "objective.anchor_common_mass"),
        ("optim.grad_clip=-1", "optim.grad_clip"),
        ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
        ("train.device=tpu", "train.device"),
        ("train.ema=1.0", "train.ema"),
        ("model.arch=sedd", "valid: tadm, mdlm, adlm, ar"),
        ("objective.refresh_intervals=[0]", "objective.refresh_intervals"),
        ("train.overwrite=maybe", "train.overwrite"),
        ("optim.lr=nan", "optim.lr must be a finite number > 0, got nan"),
        ("optim.lr=inf", "optim.lr must be a finite number > 0, got inf"),
        ("optim.eps=0", "optim.eps must be a finite number > 0, got 0.0"),
        ("optim.betas=[nan,0.9]", "optim.betas[0] must be a finite number in [0, 1), got nan"),
        ("optim.weight_decay=nan", "optim.weight_decay must be a finite number >= 0, got nan"),
        ("optim.grad_clip=inf", "optim.grad_clip must be a finite number >= 0 (0 disables clipping), got inf"),
        ("optim.min_lr_ratio=nan", "optim.min_lr_ratio must be a finite number in [0, 1], got nan"),
        ("objective.gamma=inf", "objective.gamma must be a finite number >= 0, got inf"),
        ("objective.eps=nan", "objective.eps must be a finite number in (0, 1), got nan"),
        ("train.ema=nan", "train.ema must be a finite number in [0, 1) (0 disables EMA), got nan"),
        ("data.val_fraction=inf", "data.val_fraction must be a finite number in (0, 1), got inf"),
        ("data.seq_len=0", "data.seq_len must be an integer >= 1, got 0"),
        ("train.eval_batch_size=0", "train.eval_batch_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_values_fail_loudly_naming_the_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle) if " " in needle else needle.replace(".", r"\.")):
        load_config(None, ["train.micro_batch_size=8", override])


def test_a_bad_key_in_the_file_is_reported_before_a_malformed_override(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  nosuchkey: 1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: .*nosuchkey"):
        load_config(str(path), ["oops"])
    with pytest.raises(ConfigError, match="overrides must look like section.key=value, got 'oops'"):
        load_config(None, ["oops"])


def test_an_unknown_key_names_what_its_section_has(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^overrides: unknown key 'model\.nosuch'; section 'model' has: arch, "
                                          r"preset, overrides$"):
        load_config(None, ["model.nosuch=1"])
    with pytest.raises(ConfigError, match=r"posttrain-tiny\.yaml: unknown key 'base'; the config has: model, data, "
                                          r"objective, optim, train$"):
        load_config("posttrain-tiny")  # a post-training preset given to the pretraining schema
    scalar = tmp_path / "notes.yaml"
    scalar.write_text("root:x:0:0:" + "y" * 200 + "\n")  # not a mapping: one long key
    with pytest.raises(ConfigError) as err:
        load_config(str(scalar))
    shown = ("root:x:0:0:" + "y" * 200)[:57] + "..."  # a key past 60 characters is cut
    assert str(err.value) == f"{scalar}: unknown key '{shown}'; the config has: model, data, objective, optim, train"


@pytest.mark.parametrize("text, got", [("model: 3\n", "got 3"), ("model: [tiny]\n", "got ['tiny']"),
                                       ("model:\n", "got nothing (an empty section)")])
def test_a_section_that_is_no_mapping_is_named(tmp_path: Path, text: str, got: str) -> None:
    path = tmp_path / "section.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == f"{path}: section 'model' must be a mapping of its keys (arch, preset, overrides), {got}"


def test_a_nested_section_that_is_no_mapping_is_named_by_its_path(tmp_path: Path) -> None:
    path = tmp_path / "posttrain.yaml"
    path.write_text("rollout:\n  sampler: 3\n")
    with pytest.raises(ConfigError, match=r"posttrain\.yaml: section 'rollout\.sampler' must be a mapping of its keys "
                                          r"\(entropy_bound, .*num_steps.*\), got 3$"):
        load_posttrain_config(str(path))


def test_a_config_that_is_a_list_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- train\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: a config is a YAML mapping of sections"):
        load_config(str(path))


def test_unknown_schedule_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="objective.schedule.*valid names"):
        objective_config(load_config(None, ["objective.schedule=quadratic"]))


def test_preset_path_finds_shipped_presets() -> None:
    from tadm.config import preset_path

    assert preset_path("tadm-brown-cpu") == preset_path("tadm-brown-cpu.yaml")
    assert preset_path("tadm-brown-cpu").resolve() == (CONFIGS / "tadm-brown-cpu.yaml").resolve()
    with pytest.raises(FileNotFoundError, match="shipped presets: .*tadm-tiny"):
        preset_path("tadm-hugee")


def test_an_unknown_config_lists_the_presets_of_its_own_recipe() -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_config("tadm-hugee")
    assert "(presets: adlm-tiny, ar-tiny, mdlm-tiny, tadm-brown-cpu, tadm-owt-small, tadm-tiny)" in str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        load_posttrain_config("gemma-hugee")
    assert str(err.value) == ("post-training config 'gemma-hugee' is neither a file nor a shipped post-training "
                              "preset (presets: posttrain-diffusiongemma, posttrain-mdlm-owt, posttrain-tiny)")


def test_one_loader_for_every_recipe(tmp_path: Path) -> None:
    """Pretraining, post-training and study configs load through ``load_structured`` with their own errors."""
    from tadm.config import load_structured
    from tadm.posttrain import PosttrainConfig, PosttrainConfigError, load_posttrain_config
    from tadm.study import load_study_config

    assert issubclass(PosttrainConfigError, ConfigError)
    cfg = load_structured(PosttrainConfig, None, ["train.max_steps=9"], error=PosttrainConfigError)
    assert cfg == load_posttrain_config(None, ["train.max_steps=9"]) and cfg.train.max_steps == 9
    with pytest.raises(PosttrainConfigError, match=r"overrides: .*'train\.nope'"):
        load_posttrain_config(None, ["train.nope=1"])
    with pytest.raises(PosttrainConfigError, match="overrides: .*categorical draw"):  # a section's __post_init__
        load_posttrain_config(None, ["rollout.sampler.categorical=topk"])
    seen: list[ExperimentConfig] = []
    assert load_structured(ExperimentConfig, None, (), validate=seen.append) == ExperimentConfig() == seen[0]

    bad = tmp_path / "broken.yaml"
    bad.write_text("train:\n  max_steps: [1, 2\n  seed: 0\n")
    for loader, error in ((load_config, ConfigError), (load_posttrain_config, PosttrainConfigError),
                          (load_study_config, ConfigError)):
        with pytest.raises(error) as caught:
            loader(bad)
        message = str(caught.value)
        assert len(message.splitlines()) == 1, message
        assert message.startswith(f"{bad}: not valid YAML: ") and "(line 3, column" in message, message


def test_every_architecture_says_which_objective_keys_its_loss_reads() -> None:
    from dataclasses import fields

    from tadm.config import ARCHITECTURES, OBJECTIVE_KEYS_USED, ObjectiveSection, check_objective_keys

    assert set(OBJECTIVE_KEYS_USED) == set(ARCHITECTURES)
    names = {f.name for f in fields(ObjectiveSection)}
    assert set().union(*OBJECTIVE_KEYS_USED.values()) == names  # every key is read by some loss
    for preset in ("tadm-tiny", "mdlm-tiny", "adlm-tiny", "ar-tiny", "tadm-brown-cpu", "tadm-owt-small"):
        check_objective_keys(load_config(preset))  # the shipped presets set only what their architecture reads


def test_a_mapping_where_a_list_belongs_names_the_key(tmp_path):
    # OmegaConf's merge raises a bare TypeError ("incompatible container types") for these
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {arch: tadm, preset: tiny}\nobjective: {refresh_intervals: {a: 1}}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: objective\.refresh_intervals must be a list, got a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"^overrides: objective\.refresh_intervals must be a list, got a mapping"):
        load_config(PRESET_DIR / "tadm-tiny.yaml", ["objective.refresh_intervals={a: 1}"])
    with pytest.raises(ConfigError, match=r"cannot set one item of a list: give the whole list"):
        load_config(PRESET_DIR / "tadm-tiny.yaml", ["objective.refresh_intervals[0]=3"])


def test_an_override_that_replaces_a_section_with_a_value_names_the_section():
    with pytest.raises(ConfigError, match=r"^overrides: section 'model' must be a mapping of its keys \(arch, preset"):
        load_config(PRESET_DIR / "tadm-tiny.yaml", ["model=[1, 2]"])


def test_eval_batch_size_defaults_to_the_global_batch() -> None:
    assert load_config().train.eval_batch_size is None  # read as train.global_batch_size by the trainer
    assert load_config(None, ["train.eval_batch_size=4"]).train.eval_batch_size == 4
    for name in SHIPPED:  # only the paper-size preset sets it (its global batch of 512 is 32 micro-batches)
        expected = 16 if name == "tadm-owt-small.yaml" else None
        assert load_config(CONFIGS / name).train.eval_batch_size == expected, name
