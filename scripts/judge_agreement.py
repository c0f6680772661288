"""How well does a degeneration judge tell clean answers from repetition loops and word salad?

The corruption column of the post-training table is only as good as its judge. This script builds a
small labelled set with known answers and reports what a judge says about each kind:

* ``clean``: a short, correct, coherent answer to a question (hand-written, below);
* ``repetition``: the same answer with its first sentence repeated eight times, then cut off;
* ``incoherent``: the answer's words shuffled (a fixed seed per item), i.e. word salad.

For each kind it prints the share of verdicts flagging ``incoherent``, ``repetition_loop`` and
corruption (either one), the null share and the unparsed count, as a Markdown table (and JSON with
``--out``). A useful judge flags corruption on most ``repetition`` and ``incoherent`` items and on few
``clean`` ones. Verdicts are cached (``--cache``), so a rerun asks nothing again.

    OMP_NUM_THREADS=1 python scripts/judge_agreement.py                   # local SmolLM2-135M, scored labels
    python scripts/judge_agreement.py --judge local-free                  # the same model, free text
    python scripts/judge_agreement.py --judge-url http://localhost:8000/v1 --judge-model NAME
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from tadm.cli import OneLineErrorParser
from tadm.cli.common import positive_int
from tadm.tasks.judge import DegenerationJudge, JudgeError, make_judge_client

JUDGES = "local, local:PATH, local-free or local-free:PATH"
QA = [
    ("What is the capital of France?", "The capital of France is Paris. It is also the largest city in the country."),
    ("Why is the sky blue?", "Sunlight is scattered by the molecules of the air. Blue light is scattered more than "
     "red light because its wavelength is shorter, so the sky looks blue."),
    ("What is 12 times 7?", "Twelve times seven is 84. You can check it as 10 times 7 plus 2 times 7, which is 70 plus "
     "14."),
    ("How do plants make food?", "Plants make food by photosynthesis. They use light, water and carbon dioxide to "
     "make sugar and release oxygen."),
    ("Write a Python function that returns the square of x.", "Here is the function. def square(x): return x * x. "
     "It multiplies the number by itself."),
    ("What causes the seasons on Earth?", "The seasons come from the tilt of the Earth's axis. As the Earth orbits the "
     "Sun, each hemisphere gets more direct sunlight for part of the year."),
    ("Solve 2x + 3 = 11.", "Subtract 3 from both sides to get 2x = 8. Then divide by 2, so x = 4."),
    ("What is a prime number?", "A prime number is a whole number greater than one whose only divisors are one and "
     "itself. For example, 2, 3, 5 and 7 are prime."),
    ("Who wrote Romeo and Juliet?", "Romeo and Juliet was written by William Shakespeare. It is a tragedy about two "
     "young lovers from feuding families."),
    ("How many sides does a hexagon have?", "A hexagon has six sides. Its interior angles add up to 720 degrees."),
    ("What does a thermometer measure?", "A thermometer measures temperature. Many use the expansion of a liquid or "
     "an electronic sensor to show how hot or cold something is."),
    ("Name the largest planet in the solar system.", "Jupiter is the largest planet in the solar system. It is a gas "
     "giant with a famous storm called the Great Red Spot."),
]
KINDS = ("clean", "repetition", "incoherent")


def labelled_pairs(seed: int = 0) -> list[tuple[str, str, str]]:
    """(kind, question, response) for every question and kind, in a fixed order."""
    pairs = []
    for n, (question, answer) in enumerate(QA):
        first = answer.split(". ")[0].rstrip(".") + ". "
        words = answer.split()
        random.Random(seed * 1000 + n).shuffle(words)
        pairs += [("clean", question, answer), ("repetition", question, (first * 8).strip()),
                  ("incoherent", question, " ".join(words))]
    return pairs


def agreement_table(pairs: list[tuple[str, str, str]], verdicts: list) -> list[dict]:
    """Per kind: items, share flagged incoherent / repetition_loop / either, null share, unparsed."""
    rows = []
    for kind in KINDS:
        mine = [v for (k, _, _), v in zip(pairs, verdicts) if k == kind]
        parsed = [v for v in mine if v.parsed]
        share = lambda hit: sum(hit(v) for v in parsed) / len(parsed) if parsed else float("nan")  # noqa: E731
        rows.append({"kind": kind, "items": len(mine), "incoherent": share(lambda v: v.incoherent is True),
                     "repetition_loop": share(lambda v: v.repetition_loop is True),
                     "corruption": share(lambda v: v.corrupted), "null": share(lambda v: v.null),
                     "unparsed": len(mine) - len(parsed)})
    return rows


def markdown(rows: list[dict]) -> str:
    pct = lambda x: "n/a" if x != x else f"{100 * x:.0f} %"  # noqa: E731
    lines = ["| kind | items | flagged incoherent | flagged repetition_loop | corruption | null | unparsed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['items']} | {pct(r['incoherent'])} | {pct(r['repetition_loop'])} | "
              f"{pct(r['corruption'])} | {pct(r['null'])} | {r['unparsed']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = OneLineErrorParser(prog="judge_agreement.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--judge", default=None,
                   help=f"{JUDGES} (default: local); an OpenAI-compatible endpoint goes through --judge-url")
    p.add_argument("--judge-url", default=None, help="an OpenAI-compatible endpoint (with --judge-model)")
    p.add_argument("--judge-model", default=None, help="the endpoint's model name (with --judge-url)")
    p.add_argument("--cache", default="runs/judge-agreement/cache", help="verdict cache folder")
    p.add_argument("--out", default=None, help="write the table and every verdict as JSON here")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--seed", type=int, default=0, help="seed of the word shuffles")
    args = p.parse_args(argv)
    if args.judge_url is not None and args.judge is not None:
        p.error(f"argument --judge: {args.judge!r} and --judge-url name two judges; give one")
    args.judge = args.judge or "local"
    if args.judge_url is None and args.judge not in ("local", "local-free") \
            and not args.judge.startswith(("local:", "local-free:")):
        p.error(f"argument --judge: {JUDGES}, got {args.judge!r} (an OpenAI-compatible endpoint goes through "
                "--judge-url URL --judge-model NAME)")
    if args.judge_url is None and args.judge_model is not None:
        p.error("argument --judge-model: names the model of a --judge-url endpoint; give --judge-url too")
    if args.judge_url is not None and not args.judge_model:
        p.error("argument --judge-url: needs --judge-model NAME (the endpoint's model)")

    torch.set_num_threads(args.threads)
    pairs = labelled_pairs(args.seed)
    started = time.perf_counter()
    try:  # a judge model that is not there, an endpoint that does not answer: one line, not a traceback
        client = (make_judge_client(url=args.judge_url, model=args.judge_model) if args.judge_url
                  else make_judge_client(args.judge))
        result = DegenerationJudge(client, cache_dir=args.cache, concurrency=1).evaluate([(q, r) for _, q, r in pairs])
    except (ValueError, OSError, JudgeError) as err:
        p.error(str(err))
    seconds = time.perf_counter() - started
    rows = agreement_table(pairs, result.verdicts)
    judge_id = client.judge_id.replace(str(Path.home()), "~")  # no machine-local path in result files
    print(f"judge {judge_id}: {len(pairs)} items, {result.requests} asked now, {seconds:.0f} s\n")
    print(markdown(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "judge": judge_id, "seconds": round(seconds, 1), "table": rows,
            "items": [{"kind": k, "question": q, "response": r, **v.as_dict()}
                      for (k, q, r), v in zip(pairs, result.verdicts)]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
