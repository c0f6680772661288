"""The post-training table on a laptop: a small arithmetic task learned by a tiny DiffusionGemma on CPU.

Two tasks (``--task``), both ``tadm eval tasks`` benchmarks (:data:`tadm.tasks.benchmarks.EXTRA_BENCHMARKS`):

* ``split`` (default): "Write 13 as a sum of two numbers." -> any "a+b" with a + b = 13 (two-digit
  operands by default). Many answers are right, so each generated token depends on the others, which
  is where a stale anchor hurts;
* ``addition``: "What is 47+385?" -> "432", one answer fixed by the prompt.

One command runs five resumable stages into ``--out`` (default ``runs/laptop-task`` for addition,
``runs/laptop-task-split`` for split); a rerun skips the stages whose outputs exist (and the
evaluation units already written), so a cut-off run continues:

1. data: chat pairs with operands uniform in [0, 10^digits), written as ``data/<task>.jsonl`` (the
   evaluation problems) and ``data/train.jsonl``. Addition: a fixed seed draws the evaluation problems
   first; the training problems never contain one of their pairs (in either order), so they are held out.
   Split: the evaluation totals are drawn like the training ones (a + b of uniform operands); every total
   also occurs in training (there are only 2 * 10^digits - 1 of them), so they are not held out and the
   task measures whether a model writes one consistent answer among many, not whether it generalizes to
   new totals. With ``--hold-out`` the
   training problems never have a held-out total (:func:`split_held_out_totals`: every total whose tens
   and units digits add up to an odd number, 100 of the 199 two-digit totals), those prompts are written
   as ``data/held-out/split.jsonl``, and ``--eval-set held-out`` evaluates on them: prompts that neither
   pretraining nor post-training ever read.
   The prompt is the benchmark's own (:func:`tadm.tasks.benchmarks.build_prompt`), so training and
   evaluation see the same text through the same chat template.
2. tokenizer: a byte-level BPE with digits kept as single tokens, wrapped with the Gemma-style chat template.
3. pretrain: a random ``DiffusionGemmaForBlockDiffusion`` (6 layers) trained on (context, canvas) pairs
   with the flat x0 cross-entropy under uniform noise (:func:`tadm.posttrain.base_training.pretrain_block_diffusion`);
   saved to ``base/`` with its held-out accuracy at K = 1 on a few problems.
4. posttrain: the base frozen and split 1 / 3 / 2; only the paired-attention fusion is trained
   (``PosttrainTrainer``, on-policy rollouts); saved to ``adapter/``.
5. eval: ``tadm eval tasks`` (:func:`tadm.tasks.runner.run_tasks`) on the held-out problems: the base
   at K = 1, TADM and naive reuse at K = 1, 2, 3, three seeds; tables in ``eval/`` (``eval-held-out/`` with
   ``--eval-set held-out``).

    OMP_NUM_THREADS=1 python scripts/laptop_task.py                   # split; about 1.5 hours on one CPU core
    OMP_NUM_THREADS=1 python scripts/laptop_task.py --task addition   # about 25 minutes
    python scripts/laptop_task.py --until pretrain         # stop after a stage (e.g. a probe)
    OMP_NUM_THREADS=1 python scripts/laptop_task.py --hold-out --out runs/held-out    # trained without the
    OMP_NUM_THREADS=1 python scripts/laptop_task.py --hold-out --out runs/held-out \
        --eval-set held-out                                                          # held-out totals, tested on them
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Collection
from pathlib import Path

from tadm.cli import OneLineErrorParser
from tadm.cli.common import nonnegative_int, positive_float, positive_int
from tadm.eval.evaluator import default_evaluator_path
from tadm.posttrain import load_posttrain_config
from tadm.records import git_commit

STAGES = ("data", "tokenizer", "pretrain", "posttrain", "diagnose", "eval")
TASKS = ("split", "addition")
EVAL_SETS = ("task", "held-out")  # data/<task>.jsonl, or data/held-out/<task>.jsonl (split with --hold-out)
TASK_DEFAULTS = {  # the published runs' settings (docs/results/); split post-trains twice as long since the ablation
    "split": {"digits": 2, "pretrain_steps": 9000, "posttrain_steps": 9600, "eval_examples": 199},
    "addition": {"digits": 2, "pretrain_steps": 3000, "posttrain_steps": 600, "eval_examples": 200},
}
POSTTRAIN_DEFAULTS = ("fusion.rank=32", "fusion.num_heads=4")  # the script's fusion size, before --posttrain-set
MAX_DIGITS = 6
# The arguments each stage's saved output depends on; a rerun may not change them once it exists. --eval-examples
# may shrink (the evaluation then takes the first held-out problems); --refresh and --batch-size are evaluation
# settings (a rerun may widen K into another --eval-out; kl.json keeps the K it measured).
STAGE_SETTINGS = {
    "data": ("task", "seed", "digits", "train_examples", "hold_out"),
    "pretrain": ("model_seed", "canvas_length", "hidden", "heads", "pretrain_steps", "pretrain_batch"),
    "posttrain": ("model_seed", "canvas_length", "steps", "posttrain_steps", "posttrain_batch", "posttrain_lr",
                  "posttrain_set"),
    "diagnose": ("steps",),
}


def _int_list(minimum: int):
    """An argparse type: comma-separated integers >= ``minimum``."""
    def parse(value: str) -> list[int]:
        try:
            numbers = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
        if not numbers or min(numbers) < minimum:
            raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {value!r}")
        return numbers
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="laptop_task.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=TASKS, default="split")
    p.add_argument("--out", default=None,
                   help="run folder (default: runs/laptop-task-split; runs/laptop-task for addition)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seed of the data (and of the model, unless --model-seed)")
    p.add_argument("--model-seed", type=nonnegative_int, default=None,
                   help="seed of the model's initialisation and batch order (default: --seed); "
                        "another model on the same data")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (1 is as fast as 2 at this size)")
    p.add_argument("--digits", type=positive_int, default=None,
                   help=f"operands have at most this many digits (1-{MAX_DIGITS}; default: 2)")
    p.add_argument("--train-examples", type=positive_int, default=200_000)
    p.add_argument("--hold-out", action="store_true",
                   help="split: no training problem has a held-out total (tens and units digits with an odd sum; "
                        "100 of the 199 two-digit totals); their prompts go to data/held-out/split.jsonl")
    p.add_argument("--eval-set", choices=EVAL_SETS, default="task",
                   help="the prompts that diagnose and eval use: task (data/<task>.jsonl, the default) or held-out "
                        "(every held-out total; needs --hold-out)")
    p.add_argument("--eval-examples", type=positive_int, default=None,
                   help="held-out problems (default: split, 199, or every distinct total when fewer: 19 for one "
                        "digit; addition, 200, or every held-out pair when fewer: 25 for one digit)")
    p.add_argument("--canvas-length", type=positive_int, default=8, help="L; also the generation budget (one canvas)")
    p.add_argument("--steps", type=positive_int, default=12, help="denoising steps T per canvas")
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--heads", type=positive_int, default=2)
    p.add_argument("--pretrain-steps", type=positive_int, default=None,
                   help="default: 9000 for split, 3000 for addition")
    p.add_argument("--pretrain-batch", type=positive_int, default=64)
    p.add_argument("--posttrain-steps", type=positive_int, default=None,
                   help="default: 9600 for split (the length whose recovery met 70 %% at K = 2 and 3 on average "
                        "over three pretraining seeds, not for each; docs/results/posttrain-recovery-ablation-cpu.md), "
                        "600 for addition")
    p.add_argument("--posttrain-batch", type=positive_int, default=32)
    p.add_argument("--posttrain-lr", type=positive_float, default=2e-3)
    p.add_argument("--posttrain-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a post-training config setting (repeatable): fusion.rank=64, loss.kd_weight=0.5, "
                        "rollout.cache_ages=[0,1,2,3], rollout.mode=forward, fusion.gate_bias=0, ...")
    p.add_argument("--variant", default=None, metavar="NAME",
                   help="post-train, diagnose and evaluate into variants/NAME/ (on the same base)")
    p.add_argument("--refresh", type=_int_list(1), default=[1, 2, 3], metavar="K,K", help="K values (default: 1,2,3)")
    p.add_argument("--seeds", type=_int_list(0), default=[0, 1, 2], metavar="S,S",
                   help="sampling seeds (default: 0,1,2)")
    p.add_argument("--batch-size", type=positive_int, default=50, help="evaluation batch size")
    p.add_argument("--judge", default="none", help="none, local, local:PATH or local-free:PATH (the degeneration judge)")
    p.add_argument("--eval-out", default=None,
                   help="folder (under --out) of the evaluation's units and tables (default: eval, or the variant's; "
                        "eval-held-out with --eval-set held-out)")
    p.add_argument("--until", choices=STAGES, default="eval", help="stop after this stage")
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments taken together (one line), or None."""
    if args.digits > MAX_DIGITS:
        return f"argument --digits: at most {MAX_DIGITS}, got {args.digits}"
    if args.hold_out and args.task != "split":
        return (f"argument --hold-out: only the split task holds totals out (its addition problems already are), "
                f"got --task {args.task}")
    if args.eval_set == "held-out" and not args.hold_out:
        return "argument --eval-set: held-out needs --hold-out (the run must have trained without the held-out totals)"
    most = most_held_out(args)
    if args.eval_examples > most:
        what = "distinct totals" if args.task == "split" else "held-out pairs"
        return (f"argument --eval-examples: {args.digits}-digit operands give only {most} {what}; use at most "
                f"{most}, or more --digits (got {args.eval_examples})")
    answer = 2 * args.digits + 1 if args.task == "split" else args.digits + 1
    if args.canvas_length < answer + 1:
        return (f"argument --canvas-length: an answer of {args.digits}-digit operands needs {answer} tokens and the "
                f"end of turn; use at least {answer + 1} (got {args.canvas_length})")
    if args.hidden % args.heads:
        return f"argument --hidden: {args.hidden} must be divisible by --heads {args.heads}"
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"argument --out: {args.out} is an existing file, not a folder"
    if args.variant is not None and (not args.variant or "/" in args.variant or args.variant.startswith(".")):
        return f"argument --variant: a plain folder name, got {args.variant!r}"
    changed = changed_settings(args)
    if changed is not None:
        return changed
    if args.judge not in ("none", "local", "local-free") and not args.judge.startswith(("local:", "local-free:")):
        return f"argument --judge: none, local, local:PATH or local-free:PATH, got {args.judge!r}"
    if args.judge != "none":  # checked now, not after hours of training
        path = args.judge.partition(":")[2]
        judge_dir = Path(path).expanduser() if path else default_evaluator_path()
        if not (judge_dir / "config.json").is_file():
            return (f"argument --judge: {judge_dir} holds no model (no config.json); "
                    + ("run `tadm eval prepare-evaluator` first" if not path else "give a Hugging Face model folder"))
    try:
        posttrain_config(args)
    except ValueError as err:
        return f"argument --posttrain-set: {err}"
    return None


def most_held_out(args: argparse.Namespace) -> int:
    """How many distinct held-out problems operands of ``--digits`` digits allow (``make_task_data``'s limit)."""
    return split_totals(args.digits) if args.task == "split" else 10 ** args.digits * 10 ** args.digits // 4


def _shown(value) -> str:
    """An argument's value as it is typed on the command line."""
    if isinstance(value, list) and not value:
        return "none"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) if all(isinstance(v, int) for v in value) else json.dumps(value)
    return str(value)


def changed_settings(args: argparse.Namespace) -> str | None:
    """What a rerun into an existing ``--out`` changes of the settings behind the stages already done (one line),
    or None. The base's stages are checked against ``--out``'s ``args.json``, a variant's against its own."""
    out, own = Path(args.out), variant_dir(args)
    outputs = {"data": out / "data" / "train.jsonl", "pretrain": out / "base" / "pretrain.json",
               "posttrain": own / "adapter" / "posttrain.json", "diagnose": own / kl_name(args)}
    changes: dict[str, str] = {}
    for stage, output in outputs.items():
        recorded_path = (own if stage in ("posttrain", "diagnose") else out) / "args.json"
        if not output.is_file() or not recorded_path.is_file():
            continue
        try:
            recorded = json.loads(recorded_path.read_text())
        except ValueError:
            return f"argument --out: {recorded_path} is not valid JSON; cannot tell which settings made this run"
        for name in STAGE_SETTINGS[stage]:
            if name in recorded and recorded[name] != getattr(args, name) and name not in changes:
                changes[name] = (f"--{name.replace('_', '-')} {_shown(recorded[name])} "
                                 f"(now {_shown(getattr(args, name))})")
    held_out = out / "data" / f"{args.task}.jsonl"
    if held_out.is_file() and args.eval_examples > (held := len(read_jsonl(held_out))):
        changes["eval_examples"] = (f"--eval-examples at most {held}, the held-out problems on disk "
                                    f"(now {args.eval_examples})")
    if not changes:
        return None
    return (f"argument --out: {args.out} holds stages made with other settings: {', '.join(changes.values())}; "
            "rerun with those values or use another --out")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, value if name != "eval_examples" else min(value, most_held_out(args)))
    if args.model_seed is None:
        args.model_seed = args.seed
    if args.out is None:
        args.out = "runs/laptop-task" if args.task == "addition" else f"runs/laptop-task-{args.task}"
    if args.eval_out is None:
        name = "eval" if args.eval_set == "task" else "eval-held-out"
        args.eval_out = name if args.variant is None else f"variants/{args.variant}/{name}"
    problem = check_args(args)
    if problem is not None:
        parser.error(problem)
    return args


def posttrain_config(args: argparse.Namespace):
    """The post-training config: the script's settings, then ``--posttrain-set`` (validated by the library)."""
    return load_posttrain_config(None, [
        f"rollout.sampler.num_steps={args.steps}", f"train.max_steps={args.posttrain_steps}",
        f"optim.lr={args.posttrain_lr}", "optim.warmup_steps=20", f"train.seed={args.model_seed}",
        "train.precision=fp32", "train.grad_accum_steps=1", *POSTTRAIN_DEFAULTS, *args.posttrain_set])


def eval_data_dir(args: argparse.Namespace) -> Path:
    """The folder of the ``<task>.jsonl`` that diagnose and eval read: ``data/`` or ``data/held-out/``."""
    data = Path(args.out) / "data"
    return data if args.eval_set == "task" else data / "held-out"


def kl_name(args: argparse.Namespace) -> str:
    """The diagnosis file of ``--eval-set``: ``kl.json`` or ``kl-held-out.json``."""
    return "kl.json" if args.eval_set == "task" else "kl-held-out.json"


def variant_dir(args: argparse.Namespace) -> Path:
    """Where the post-trained fusion and its diagnosis go: the run folder, or ``variants/NAME``."""
    return Path(args.out) if args.variant is None else Path(args.out) / "variants" / args.variant


# ------------------------------------------------------------------------------------------- data
def addition_problem(a: int, b: int) -> dict[str, str]:
    """One record of the ``addition`` task."""
    return {"problem": f"What is {a}+{b}?", "answer": str(a + b)}


def make_addition_data(digits: int, n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records; held-out pairs are distinct and no training pair is one of them, in either order."""
    top = 10 ** digits
    if n_eval > top * top // 4:
        raise ValueError(f"{n_eval} held-out problems is too many for {digits}-digit operands")
    rng = random.Random(seed)
    held: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(held) < n_eval:
        pair = (rng.randrange(top), rng.randrange(top))
        if pair in seen or pair[::-1] in seen:
            continue
        seen.update((pair, pair[::-1]))
        held.append(pair)
    train: list[tuple[int, int]] = []
    while len(train) < n_train:
        pair = (rng.randrange(top), rng.randrange(top))
        if pair not in seen:
            train.append(pair)
    eval_rows = [{"id": str(n), **addition_problem(a, b)} for n, (a, b) in enumerate(held)]
    return [addition_problem(a, b) for a, b in train], eval_rows


def split_problem(total: int) -> str:
    """The question of a ``split`` record."""
    return f"Write {total} as a sum of two numbers."


def split_totals(digits: int) -> int:
    """How many distinct totals (hence distinct ``split`` prompts) operands of ``digits`` digits give."""
    return 2 * 10 ** digits - 1


def split_held_out_totals(digits: int) -> list[int]:
    """The totals that ``--hold-out`` keeps out of every training problem: those whose tens and units digits add
    up to an odd number (1, 3, ..., 10, 12, ...).

    About half of the totals, spread over the whole range, so that every digit still occurs in every place of a
    training total: 100 of the 199 two-digit totals (10 of the 19 one-digit ones).
    """
    return [t for t in range(split_totals(digits)) if (t // 10 % 10 + t % 10) % 2 == 1]


def split_records(totals: list[int]) -> list[dict]:
    """Evaluation records of ``split``: one per total, its prompt and the total as the gold answer."""
    return [{"id": str(n), "problem": split_problem(t), "answer": str(t)} for n, t in enumerate(totals)]


def make_split_data(digits: int, n_train: int, n_eval: int, seed: int,
                    exclude: Collection[int] = ()) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records of ``split``: operands a, b uniform in [0, 10^digits).

    Training records answer "a+b". Held-out records are ``n_eval`` *distinct* totals (so distinct
    prompts), drawn without replacement and uniformly among the 2 * 10^digits - 1 possible ones, each
    holding the total as the gold answer (any a+b with that sum is right). A training pair whose total is in
    ``exclude`` is drawn again (operands uniform among the pairs whose total is not excluded); without
    ``exclude`` the records are those of earlier versions, draw for draw.
    """
    top, totals = 10 ** digits, split_totals(digits)
    if n_eval > totals:
        raise ValueError(f"{n_eval} held-out problems is too many for {digits}-digit operands: "
                         f"there are only {totals} distinct totals")
    excluded = set(exclude)
    if len(excluded & set(range(totals))) == totals:
        raise ValueError(f"every total of {digits}-digit operands is excluded: nothing left to train on")
    rng = random.Random(seed)
    held = rng.sample(range(totals), n_eval)
    train = []
    while len(train) < n_train:
        a, b = rng.randrange(top), rng.randrange(top)
        if a + b not in excluded:
            train.append({"problem": split_problem(a + b), "answer": f"{a}+{b}"})
    return train, split_records(held)


def make_task_data(task: str, digits: int, n_train: int, n_eval: int, seed: int,
                   hold_out: bool = False) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records of ``task`` (``split`` or ``addition``); ``hold_out`` (split only): no training
    problem has one of :func:`split_held_out_totals`."""
    if task == "split":
        return make_split_data(digits, n_train, n_eval, seed, exclude=split_held_out_totals(digits) if hold_out else ())
    if hold_out:
        raise ValueError(f"hold_out: only the split task holds totals out, got {task!r}")
    return make_addition_data(digits, n_train, n_eval, seed)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chat_prompt(problem: str, task: str = "addition") -> str:
    """The user turn of a problem: the benchmark's own prompt."""
    from tadm.tasks.benchmarks import Example, build_prompt, get_benchmark

    return build_prompt(get_benchmark(task), Example("", problem))


# -------------------------------------------------------------------------------------- tokenizer
def digit_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE whose merges never join digits (every digit stays its own token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


# ------------------------------------------------------------------------------------------ stages
def canvas_dataset(rows: list[dict], tokenizer, L: int, task: str):
    from tadm.posttrain import ChatCanvasDataset, ChatExample

    return ChatCanvasDataset([ChatExample(chat_prompt(r["problem"], task), r["answer"]) for r in rows], tokenizer,
                             canvas_length=L, pad_id=tokenizer.pad_token_id, canvases_per_example=1)


def eval_config(args: argparse.Namespace, out: Path, **overrides):
    from tadm.tasks.runner import TaskRunConfig

    cfg = dict(tasks=args.task, refresh=list(args.refresh), seeds=list(args.seeds), naive=True,
               base=str(out / "base"), adapter=str(variant_dir(args) / "adapter"), data_dir=str(eval_data_dir(args)),
               limit=args.eval_examples if args.eval_set == "task" else None,
               steps=args.steps, canvas_length=args.canvas_length, max_gen_toks=args.canvas_length,
               batch_size=args.batch_size, device="cpu", dtype="float32", judge=args.judge,
               out_dir=str(out / args.eval_out))
    cfg.update(overrides)
    return TaskRunConfig(**cfg)


class Stages:
    """The run folder, its logging and the wall time of each stage (``timings.json``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.wall = time.perf_counter()
        self.timings_path = variant_dir(args) / "timings.json"  # a variant keeps its own
        self.timings_path.parent.mkdir(parents=True, exist_ok=True)
        self.timings = json.loads(self.timings_path.read_text()) if self.timings_path.is_file() else {}

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.wall:7.1f}s] {message}", flush=True)

    def done(self, stage: str, started: float) -> None:
        """Record the stage's wall time."""
        self.timings[stage] = round(time.perf_counter() - started, 1)
        self.timings_path.write_text(json.dumps(self.timings, indent=1) + "\n")
        self.log(f"stage {stage} done in {self.timings[stage]:.0f}s")


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def stage_data(run: Stages) -> None:
    args, data = run.args, run.out / "data"
    if (data / f"{args.task}.jsonl").is_file():
        return
    started = time.perf_counter()
    train_rows, eval_rows = make_task_data(args.task, args.digits, args.train_examples, args.eval_examples, args.seed,
                                           hold_out=args.hold_out)
    write_jsonl(data / "train.jsonl", train_rows)
    if args.hold_out:  # before the task file, whose presence marks the stage done
        write_jsonl(data / "held-out" / f"{args.task}.jsonl", split_records(split_held_out_totals(args.digits)))
    write_jsonl(data / f"{args.task}.jsonl", eval_rows)
    run.done("data", started)


def stage_tokenizer(run: Stages, train_rows: list[dict]) -> None:
    from tadm.posttrain.data import make_chat_tokenizer

    tok_dir = run.out / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        return
    started = time.perf_counter()
    texts = [chat_prompt(r["problem"], run.args.task) + " " + r["answer"] for r in train_rows[:20_000]]
    make_chat_tokenizer(digit_bpe(texts, vocab_size=320)).save_pretrained(tok_dir)
    run.done("tokenizer", started)


def stage_pretrain(run: Stages, train_rows: list[dict], tokenizer) -> None:
    """A random DiffusionGemma trained on the task's canvases, saved to ``base/``, then a K = 1 probe."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from tadm.posttrain import canvas_batches
    from tadm.posttrain.backbone import tiny_diffusion_gemma_config
    from tadm.posttrain.base_training import pretrain_block_diffusion
    from tadm.tasks.runner import run_tasks

    args, base, L = run.args, run.out / "base", run.args.canvas_length
    if (base / "pretrain.json").is_file():
        return
    started = time.perf_counter()
    train_set = canvas_dataset(train_rows[: args.pretrain_steps * args.pretrain_batch], tokenizer, L, args.task)
    run.log(f"vocab {len(tokenizer)}; {len(train_set)} training canvases of {L} tokens "
            f"(prompt {len(train_set[0].context_ids)} tokens)")
    config = tiny_diffusion_gemma_config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, num_layers=6, canvas_length=L,
        num_heads=args.heads, head_dim=args.hidden // args.heads, sliding_window=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(args.model_seed)
    model = DiffusionGemmaForBlockDiffusion(config)
    run.log(f"DiffusionGemmaForBlockDiffusion: {sum(p.numel() for p in model.parameters()):,} parameters")
    batches = canvas_batches(train_set, args.pretrain_batch, tokenizer.pad_token_id, seed=args.model_seed)
    history = pretrain_block_diffusion(model, batches, steps=args.pretrain_steps, seed=args.model_seed,
                                       objective="ce", log=run.log)
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    (base / "pretrain.json").write_text(json.dumps({
        "steps": args.pretrain_steps, "batch": args.pretrain_batch,
        "loss_first_last": [_mean(history[:20]), _mean(history[-50:])],
        "seconds": round(time.perf_counter() - started, 1), **git_commit()}, indent=1) + "\n")
    probe = run_tasks(eval_config(args, run.out, adapter=None, split="1:3", naive=False, refresh=[1], seeds=[0],
                                  data_dir=str(run.out / "data"), limit=min(100, args.eval_examples), judge=None,
                                  out_dir=str(run.out / "eval-pretrained")), log=run.log)
    run.log(f"pretrained base, held-out accuracy at K = 1: {probe.units[0]['accuracy']:.3f} "
            f"({probe.units[0]['n']} problems)")
    run.done("pretrain", started)


def stage_posttrain(run: Stages, train_rows: list[dict], tokenizer) -> None:
    """The base frozen and split 1 / 3 / 2; only its paired-attention fusion trained, saved to ``adapter/``
    (``variants/NAME/adapter`` with ``--variant``)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from tadm.posttrain import (AnchoredBackbone, DiffusionGemmaBackbone, FusionSpec, PosttrainTrainer, SplitSpec,
                                canvas_batches, save_adapter)

    args, base = run.args, run.out / "base"
    adapter = variant_dir(args) / "adapter"
    if (adapter / "posttrain.json").is_file():
        return
    started = time.perf_counter()
    cfg = posttrain_config(args)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(base)).eval()
    f = cfg.fusion
    split = AnchoredBackbone(DiffusionGemmaBackbone(model), SplitSpec(1, 3),
                             FusionSpec(rank=f.rank, num_heads=f.num_heads, eps=f.eps, gate_bias=f.gate_bias))
    trainer = PosttrainTrainer(split, cfg)
    train_set = canvas_dataset(train_rows[: args.posttrain_steps * args.posttrain_batch * 2], tokenizer,
                               args.canvas_length, args.task)
    data_iter = canvas_batches(train_set, args.posttrain_batch, tokenizer.pad_token_id, seed=args.model_seed + 7)
    run.log(f"post-training {sum(p.numel() for p in split.fusion.parameters()):,} fusion parameters "
            f"(split 1/3/2, rank {f.rank}, {f.num_heads} heads), {args.posttrain_steps} steps"
            + (f", settings {' '.join(args.posttrain_set)}" if args.posttrain_set else ""))
    losses, kd = [], []
    for step in range(args.posttrain_steps):
        metrics = trainer.train_step([next(data_iter)])
        losses.append(metrics["loss"])
        kd.append(metrics["kd"])
        if (step + 1) % max(1, args.posttrain_steps // 6) == 0:
            run.log(f"  post-train step {step + 1}/{args.posttrain_steps}: loss {_mean(losses[-25:]):.3f} "
                    f"(kd {metrics['kd']:.4f})")
    save_adapter(adapter, split, base_model=str(base), extra={"step": trainer.step, "config": cfg.to_dict()})
    (adapter / "posttrain.json").write_text(json.dumps({
        "steps": args.posttrain_steps, "batch": args.posttrain_batch, "lr": args.posttrain_lr,
        "settings": list(args.posttrain_set), "fusion_parameters": sum(p.numel() for p in split.fusion.parameters()),
        "loss_first_last": [_mean(losses[:10]), _mean(losses[-25:])], "kd_last": _mean(kd[-25:]),
        "seconds": round(time.perf_counter() - started, 1), **git_commit()}, indent=1) + "\n")
    run.done("posttrain", started)


def stage_diagnose(run: Stages, tokenizer) -> None:
    """KL(fresh || stale) of the fused and the naive stale predictions on the held-out prompts, per K > 1
    (:func:`tadm.posttrain.diagnostics.stale_fresh_divergence`), written to ``kl.json`` beside the adapter."""
    import torch

    from tadm.posttrain import collate_canvases, load_backbone
    from tadm.posttrain.adapter_io import attach_adapter
    from tadm.posttrain.diagnostics import stale_fresh_divergence
    from tadm.sampling.entropy_bound import EntropyBoundSampler

    args = run.args
    out = variant_dir(args) / kl_name(args)
    intervals = [K for K in args.refresh if K > 1]
    if out.is_file() or not intervals:
        return
    started = time.perf_counter()
    model = attach_adapter(load_backbone("diffusion-gemma", run.out / "base"), variant_dir(args) / "adapter")
    rows = read_jsonl(eval_data_dir(args) / f"{args.task}.jsonl")
    items = list(canvas_dataset([{"problem": r["problem"], "answer": r["answer"]} for r in rows], tokenizer,
                                args.canvas_length, args.task))
    sampler = EntropyBoundSampler(model.vocab_size, num_steps=args.steps)

    def batches():
        generator = torch.Generator().manual_seed(1234)
        for b in range(0, len(items), args.batch_size):
            yield collate_canvases(items[b:b + args.batch_size], tokenizer.pad_token_id), generator

    result = stale_fresh_divergence(model, batches(), sampler, intervals)
    out.write_text(json.dumps({"prompts": len(items), "steps": args.steps, "by_K": {str(K): v for K, v in result.items()},
                               "seconds": round(time.perf_counter() - started, 1)}, indent=1) + "\n")
    for K, r in result.items():
        run.log(f"  K = {K}: KL(fresh || naive) {r['kl_naive']:.4f}, KL(fresh || fused) {r['kl_fused']:.4f} nats/token")
    run.done("diagnose" if args.eval_set == "task" else "diagnose-held-out", started)


def stage_eval(run: Stages) -> None:
    """``tadm eval tasks`` on the held-out problems: the base, TADM and naive reuse at each K and seed."""
    from tadm.tasks.runner import run_tasks

    started = time.perf_counter()
    result = run_tasks(eval_config(run.args, run.out), log=run.log,
                       command=" ".join(["OMP_NUM_THREADS=1 python scripts/laptop_task.py", *sys.argv[1:]]))
    run.log(f"{result.ran} units ran now; tables: " + ", ".join(str(p) for p in result.files.values()))
    run.done("eval" if run.args.eval_set == "task" else "eval-held-out", started)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    run = Stages(args)
    recorded = json.dumps(vars(args), indent=1) + "\n"
    (variant_dir(args) / "args.json").write_text(recorded)
    if args.variant is not None and not (run.out / "args.json").is_file():  # the base's stages run now
        (run.out / "args.json").write_text(recorded)
    stage_data(run)  # each stage skips itself when its output exists; --until stops after it either way
    if args.until == "data":
        return
    train_rows = read_jsonl(run.out / "data" / "train.jsonl")
    run.log(f"data: {len(train_rows)} training problems, {args.eval_examples} held-out "
            f"({run.out / 'data' / f'{args.task}.jsonl'})")
    stage_tokenizer(run, train_rows)
    if args.until == "tokenizer":
        return
    tokenizer = AutoTokenizer.from_pretrained(str(run.out / "tokenizer"))
    stage_pretrain(run, train_rows, tokenizer)
    if args.until == "pretrain":
        return
    stage_posttrain(run, train_rows, tokenizer)
    if args.until == "posttrain":
        return
    stage_diagnose(run, tokenizer)
    if args.until == "diagnose":
        return
    stage_eval(run)

if __name__ == "__main__":
    main()
