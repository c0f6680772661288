"""Batch sizes that follow the world size: ``train.micro_batch_size`` unset splits the global batch over the ranks.

The split itself is a pure function checked case by case; then ``torchrun --nproc_per_node=2 -m tadm
train tadm-tiny`` runs on two CPU processes (gloo) without a batch override and reports the derived
micro-batch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tadm.config import PRESET_DIR, ConfigError, load_config
from tadm.training.checkpoint import load_training_state
from tadm.training.distributed import split_global_batch
from tadm.training.metrics import read_metrics

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "global_batch, world, micro, expected",
    [
        (32, 1, None, (32, 1)),  # one process: the whole batch at once
        (32, 2, None, (16, 1)),
        (16, 2, None, (8, 1)),  # tadm-tiny under torchrun --nproc_per_node=2
        (12, 3, None, (4, 1)),
        (8, 8, None, (1, 1)),
        (32, 2, 4, (4, 4)),  # explicit: kept, accumulation fills the rest
        (32, 1, 8, (8, 4)),
        (16, 2, 8, (8, 1)),
        (512, 8, 16, (16, 4)),  # tadm-owt-small on 8 GPUs
    ],
)
def test_split_of_the_global_batch(global_batch: int, world: int, micro: int | None, expected: tuple[int, int]) -> None:
    per_rank, accum = split_global_batch(global_batch, world, micro)
    assert (per_rank, accum) == expected
    assert per_rank * world * accum == global_batch


@pytest.mark.parametrize(
    "global_batch, world, micro, message",
    [
        (15, 2, None, "train.global_batch_size (15) must be a multiple of the world size (2)"),
        (1, 2, None, "train.global_batch_size (1) must be a multiple of the world size (2)"),
        (16, 3, None, "choose a multiple of 3"),
        # an explicit micro-batch size stays strict: the message of a preset that sets it
        (16, 2, 16, "train.global_batch_size (16) must be a multiple of train.micro_batch_size (16) x world size (2)"),
        (32, 2, 3, "train.micro_batch_size (3) x world size (2); leave train.micro_batch_size unset"),
    ],
)
def test_a_global_batch_that_does_not_split_is_one_clean_error(
    global_batch: int, world: int, micro: int | None, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        split_global_batch(global_batch, world, micro)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_config_accepts_an_unset_micro_batch_and_keeps_explicit_ones_strict() -> None:
    assert load_config().train.micro_batch_size is None
    assert load_config(None, ["train.micro_batch_size=null"]).train.micro_batch_size is None
    assert load_config(None, ["train.micro_batch_size=8"]).train.micro_batch_size == 8
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size must be an integer >= 1, got 0"):
        load_config(None, ["train.micro_batch_size=0"])
    with pytest.raises(ConfigError, match=r"must be a multiple of train\.micro_batch_size \(5\)"):
        load_config(None, ["train.micro_batch_size=5"])
    # the CPU presets derive theirs, so they run under torchrun unchanged
    for name in ("tadm-tiny", "mdlm-tiny", "adlm-tiny", "ar-tiny", "tadm-brown-cpu"):
        assert load_config(PRESET_DIR / f"{name}.yaml").train.micro_batch_size is None, name
    assert load_config(PRESET_DIR / "tadm-owt-small.yaml").train.micro_batch_size == 16


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_gloo_ranks_derive_the_micro_batch(tmp_path: Path, tokenizer_dir: Path) -> None:
    """``tadm train tadm-tiny`` on two processes: its global batch of 16 becomes 8 per rank, no accumulation."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", "-m", "tadm", "train", "tadm-tiny",
        f"data.source={FIXTURE}", f"data.tokenizer={tokenizer_dir}", "data.seq_len=32", "data.val_fraction=0.1",
        f"data.cache_dir={tmp_path / 'cache'}", "objective.step_budgets=[8,16,32]",
        "train.max_steps=2", "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1",
        "train.save_every=1000", "train.device=cpu", f"train.out_dir={out}",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    announce = [line for line in done.stdout.splitlines() if "global batch" in line]
    assert len(announce) == 1, done.stdout  # rank 0 prints, rank 1 does not
    assert "global batch 16 = 8 x 2 rank(s) x 1 accumulation (micro-batch derived: global / world size)" in announce[0]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl", "train")] == [1, 2]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl", "val")] == [0, 2]
    state = load_training_state(out / "training_state.pt")
    assert state["world_size"] == 2 and state["step"] == 2
    assert state["config"]["train"]["micro_batch_size"] is None
