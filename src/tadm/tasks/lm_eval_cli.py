"""lm-eval's command line with the ``tadm`` model registered, and its model arguments checked first.

lm-eval (0.4.13) finds models only in its own registry, filled by importing the modules that
define them; it has no entry-point discovery. This wrapper imports :mod:`tadm.tasks.lm_eval_model`
(which registers ``tadm``), parses the command line with lm-eval's own parser and, for
``--model tadm``, checks every ``--model_args`` value (:class:`~tadm.tasks.model_args.TadmModelArgs`)
and that the named model, base and adapter exist *before* lm-eval starts: a bad value is one line
on stderr and exit status 2, not a traceback. Then lm-eval runs as usual, with three differences for
``--model tadm``: its results file records the device the model runs on (lm-eval's default
``cuda:0`` becomes ``cpu`` where there is no GPU); a task the model does not answer (a log-likelihood
or multiple-choice task on a post-training base) is refused once the tasks are loaded, before anything
is generated; and the table is followed by one of what generation cost (refresh policy, tokens/s,
Transformer-layer calls). A foreseeable failure of the run (a model that cannot be loaded, a chat
template the tokenizer lacks) is one line, or its traceback with ``TADM_DEBUG=1``::

    tadm-lm-eval --model tadm --model_args base=DIR,adapter=DIR,K=2 --tasks gsm8k --apply_chat_template
    python -m tadm.tasks.lm_eval_cli --model tadm --model_args model=tadm-tiny --tasks my_task --include_path DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tadm.devices import resolve_device
from tadm.tasks import register_lm_eval_model
from tadm.tasks.model_args import TadmModelArgs, repeated_keys
from tadm.tasks.stats import summary_table

__all__ = ["DEBUG_ENV", "check_tadm_model_args", "main", "refuse_unanswered_tasks"]

DEBUG_ENV = "TADM_DEBUG"  # set (not '', '0', 'false' or 'no'): a failed run shows its traceback, as for ``tadm``
# Foreseeable failures of a run of the tadm model, printed in one line: a bad value or a setting the model
# or its tokenizer cannot honour (ValueError), a missing file (OSError), a request type the model does not
# answer (NotImplementedError: log-likelihood tasks on a post-training base), a missing optional dependency
# (ImportError).
_RUN_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, NotImplementedError, ImportError)


def _debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _raw_model_args(argv: Sequence[str]) -> list[str]:
    """The ``--model_args`` (``-a``) values as typed, before lm-eval merges them into one dict."""
    values, taking = [], False
    for token in argv:
        if token.startswith("--model_args="):
            values.append(token.split("=", 1)[1])
        elif token.startswith("-") and not token[1:2].isdigit():
            taking = token in ("--model_args", "-a")
        elif taking and not token.lstrip().startswith("{"):  # a JSON object cannot repeat a key unnoticed
            values.append(token)
    return values


def check_tadm_model_args(args: argparse.Namespace, argv: Sequence[str] = ()) -> TadmModelArgs | None:
    """Raise ValueError / FileNotFoundError (one line) for bad ``--model_args`` of ``--model tadm``; ``argv``
    (the command line) is searched for a key given twice, which lm-eval would silently overwrite. Returns the
    settings (None for another model)."""

    if getattr(args, "model", None) != "tadm":
        return None
    given = getattr(args, "model_args", None) or {}
    if not isinstance(given, dict):
        raise ValueError(f"--model_args must be key=value pairs, got {given!r}")
    repeated = repeated_keys(_raw_model_args(argv))
    if repeated:
        raise ValueError(f"--model_args gives {', '.join(repeated)} more than once; give each key once")
    extra = {key: getattr(args, key, None) for key in ("batch_size", "max_batch_size", "device")}
    settings = TadmModelArgs.from_kwargs(**register_lm_eval_model()._merged(given, extra))
    settings.check_sources()
    return settings


def refuse_unanswered_tasks(tasks: dict[str, Any], lm: Any = None) -> None:
    """Raise NotImplementedError naming every task (``{name: lm-eval Task}``) whose requests the tadm model ``lm``
    does not answer: a post-training base answers generation tasks only (tadm's own models answer log-likelihood
    tasks too). Checked before the first request runs, so that a run mixing a generation task with a
    multiple-choice one on a base stops before it generates, not after."""
    if getattr(getattr(lm, "generator", None), "kind", None) == "tadm":
        return
    unanswered = {name: str(getattr(task, "OUTPUT_TYPE", None) or task.get_config("output_type"))
                  for name, task in tasks.items()}
    unanswered = {name: kind for name, kind in unanswered.items() if kind != "generate_until"}
    if unanswered:
        named = ", ".join(f"{name!r} (output_type {kind})" for name, kind in unanswered.items())
        many = len(unanswered) > 1
        raise NotImplementedError(
            f"tadm model: task{'s' if many else ''} {named} need{'' if many else 's'} log-likelihoods, which a "
            f"post-training base (base=...) does not compute (tadm's own models, model=..., do); only generation "
            f"tasks (output_type generate_until) run on a base: nothing was generated, drop "
            f"{'them' if many else 'it'} from --tasks")


def _leaf_tasks(task_dict: Any) -> dict[str, Any]:
    """``{name: Task}`` of what ``lm_eval.evaluator.evaluate`` is given (``TaskManager.load``'s dict, or the older
    nested form of groups)."""
    if isinstance(task_dict, dict) and isinstance(task_dict.get("tasks"), dict):
        return task_dict["tasks"]
    leaves: dict[str, Any] = {}
    for name, value in (task_dict or {}).items():
        leaves.update(_leaf_tasks(value) if isinstance(value, dict) else {str(name): value})
    return leaves


@contextmanager
def _watching_the_run() -> Iterator[dict[str, Any]]:
    """While lm-eval runs: its ``evaluate`` (called once the model and the tasks are loaded, before any request)
    first refuses the tasks the tadm model does not answer, and keeps the model (``["lm"]``) for its summary."""
    # deferred: lm-eval is an optional dependency (the tasks extra)
    import lm_eval.evaluator as evaluator

    seen: dict[str, Any] = {}
    original = evaluator.evaluate

    def evaluate(lm: Any, task_dict: Any, *args: Any, **kwargs: Any) -> Any:
        seen["lm"] = getattr(lm, "lm", lm)  # lm-eval's CachingLM (--use_cache) wraps the model
        refuse_unanswered_tasks(_leaf_tasks(task_dict), seen["lm"])
        return original(lm, task_dict, *args, **kwargs)

    evaluator.evaluate = evaluate
    try:
        yield seen
    finally:
        evaluator.evaluate = original


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lm-eval`` with ``argv`` (default: the process's arguments) after registering ``tadm``."""
    try:  # registers ``tadm`` with lm-eval; lm-eval is an optional dependency (the tasks extra)
        register_lm_eval_model()
    except ImportError as err:
        print(f"tadm-lm-eval: error: {err}", file=sys.stderr)
        return 2
    # deferred: lm-eval is an optional dependency (the tasks extra)
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    saved = list(sys.argv)
    if argv is not None:  # lm-eval's parser reads sys.argv
        sys.argv = [saved[0] if saved else "tadm-lm-eval", *argv]
    try:
        setup_logging()
        cli = HarnessCLI()
        args = cli.parse_args()
        try:
            settings = check_tadm_model_args(args, sys.argv[1:])
        except (ValueError, FileNotFoundError) as err:
            print(f"tadm-lm-eval: error: {err}", file=sys.stderr)
            return 2
        if settings is None:
            cli.execute(args)
            return 0
        args.device = str(resolve_device(settings.device or "auto"))  # what the results file records
        try:
            with _watching_the_run() as run:
                cli.execute(args)
        except _RUN_ERRORS as err:
            if _debug_requested():
                raise
            text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
            print(f"tadm-lm-eval: error: {text or type(err).__name__} (traceback: {DEBUG_ENV}=1)", file=sys.stderr)
            return 2
        lm = run.get("lm")
        if getattr(lm, "request_stats", None):
            print(f"tadm model on {args.device}: what generation cost\n{summary_table(lm.summary())}")
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
