"""Data-parallel training: two CPU processes (gloo) against one process with the same global batch."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tadm.config import ExperimentConfig, load_config, save_config
from tadm.training import trainer
from tadm.training.checkpoint import load_training_state
from tadm.training.distributed import (DistInfo, all_reduce_mean, cleanup, init_distributed, main_process_first,
                                       wrap_model)
from tadm.training.tokenization import train_bpe_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"
WORLD = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_capturing(cfg: ExperimentConfig) -> tuple[trainer.TrainResult, dict[str, torch.Tensor]]:
    """Run ``train`` and return the trained (raw) model's weights as well."""
    captured = {}
    real = trainer.build_training_model

    def build(*args, **kwargs):
        captured["model"] = real(*args, **kwargs)
        return captured["model"]

    trainer.build_training_model = build
    try:
        result = trainer.train(cfg)
    finally:
        trainer.build_training_model = real
    return result, {k: v.detach().clone() for k, v in captured["model"].state_dict().items()}


def _worker(rank: int, port: int, config_path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    result, weights = _train_capturing(load_config(config_path))
    torch.save({"losses": result.losses, "val": result.val_history, "weights": weights},
               Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("arch, micro", [
    ("tadm", ["train.micro_batch_size=2"]),  # 1 process: 4 micro-batches per step; 2 ranks: 2 each
    # derived micro-batches (8 on 1 process, 4 per rank on 2): the noise-free AR trains alike, and validation,
    # scored in whole global batches, gives the same numbers
    ("ar", []),
])
def test_two_gloo_ranks_match_one_process(arch: str, micro: list[str], tmp_path: Path) -> None:
    docs = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines()]
    train_bpe_tokenizer(docs, vocab_size=320, save_dir=tmp_path / "tok")
    common = [
        "model.preset=tiny",
        f"model.arch={arch}",
        f"data.source={FIXTURE}",
        f"data.tokenizer={tmp_path / 'tok'}",
        "data.seq_len=32",
        "data.val_fraction=0.1",
        f"data.cache_dir={tmp_path / 'cache'}",
        "optim.lr=3e-3",
        "optim.warmup_steps=1",
        "train.max_steps=4",
        "train.global_batch_size=8",
        *micro,
        "train.log_every=1",
        "train.eval_every=2",
        "train.eval_batches=3",
        "train.save_every=2",
        "train.ema=0.5",
        "train.device=cpu",
    ]
    single, single_weights = _train_capturing(load_config(None, [*common, f"train.out_dir={tmp_path / 'one'}"]))

    ddp_cfg = load_config(None, [*common, f"train.out_dir={tmp_path / 'two'}"])
    save_config(ddp_cfg, tmp_path / "ddp.yaml")
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path / "ddp.yaml"), str(tmp_path)), nprocs=WORLD,
                       join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

    # every rank holds identical weights and logged identical (all-reduced) losses
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["val"] == ranks[1]["val"]
    # ... which match one process over the same global batch (up to summation order)
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single.losses), rtol=1e-5, atol=1e-6)
    for key, value in single_weights.items():
        torch.testing.assert_close(ranks[0]["weights"][key], value, rtol=1e-4, atol=1e-5)
    assert [s for s, _ in ranks[0]["val"]] == [s for s, _ in single.val_history] == [0, 2, 4]
    torch.testing.assert_close(torch.tensor([v for _, v in ranks[0]["val"]]),
                               torch.tensor([v for _, v in single.val_history]), rtol=1e-5, atol=1e-6)
    # only rank 0 wrote the run's files
    assert (tmp_path / "two" / "final" / "model.safetensors").is_file()
    assert len((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()) == 4 + 3
    assert load_training_state(tmp_path / "two" / "training_state.pt")["world_size"] == WORLD


def _failing_worker(rank: int, port: int, out_dir: str, which: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    info = init_distributed("cpu")
    ran = []
    try:
        with main_process_first(info):
            ran.append(info.rank)
            if info.is_main and which == "data":
                raise trainer.DataPreparationError("corpus file or directory '/nonexistent.jsonl' does not exist")
            if info.is_main and which == "local":
                class Local(ValueError):  # pickle cannot name it in another process: rebuilt as a RuntimeError
                    pass
                raise Local("a class defined in a function")
        outcome = ("ok", "")
    except Exception as err:
        outcome = (type(err).__name__, str(err))
    finally:
        cleanup(info)
    torch.save({"outcome": outcome, "ran": ran}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("which, expected", [
    ("data", ("DataPreparationError", "corpus file or directory '/nonexistent.jsonl' does not exist")),
    ("local", ("RuntimeError", "a class defined in a function")),
    ("none", ("ok", "")),
])
def test_an_error_of_rank_0_in_main_process_first_is_raised_on_every_rank(which: str, expected: tuple[str, str],
                                                                        tmp_path: Path) -> None:
    """Rank 1 raises rank 0's error (its class and one-line message) instead of dying in a gloo barrier."""
    mp.start_processes(_failing_worker, args=(_free_port(), str(tmp_path), which), nprocs=WORLD, join=True,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    if which != "local":
        assert ranks[0]["outcome"] == expected
    assert ranks[1]["outcome"] == expected
    # rank 1 runs the body only after rank 0 succeeded
    assert [r["ran"] for r in ranks] == ([[0], [1]] if which == "none" else [[0], []])


def test_single_process_helpers_are_no_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = init_distributed("cpu")
    assert info == DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
    assert info.is_main and not info.distributed
    x = torch.tensor([1.0, 3.0])
    assert torch.equal(all_reduce_mean(x, info), x)
    model = torch.nn.Linear(2, 2)
    assert wrap_model(model, info) is model
    with main_process_first(info):
        pass
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="RANK=5"):
        init_distributed("cpu")
