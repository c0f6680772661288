"""``tadm train CONFIG [key=value ...] [--resume]``: pretrain a model described by a YAML preset."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from tadm.cli.common import config_parser
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
            "Only one run at a time may use an out_dir (a lock file names the holder). Ctrl-C stops after the "
            "current step, saves the training state and prints the command that resumes. "
            "Exit status: 0 done, 2 bad config or data (or out_dir in use), 3 the loss became NaN/inf, "
            "130 interrupted."
        ),
    )
    p.add_argument("--resume", action="store_true", help="continue from train.out_dir/training_state.pt")
    p.set_defaults(func=run)


def resume_command(args: argparse.Namespace) -> str:
    """The ``tadm train`` command line that continues the run of ``args``."""
    return shlex.join(["tadm", "train", args.config, *args.overrides, "--resume"])


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
        print(f"tadm train: {err}", file=sys.stderr)
        return 3
    except TrainingInterrupted as err:
        print(f"tadm train: {err}; resume with: {resume_command(args)}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"tadm train: {_interrupted(args, cfg.train.out_dir)}", file=sys.stderr)
        return 130
    return 0
