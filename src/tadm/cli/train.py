"""``tadm train CONFIG [key=value ...] [--resume]``: pretrain a model described by a YAML preset."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from tadm.cli.common import config_parser
from tadm.cli.reporting import reports
from tadm.config import check_objective_keys, load_config
from tadm.training.checkpoint import STATE_FILENAME
from tadm.training.trainer import NonFiniteLossError, TrainingInterrupted, train


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = config_parser(
        sub, "train", preset="tadm-tiny", overrides="train.max_steps=200",
        help="pretrain TADM / MDLM / ADLM / AR from a YAML config (torchrun for several GPUs)",
        description=(
            "Train the model described by CONFIG (a YAML file or a shipped preset: tadm-tiny, tadm-brown-cpu, tadm-owt-small, ...), with dotted overrides such as "
            "train.max_steps=200 model.overrides.hidden_size=128. Writes metrics.jsonl, training_state.pt "
            "and final/ (EMA model + tokenizer + config) into train.out_dir. Under torchrun "
            "(torchrun --nproc_per_node=N -m tadm train CONFIG) the run is data-parallel. "
            "Only one run at a time may use an out_dir (a lock file names the holder). On a single process Ctrl-C "
            "stops after the current step, saves the training state and prints the command that resumes; under "
            "torchrun it stops at once and rank 0 prints the torchrun command that resumes from the last saved state. "
            "Exit status: 0 done, 2 bad config or data (or out_dir in use), 3 the loss became NaN/inf, "
            "130 interrupted."
        ),
    )
    p.add_argument("--resume", action="store_true", help="continue from train.out_dir/training_state.pt")
    p.set_defaults(func=run)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:  # init_distributed has refused it already
        return default


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues the run of ``args``: ``tadm train ... --resume``, or under ``torchrun``
    (``WORLD_SIZE`` > 1) ``torchrun --nproc_per_node=N -m tadm train ... --resume`` (with ``--nnodes`` and a
    reminder of the rendezvous options on several nodes)."""
    command = [args.config, *args.overrides, "--resume"]
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return shlex.join(["tadm", "train", *command])
    per_node = _env_int("LOCAL_WORLD_SIZE", world)
    nodes = [f"--nnodes={world // per_node}"] if per_node < world else []
    line = shlex.join(["torchrun", *nodes, f"--nproc_per_node={per_node}", "-m", "tadm", "train", *command])
    return line + (" (on every node, with the run's rendezvous options)" if nodes else "")


def _interrupted(args: argparse.Namespace, out_dir: str) -> str:
    """The line printed when Ctrl-C ended the run before it saved its state at a step boundary."""
    state = Path(out_dir) / STATE_FILENAME
    if state.is_file():
        return f"interrupted; the last training state is {state}; resume with: {resume_command(args)}"
    return "interrupted before a training state was saved; nothing to resume"


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if not args.resume:  # a resumed run keeps the config it was started with
        check_objective_keys(cfg)
    try:
        train(cfg, resume=args.resume)
    except NonFiniteLossError as err:
        if reports():  # under torchrun every rank stops at the same step; one line is enough
            print(f"tadm train: {err}", file=sys.stderr)
        return 3
    except TrainingInterrupted as err:
        print(f"tadm train: {err}; resume with: {resume_command(args)}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        if reports():  # under torchrun every rank gets the Ctrl-C; one line is enough
            print(f"tadm train: {_interrupted(args, cfg.train.out_dir)}", file=sys.stderr)
        return 130
    return 0
