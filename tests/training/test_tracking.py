"""Experiment tracking: ``train.loggers`` (jsonl, tensorboard, wandb) in pretraining, post-training and studies.

``metrics.jsonl`` is the source of truth: every test checks it, and the TensorBoard tests read the
event files back and compare them with it, across a crash and a resume (no step twice). W&B runs
against a stand-in ``wandb`` module that records its calls (and, when the package is installed, in
offline mode for real).
"""

from __future__ import annotations

import json
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tadm.cli import main
from tadm.config import PRESET_DIR, ConfigError, ExperimentConfig, load_config, save_config
from tadm.posttrain import PosttrainConfigError, PosttrainTrainer, load_posttrain_config, run_posttrain
from tadm.study import load_study_config, model_experiment_config
from tadm.training import objectives
from tadm.training.metrics import MetricsLogger, read_metrics
from tadm.training.trainer import train

from ..posttrain.conftest import build_tiny_gemma, tiny_chat_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"
CHAT = [("the cat", "sat on a mat"), ("how are you", "fine thanks"), ("what is it", "the dog ran far away"),
        ("hello", "hello how are you")]


class SimulatedCrash(Exception):
    """Raised inside a training step to stand for a killed process."""


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the TensorBoard event files in ``log_dir``, as TensorBoard shows them."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ------------------------------------------------------------------------------------ pretraining
def pretrain_config(out_dir: Path, tokenizer: Path, cache_dir: Path, *overrides: str) -> ExperimentConfig:
    return load_config(None, [
        "model.preset=tiny", f"data.source={FIXTURE}", f"data.tokenizer={tokenizer}", "data.seq_len=32",
        "data.val_fraction=0.1", f"data.cache_dir={cache_dir}", "objective.step_budgets=[8,16,32]",
        "optim.lr=3e-3", "optim.warmup_steps=2", "train.max_steps=4", "train.global_batch_size=8",
        "train.log_every=1", "train.eval_every=1000", "train.eval_batches=2", "train.save_every=2",
        "train.ema=0", "train.device=cpu", f"train.out_dir={out_dir}", *overrides,
    ])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, cache_dir: Path) -> Path:
    """A pretraining run with ``loggers=[jsonl, tensorboard]`` killed inside step 4 (state saved at 2), then resumed."""
    out = tmp_path_factory.mktemp("pretrain")
    cfg = pretrain_config(out, tokenizer_dir, cache_dir, "train.loggers=[jsonl,tensorboard]")
    real = objectives.OBJECTIVES["tadm"]
    calls = {"n": 0}

    def crashing(model: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += model.training  # validation batches do not count
        if calls["n"] > 3:  # one micro-batch per step (micro_batch_size derived): crash inside step 4
            raise SimulatedCrash
        return real(model, *args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without the tensorboard package: a warning, jsonl only
        objectives.OBJECTIVES["tadm"] = crashing
        try:
            with pytest.raises(SimulatedCrash):
                train(cfg)
        finally:
            objectives.OBJECTIVES["tadm"] = real
        train(cfg, resume=True)
    return out


@pytest.mark.slow
def test_pretraining_metrics_jsonl_holds_each_step_once_after_a_resume(pretrained: Path) -> None:
    records = read_metrics(pretrained / "metrics.jsonl")
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["split"] == "val"] == [0, 4]
    assert all(isinstance(r["loss"], float) for r in records if r["split"] == "train")


@pytest.mark.slow
def test_pretraining_tensorboard_mirrors_metrics_jsonl_without_duplicate_steps(pretrained: Path) -> None:
    events = scalars(pretrained / "tensorboard")
    records = read_metrics(pretrained / "metrics.jsonl")
    train_records = [r for r in records if r["split"] == "train"]
    # step 3 was logged by the killed run too: TensorBoard hides that copy (purge_step), as jsonl drops it
    assert [s for s, _ in events["train/loss"]] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor([v for _, v in events["train/loss"]]),
                               torch.tensor([r["loss"] for r in train_records]))
    assert [s for s, _ in events["train/lr"]] == [1, 2, 3, 4]
    assert [s for s, _ in events["val/nelbo"]] == [0, 4]
    torch.testing.assert_close(torch.tensor([v for _, v in events["val/nelbo"]]),
                               torch.tensor([r["nelbo"] for r in records if r["split"] == "val"]))


def test_the_older_tensorboard_key_still_turns_tensorboard_on(tmp_path: Path) -> None:
    assert load_config(None, ["train.tensorboard=true"]).train.loggers == ["jsonl", "tensorboard"]
    (tmp_path / "old.yaml").write_text("train:\n  tensorboard: true\n  loggers: [jsonl, wandb]\n")
    cfg = load_config(tmp_path / "old.yaml")
    assert cfg.train.loggers == ["jsonl", "wandb", "tensorboard"] and cfg.train.tensorboard is False
    save_config(cfg, tmp_path / "saved.yaml")  # the resolved config says it in one place
    assert load_config(tmp_path / "saved.yaml") == cfg
    assert load_config(None, ["train.tensorboard=true", "train.loggers=[tensorboard]"]).train.loggers == [
        "tensorboard"]
    assert load_config().train.loggers == ["jsonl"]


def test_jsonl_is_written_even_when_not_listed(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, loggers=[])
    log.log(1, "train", {"loss": 2.5, "flag": True})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "split": "train", "loss": 2.5, "flag": True}]
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()


# ---------------------------------------------------------------------------------- post-training
@pytest.fixture(scope="module")
def chat_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny DiffusionGemma with its chat tokenizer, and a chat JSONL."""
    root = tmp_path_factory.mktemp("posttrain-files")
    build_tiny_gemma(seed=2).save_pretrained(root / "base")
    tiny_chat_tokenizer().save_pretrained(root / "base")
    (root / "chat.jsonl").write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in CHAT))
    return root


def posttrain_config(files: Path, out_dir: Path, *extra: str) -> Any:
    return load_posttrain_config(PRESET_DIR / "posttrain-tiny.yaml", [
        f"base.path={files / 'base'}", f"data.train_file={files / 'chat.jsonl'}", f"train.out_dir={out_dir}",
        "train.max_steps=4", "train.micro_batch_size=2", "train.grad_accum_steps=1", "train.save_every=2",
        "train.log_every=1", "fusion.rank=8", "rollout.sampler.num_steps=6", "data.canvases_per_example=1",
        "optim.warmup_steps=1", *extra,
    ])


@pytest.fixture(scope="module")
def posttrained(chat_files: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Post-training with ``loggers=[jsonl, tensorboard]`` killed inside step 4 (state saved at 2), then resumed."""
    out = tmp_path_factory.mktemp("posttrain")
    cfg = posttrain_config(chat_files, out, "train.loggers=[jsonl,tensorboard]")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    real_step = PosttrainTrainer.train_step

    def crash_in_step_4(self: PosttrainTrainer, micro_batches: Any) -> Any:
        if self.step == 3:
            raise SimulatedCrash
        return real_step(self, micro_batches)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # without the tensorboard package: a warning, jsonl only
            PosttrainTrainer.train_step = crash_in_step_4  # type: ignore[method-assign]
            try:
                with pytest.raises(SimulatedCrash):
                    run_posttrain(cfg, log=lambda m: None)
            finally:
                PosttrainTrainer.train_step = real_step  # type: ignore[method-assign]
            run_posttrain(cfg, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.slow
def test_posttraining_writes_metrics_jsonl_through_the_shared_logger(posttrained: Path) -> None:
    records = read_metrics(posttrained / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # step 3 of the killed run was dropped on resume
    assert {r["split"] for r in records} == {"train"}
    assert {"loss", "ce", "kd", "grad_norm", "lr", "tokens"} <= set(records[0])
    assert all(r["loss"] == pytest.approx(r["ce"] + r["kd"], rel=1e-5) for r in records)  # weights 1 and 1


@pytest.mark.slow
def test_posttraining_tensorboard_mirrors_metrics_jsonl_without_duplicate_steps(posttrained: Path) -> None:
    events = scalars(posttrained / "tensorboard")
    records = read_metrics(posttrained / "metrics.jsonl")
    for key in ("loss", "ce", "kd", "grad_norm", "lr"):
        assert [s for s, _ in events[f"train/{key}"]] == [1, 2, 3, 4], key
        torch.testing.assert_close(torch.tensor([v for _, v in events[f"train/{key}"]]),
                                   torch.tensor([float(r[key]) for r in records]))


# -------------------------------------------------------------------------------------------- W&B
class FakeWandb(types.ModuleType):
    """Stands in for the ``wandb`` package: records ``init`` arguments, ``log`` calls and ``finish``."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.finished = 0

    def init(self, **kwargs: Any) -> Any:
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, data: dict[str, Any], step: int | None = None) -> None:
                fake.logged.append((step, dict(data)))

            def finish(self) -> None:
                fake.finished += 1

        return Run()


@pytest.mark.slow
def test_wandb_logs_what_metrics_jsonl_holds(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    cfg = pretrain_config(out, tokenizer_dir, cache_dir, "train.max_steps=2", "train.loggers=[jsonl,wandb]",
                          "train.wandb_project=tadm-tests")
    train(cfg)
    (init,) = fake.inits
    assert init["project"] == "tadm-tests" and init["mode"] == "offline"
    assert Path(init["dir"]) == out and init["name"] == "run"  # wandb writes its files to out_dir/wandb
    assert init["config"]["train"]["loggers"] == ["jsonl", "wandb"]
    records = read_metrics(out / "metrics.jsonl")
    assert [(s, sorted(d)) for s, d in fake.logged] == [
        (r["step"], sorted(f"{r['split']}/{k}" for k in r if k not in ("step", "split"))) for r in records]
    train_losses = [d["train/loss"] for _, d in fake.logged if "train/loss" in d]
    assert train_losses == [r["loss"] for r in records if r["split"] == "train"]
    assert fake.finished == 1


def test_wandb_default_project_and_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert load_config().train.wandb_project == "tadm"
    log = MetricsLogger(tmp_path / "a", loggers=["jsonl", "wandb"])
    log.close()
    log.close()  # idempotent
    assert fake.inits[0]["project"] == "tadm" and fake.inits[0]["mode"] is None and fake.finished == 1
    assert MetricsLogger(tmp_path / "b", enabled=False, loggers=["wandb"])._wandb is None  # other ranks: nothing
    assert len(fake.inits) == 1

    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of wandb now fails: not installed
    with pytest.warns(UserWarning, match="pip install wandb"):
        log = MetricsLogger(tmp_path / "c", loggers=["jsonl", "wandb"])
    log.log(1, "train", {"loss": 1.0})
    log.close()
    assert read_metrics(tmp_path / "c" / "metrics.jsonl") == [{"step": 1, "split": "train", "loss": 1.0}]


def test_wandb_offline_for_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(tmp_path, loggers=["jsonl", "wandb"], wandb_project="tadm-tests", config={"a": 1})
    log.log(1, "train", {"loss": 1.5})
    log.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")), sorted(map(str, tmp_path.rglob("*")))
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "split": "train", "loss": 1.5}]


# ------------------------------------------------------------------------------------ bad values
def test_an_unknown_logger_is_one_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needle = "train.loggers has unknown logger(s) 'mlflow'; valid: jsonl, tensorboard, wandb"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.loggers=[jsonl,mlflow]"])
    assert str(err.value) == needle
    with pytest.raises(PosttrainConfigError) as err:
        load_posttrain_config(None, ["train.loggers=[mlflow]"])
    assert str(err.value) == needle
    with pytest.raises(ConfigError, match=r"loggers has unknown logger\(s\) 'mlflow'; valid: jsonl, tensorb"):
        MetricsLogger(tmp_path, loggers=["jsonl", "mlflow"])

    code = main(["train", "tadm-tiny", "train.loggers=[jsonl,mlflow]", f"train.out_dir={tmp_path / 'run'}"])
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err_lines) == 1 and needle in err_lines[0]
    assert not (tmp_path / "run").exists()


# -------------------------------------------------------------------------------------- studies
def test_study_units_inherit_the_loggers(tmp_path: Path) -> None:
    study = {
        "name": "s", "out_dir": str(tmp_path / "study"), "seeds": [0, 1],
        "models": [{"name": "tadm", "kind": "tadm"}, {"name": "mdlm", "kind": "mdlm",
                                                      "overrides": ["train.loggers=[jsonl]"]}],
        "sampling": {"evaluators": ["smollm2-135m"]},
        "train": {"loggers": ["jsonl", "tensorboard", "wandb"], "wandb_project": "study-runs"},
    }
    (tmp_path / "study.yaml").write_text(json.dumps(study))
    cfg = load_study_config(tmp_path / "study.yaml")
    unit = model_experiment_config(cfg, cfg.model("tadm"), 1)
    assert unit.train.loggers == ["jsonl", "tensorboard", "wandb"] and unit.train.wandb_project == "study-runs"
    assert model_experiment_config(cfg, cfg.model("mdlm"), 0).train.loggers == ["jsonl"]  # a model's own override

    legacy = load_study_config(tmp_path / "study.yaml", ["train.loggers=[jsonl]", "train.tensorboard=true"])
    assert model_experiment_config(legacy, legacy.model("tadm"), 0).train.loggers == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError, match=r"train\.loggers has unknown logger\(s\) 'mlflow'"):
        load_study_config(tmp_path / "study.yaml", ["train.loggers=[mlflow]"])


# ------------------------------------------------------------------------ a folder TensorBoard cannot write
def _read_only(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``folder`` read-only: by its mode, and by os.access for root too (whom the mode does not stop)."""
    import os

    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != folder and real_access(path, mode, **kw))


def test_a_read_only_tensorboard_folder_is_one_line_before_the_writer_starts(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    started: list[str] = []
    monkeypatch.setattr(tensorboard, "SummaryWriter", lambda log_dir, **kw: started.append(log_dir))
    _read_only(tmp_path / "tensorboard", monkeypatch)
    try:
        with pytest.raises(ConfigError) as error:
            MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"])
        message = str(error.value)
        assert "\n" not in message and f"'{tmp_path / 'tensorboard'}' is not writable" in message, message
        assert "train.loggers" in message and started == []  # no writer thread to fail after the message
    finally:
        (tmp_path / "tensorboard").chmod(0o755)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tensorboard").write_text("user data")  # a file where the folder goes
    with pytest.raises(ConfigError, match=r"tensorboard' is a file, not a folder"):
        MetricsLogger(tmp_path / "other", loggers=["tensorboard"])
    assert (tmp_path / "other" / "tensorboard").read_text() == "user data" and started == []


def test_pretraining_with_a_read_only_tensorboard_folder_is_one_cli_line(tmp_path: Path, tokenizer_dir: Path,
                                                                         cache_dir: Path, capsys: pytest.CaptureFixture,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    out = tmp_path / "run"
    save_config(pretrain_config(out, tokenizer_dir, cache_dir, "train.loggers=[jsonl,tensorboard]"), tmp_path / "c.yaml")
    _read_only(out / "tensorboard", monkeypatch)
    try:
        assert main(["train", str(tmp_path / "c.yaml")]) == 2
    finally:
        (out / "tensorboard").chmod(0o755)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("tadm train: error: ") and "tensorboard" in err[0], err
    assert list((out / "tensorboard").iterdir()) == []
