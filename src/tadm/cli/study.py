"""``tadm study CONFIG [key=value ...]``: train and evaluate a staleness study, resumably (see tadm.study)."""

from __future__ import annotations

import argparse
import shlex
import sys

from tadm.cli.common import config_parser, print_files
from tadm.study import load_study_config, run_study
from tadm.training.trainer import NonFiniteLossError

STAGES = ("train", "likelihood", "sample", "score", "throughput", "report")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = config_parser(
        sub, "study", preset="study-tiny", overrides="out_dir=runs/s2",
        help="train TADM / fresh-anchor TADM / ADLM / MDLM / AR at equal size and measure stale-anchor quality",
        description=(
            "Run (or continue) the staleness study described by CONFIG (a YAML file or a shipped study preset: "
            "study-tiny, study-brown-cpu, study-gpu, study-owt). Every trained model and every evaluation cell is "
            "a unit saved under out_dir and skipped when it is already there, so an interrupted study continues "
            "where it stopped. Writes results.json / results.csv / staleness.csv / report.md and plots/."
        ),
    )
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), metavar="STAGE",
                   help=f"run only these stages ({', '.join(STAGES)}); finished units are skipped either way")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_study_config(args.config, args.overrides)
    command = "tadm study " + " ".join(shlex.quote(a) for a in [args.config, *args.overrides])
    try:
        out = run_study(cfg, progress=not args.no_progress, stages=tuple(args.stages), command=command)
    except NonFiniteLossError as err:
        print(f"tadm study: {err}", file=sys.stderr)
        return 3
    return print_files(f"study {cfg.name}: {len(out.ran)} units run, {len(out.skipped)} already done, "
                       f"{out.seconds / 60:.1f} min; results in {out.out_dir}", out.files)
