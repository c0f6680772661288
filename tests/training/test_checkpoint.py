"""Checkpoints: atomic training state, RNG round trips, model directories, exact resumption on CPU."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tadm.config import ConfigError, ExperimentConfig, load_config
from tadm.nn import build_model, load_model
from tadm.training import objectives
from tadm.training.checkpoint import (
    CONFIG_FILENAME,
    STATE_FORMAT,
    UnsafeStateError,
    capture_rng_state,
    load_training_state,
    restore_rng_state,
    save_model_dir,
    save_training_state,
)
from tadm.training.metrics import read_metrics
from tadm.training.tokenization import TextTokenizer
from tadm.training.trainer import TrainResult, train

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"


def run_config(out_dir: Path, tokenizer_dir: Path, cache_dir: Path, *overrides: str) -> ExperimentConfig:
    """Tiny TADM with dropout, EMA, cosine decay and gradient accumulation: every piece of state matters."""
    base = [
        "model.arch=tadm",
        "model.preset=tiny",
        "model.overrides.dropout=0.1",
        f"data.source={FIXTURE}",
        f"data.tokenizer={tokenizer_dir}",
        "data.seq_len=32",
        "data.val_fraction=0.1",
        f"data.cache_dir={cache_dir}",
        "objective.refresh_intervals=[1,2,4]",
        "objective.step_budgets=[8,16]",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "optim.lr_schedule=cosine",
        "train.max_steps=6",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.log_every=1",
        "train.eval_every=1000",
        "train.eval_batches=1",
        "train.save_every=1000",
        "train.ema=0.8",
        "train.device=cpu",
        f"train.out_dir={out_dir}",
    ]
    return load_config(None, base + list(overrides))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, cache_dir: Path) -> TrainResult:
    """An uninterrupted 6-step run."""
    return train(run_config(tmp_path_factory.mktemp("straight"), tokenizer_dir, cache_dir))


class SimulatedCrash(Exception):
    """Raised from inside a training step to stand for a killed process."""


def assert_same_weights(dir_a: Path, dir_b: Path) -> None:
    a, b = load_file(dir_a / "model.safetensors"), load_file(dir_b / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ------------------------------------------------------------------------------------ resumption
@pytest.mark.slow
def test_three_plus_three_steps_equal_six_straight(
    straight: TrainResult, tmp_path: Path, tokenizer_dir: Path, cache_dir: Path
) -> None:
    first = train(run_config(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=3"))
    second = train(run_config(tmp_path, tokenizer_dir, cache_dir), resume=True)
    assert (first.step, second.start_step, second.step) == (3, 3, 6)
    assert len(straight.losses) == 6
    assert first.losses + second.losses == straight.losses  # bit-exact float equality
    # EMA weights (saved in final/) and raw weights (in the training state) match too.
    assert_same_weights(straight.model_dir, second.model_dir)
    raw_a = load_training_state(straight.state_path)["model"]
    raw_b = load_training_state(second.state_path)["model"]
    assert all(torch.equal(raw_a[k], raw_b[k]) for k in raw_a)
    # the metrics history is one continuous record
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_resume_after_a_crash_continues_exactly(
    straight: TrainResult, tmp_path: Path, tokenizer_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = objectives.OBJECTIVES["tadm"]
    calls = {"n": 0}

    def crashing(model, *args, **kwargs):
        calls["n"] += model.training  # validation batches do not count
        if calls["n"] > 2 * 4:  # 2 micro-batches per step: crash inside step 5
            raise SimulatedCrash
        return real(model, *args, **kwargs)

    monkeypatch.setitem(objectives.OBJECTIVES, "tadm", crashing)
    with pytest.raises(SimulatedCrash):
        train(run_config(tmp_path, tokenizer_dir, cache_dir, "train.save_every=2"))
    assert load_training_state(tmp_path / "training_state.pt")["step"] == 4
    assert not (tmp_path / "final").exists()
    monkeypatch.setitem(objectives.OBJECTIVES, "tadm", real)

    resumed = train(run_config(tmp_path, tokenizer_dir, cache_dir, "train.save_every=2"), resume=True)
    assert resumed.start_step == 4
    assert resumed.losses == straight.losses[4:]
    logged = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")]
    assert logged == straight.losses  # steps 1-4 from the crashed run, 5-6 from the resumed one
    assert_same_weights(straight.model_dir, resumed.model_dir)


@pytest.mark.slow
def test_resume_refuses_a_changed_config(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path) -> None:
    train(run_config(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=1"))
    with pytest.raises(ConfigError, match=r"optim\.lr: saved 0\.003, now 0\.1"):
        train(run_config(tmp_path, tokenizer_dir, cache_dir, "optim.lr=0.1"), resume=True)
    with pytest.raises(ConfigError, match="already holds a run"):
        train(run_config(tmp_path, tokenizer_dir, cache_dir))
    with pytest.raises(ConfigError, match="nothing to resume"):
        train(run_config(tmp_path / "elsewhere", tokenizer_dir, cache_dir), resume=True)


# ------------------------------------------------------------------------------- state files
def test_training_state_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "training_state.pt"
    good = {"format": STATE_FORMAT, "step": 3, "w": torch.arange(4.0)}
    save_training_state(good, path)

    def torn_write(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_write)
    with pytest.raises(OSError, match="disk full"):
        save_training_state({"format": STATE_FORMAT, "step": 4}, path)
    monkeypatch.undo()
    loaded = load_training_state(path)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], good["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["training_state.pt"]  # no temporary files left


def test_training_state_loads_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "s.pt"
    torch.save({"format": STATE_FORMAT, "evil": Path("x")}, path)  # an arbitrary class is refused
    with pytest.raises(pickle.UnpicklingError):
        load_training_state(path)
    with pytest.raises(UnsafeStateError, match=r"refusing to load .*s\.pt: it would import or call 'pathlib\."):
        load_training_state(path)
    assert issubclass(UnsafeStateError, ValueError)  # a user error: the CLI prints it in one line
    torch.save({"format": 99}, path)
    with pytest.raises(ValueError, match="format"):
        load_training_state(path)
    with pytest.raises(FileNotFoundError, match="no training state"):
        load_training_state(tmp_path / "missing.pt")


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    save_training_state({"format": STATE_FORMAT, "rng": capture_rng_state()}, tmp_path / "s.pt")
    first = (torch.rand(3), np.random.rand(3), np.random.standard_normal(), random.random(), random.gauss(0, 1))
    restore_rng_state(load_training_state(tmp_path / "s.pt")["rng"])
    second = (torch.rand(3), np.random.rand(3), np.random.standard_normal(), random.random(), random.gauss(0, 1))
    assert torch.equal(first[0], second[0])
    assert np.array_equal(first[1], second[1])
    assert first[2:] == second[2:]


def test_model_dir_holds_model_tokenizer_and_config(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = TextTokenizer.load(tokenizer_dir)
    model = build_model("mdlm-tiny", vocab_size=tok.vocab_size)
    cfg = load_config(None, ["model.arch=mdlm", "train.max_steps=7"])
    target = tmp_path / "final"
    target.mkdir()
    (target / "stale.txt").write_text("from an older save")
    save_model_dir(model, target, tokenizer=tok, config=cfg)
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tadm_tokenizer.json", CONFIG_FILENAME} <= names
    assert "stale.txt" not in names  # replaced as a whole
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no temporary directories left
    loaded = load_model(target)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert TextTokenizer.load(target).fingerprint() == tok.fingerprint()
    assert load_config(target / CONFIG_FILENAME) == cfg
