"""The six benchmarks of the post-training table (sec. "TADM:Post-train"): prompts and answer checking.

Each :class:`Benchmark` is data - shots, generation length (``max_gen_toks``), answer type and metric,
as in the paper's post-training table (no-think mode, canvas 256, 48 steps):

=================  =====  ======  ==========================  =======
benchmark          shots  tokens  answer                      metric
=================  =====  ======  ==========================  =======
gsm8k              5      1,024   number (math-verify)        accuracy
humaneval          0      1,024   Python function (tests)     pass@1
gpqa               0      2,048   letter A-D                  accuracy
mmlu_pro           5      2,048   letter A-J                  accuracy
livecodebench      0      2,000   program (stdin/stdout)      pass@1
aime               0      4,096   integer (math-verify)       accuracy
=================  =====  ======  ==========================  =======

Beside them, :data:`EXTRA_BENCHMARKS` holds tasks that are not in the paper's table and are only run
when named, the laptop-scale tasks of ``scripts/laptop_task.py`` that a tiny model learns on CPU:

* ``addition`` (0-shot, "What is 47+385?" -> ``432``, checked as math): one right answer, fixed by the prompt;
* ``split`` (0-shot, "Write 137 as a sum of two numbers." -> any ``a+b`` with a + b = 137, e.g. ``58+79``):
  many right answers, so the tokens of an answer depend on each other, not only on the prompt. A
  sampler that fixes ``a`` and ``b`` from predictions that did not see each other (a stale view of the
  canvas) writes a sum that is wrong, which is what naive reuse of a stale anchor risks.

:func:`build_prompt` formats an :class:`Example` after its few-shot examples; :func:`score` checks a
response: math answers through ``math-verify`` (``math_verify.parse`` / ``verify``), multiple choice by
the final letter, code by running the program in :mod:`tadm.tasks.sandbox` (never in this process).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tadm.tasks.livecodebench import functional_checks, functional_program, same_json_output
from tadm.tasks.sandbox import CodeLimits, run_program

__all__ = ["BENCHMARKS", "EXTRA_BENCHMARKS", "Benchmark", "Example", "Score", "build_prompt", "check_choice",
           "check_math", "check_sum", "extract_choice", "extract_code", "extract_math_answer", "get_benchmark",
           "humaneval_checks", "humaneval_program", "parse_task_list", "score", "select_shots", "timed_out"]


@dataclass(frozen=True)
class Benchmark:
    """One benchmark of the post-training table: how it is prompted, generated and scored."""

    name: str
    title: str  # as in the paper's table
    shots: int
    max_gen_toks: int
    answer_type: str  # "math", "choice", "function" (HumanEval), "stdio" (LiveCodeBench) or "sum" (split)
    metric: str  # "accuracy" or "pass@1"
    fields: tuple[str, ...]  # required fields of a local JSONL record
    letters: str = ""  # valid letters of a multiple-choice benchmark
    until: tuple[str, ...] = ()  # stop strings
    instruction: str | None = None  # replaces the answer type's instruction in the prompt
    shots_by: str = ""  # "category": few-shot examples of the evaluated example's own category first

    @property
    def runs_code(self) -> bool:
        """Its check runs model-written programs (HumanEval, LiveCodeBench): the user must opt in."""
        return self.answer_type in ("function", "stdio")


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("gsm8k", "GSM8K", 5, 1024, "math", "accuracy", ("question", "answer"), until=("Question:",)),
    Benchmark("humaneval", "HumanEval", 0, 1024, "function", "pass@1", ("prompt", "test", "entry_point"),
              until=("\nclass ", "\nif __name__", "\nprint(")),
    Benchmark("gpqa", "GPQA-Diamond", 0, 2048, "choice", "accuracy", ("question", "choices", "answer"),
              letters="ABCD"),
    Benchmark("mmlu_pro", "MMLU-Pro", 5, 2048, "choice", "accuracy", ("question", "options", "answer"),
              letters="ABCDEFGHIJ", until=("Question:",), shots_by="category"),
    Benchmark("livecodebench", "LiveCodeBench-v6", 0, 2000, "stdio", "pass@1", ("question", "tests")),
    Benchmark("aime", "AIME26", 0, 4096, "math", "accuracy", ("problem", "answer")),
)}

EXTRA_BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    # local data only: records {"problem": "What is 47+385?", "answer": "432"}
    Benchmark("addition", "Addition", 0, 8, "math", "accuracy", ("problem", "answer"),
              instruction="Give only the sum."),
    # local data only: records {"problem": "Write 137 as a sum of two numbers.", "answer": "137"}
    Benchmark("split", "Split", 0, 8, "sum", "accuracy", ("problem", "answer"),
              instruction="Give two numbers whose sum is the given number, as a+b."),
)}
"""Tasks outside the paper's table (never in the default task list)."""


def get_benchmark(name: str) -> Benchmark:
    """The benchmark called ``name``; an unknown name is a ValueError listing the known ones."""
    known = {**BENCHMARKS, **EXTRA_BENCHMARKS}
    if name not in known:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(known)}")
    return known[name]


def parse_task_list(text: str | Sequence[str] | None) -> list[Benchmark]:
    """``"gsm8k,humaneval"`` (or a list, or None: the paper's six) as benchmarks, in the given order, no repeats."""
    names = list(BENCHMARKS) if text is None else (text.split(",") if isinstance(text, str) else list(text))
    names = [n.strip() for n in names]
    if not any(names):
        raise ValueError("no task given; known tasks: " + ", ".join(BENCHMARKS))
    if not all(names):
        raise ValueError(f"task list {text!r} has an empty item; known tasks: " + ", ".join(BENCHMARKS))
    return [get_benchmark(n) for n in dict.fromkeys(names)]


@dataclass
class Example:
    """One normalized benchmark item (see :mod:`tadm.tasks.datasets` for the source fields).

    question: the problem text (HumanEval: the function's signature and docstring).
    answer: the gold answer (a number, or a letter); ``solution``: a worked answer for few-shot prompts.
    choices: the options of a multiple-choice item; ``tests``: HumanEval's test code, or
    LiveCodeBench's ``[{"input": ..., "output": ..., "testtype": "stdin" or "functional"}]``;
    ``entry_point``: HumanEval's function name, or a LiveCodeBench LeetCode method's (``func_name``);
    ``starter_code``: LiveCodeBench's code to complete (LeetCode problems);
    ``category``: MMLU-Pro's subject (its few-shot examples are taken from the same subject).
    """

    id: str
    question: str
    answer: str = ""
    choices: list[str] = field(default_factory=list)
    solution: str = ""
    tests: Any = None
    entry_point: str = ""
    category: str = ""
    starter_code: str = ""


# ------------------------------------------------------------------------------------------ prompts
def _shot_answer(bench: Benchmark, example: Example) -> str:
    if example.solution:
        return example.solution.strip()
    return f"The answer is ({example.answer})." if bench.answer_type == "choice" else f"The answer is {example.answer}."


def _question(bench: Benchmark, example: Example) -> str:
    if bench.answer_type == "choice":
        choices = "\n".join(f"({bench.letters[n]}) {text}" for n, text in enumerate(example.choices))
        return f"Question: {example.question.strip()}\n{choices}\nAnswer:"
    return f"Question: {example.question.strip()}\nAnswer:"


_INSTRUCTIONS = {
    "math": "Solve the problem step by step. End with 'The answer is N.' where N is the final answer.",
    "choice": "Think step by step, then end with 'The answer is (X).' where X is the letter of the correct option.",
    "stdio": ("Write a complete Python 3 program that reads the input from standard input and writes the answer "
              "to standard output. Give the program in one ```python code block."),
    "starter": ("Complete the starter code below into a correct Python 3 solution of the problem. Give the whole "
                "solution in one ```python code block."),
}


def select_shots(bench: Benchmark, example: Example, pool: Sequence[Example]) -> list[Example]:
    """The ``bench.shots`` few-shot examples for ``example`` from ``pool``, in pool order.

    A benchmark with ``shots_by="category"`` (MMLU-Pro, as in its own evaluation) takes the examples of
    ``example.category`` first and fills up from the others when the category has too few.
    """
    if bench.shots_by == "category" and example.category:
        same = [shot for shot in pool if shot.category == example.category]
        pool = same + [shot for shot in pool if shot.category != example.category]
    return list(pool[:bench.shots])


def build_prompt(bench: Benchmark, example: Example, shots: Sequence[Example] = ()) -> str:
    """The prompt of ``example`` after ``shots`` (their worked answers); HumanEval is its code prompt."""
    if bench.answer_type == "function":
        return example.question
    if bench.answer_type == "stdio" and example.starter_code:
        return (f"{_INSTRUCTIONS['starter']}\n\n{example.question.strip()}\n\n"
                f"```python\n{example.starter_code.rstrip()}\n```\n")
    if bench.answer_type == "stdio":
        return f"{_INSTRUCTIONS['stdio']}\n\n{example.question.strip()}\n"
    parts = [bench.instruction if bench.instruction is not None else _INSTRUCTIONS[bench.answer_type]]
    parts += [f"{_question(bench, shot)} {_shot_answer(bench, shot)}" for shot in shots]
    parts.append(_question(bench, example))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------- answer checking
@dataclass
class Score:
    """A checked response: correct or not, the extracted answer, and a short note (e.g. sandbox status)."""

    correct: bool
    extracted: str | None
    detail: str = ""


_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\$?\\?\(?\s*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces allowed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for pos in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth < 0:
            return text[begin:pos]
    return None


def extract_math_answer(text: str) -> str | None:
    """The final answer of a math response: ``\\boxed{}``, ``#### N``, ``answer is N``, else the last number."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = _NUMBER.search(text.rsplit("####", 1)[1])
        if tail:
            return tail.group(0).replace(",", "")
    said = _ANSWER_IS.findall(text)
    if said:
        number = _NUMBER.search(said[-1])
        return number.group(0).replace(",", "") if number else said[-1].strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def check_math(response: str, gold: str) -> Score:
    """Is the response's final answer equal to ``gold`` (``math_verify.verify`` of both parsed)?"""
    # deferred: math-verify is an optional dependency (the tasks extra)
    from math_verify import parse, verify

    extracted = extract_math_answer(response)
    if extracted is None:
        return Score(False, None, "no answer found")
    wrap = lambda s: s if "$" in s or "\\" in s else f"${s}$"  # noqa: E731
    gold_parsed, pred_parsed = parse(wrap(str(gold).replace(",", ""))), parse(wrap(extracted))
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} does not parse as math")
    return Score(bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed)), extracted)


_SUM = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)")


def check_sum(response: str, gold: str) -> Score:
    """``split``: the response's first ``a+b`` (integers) adds up to ``gold``."""
    found = _SUM.search(response)
    if found is None:
        return Score(False, None, "no a+b found")
    a, b = int(found.group(1)), int(found.group(2))
    return Score(a + b == int(str(gold).strip()), f"{a}+{b}")


def extract_choice(text: str, letters: str) -> str | None:
    """The chosen letter: the last 'answer is (X)' / 'Answer: X', else the last '(X)', else the last lone X."""
    group = f"[{letters}]"
    for pattern in (rf"answer\s*(?:is|:)\s*\**\s*\(?({group})\b", rf"\(({group})\)", rf"\b({group})\b"):
        found = re.findall(pattern, text, flags=re.IGNORECASE if pattern.startswith("answer") else 0)
        if found:
            return found[-1].upper()
    return None


def check_choice(response: str, gold: str, letters: str) -> Score:
    """Is the response's final letter the gold letter?"""
    extracted = extract_choice(response, letters)
    return Score(extracted == str(gold).strip().upper(), extracted)


_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The code of the last fenced block that has any, or None when there is no fence."""
    blocks = [b for b in _FENCE.findall(text) if b.strip()]
    return blocks[-1] if blocks else None


def humaneval_program(example: Example, completion: str) -> str:
    """The program run for a HumanEval completion: prompt + completion, or the fenced function with the prompt's
    imports. The tests are not in it: they run in the sandbox's harness (:func:`humaneval_checks`)."""
    code = extract_code(completion)
    if code is None or f"def {example.entry_point}" not in code:
        return example.question + (code if code is not None else completion) + "\n"
    return "\n".join(line for line in example.question.splitlines()
                     if line.startswith(("import ", "from "))) + "\n" + code + "\n"


_HUMANEVAL_CHECKS = """\
for _tail in ("", "\\n    pass\\n"):  # the prompt's helpers and imports; a stub without a docstring needs a body
    try:
        _prompt = compile({prompt!r} + _tail, "prompt.py", "exec", dont_inherit=True)
        break
    except SyntaxError:
        _prompt = compile("", "prompt.py", "exec")
exec(_prompt)
{tests}

{name} = program.function({name!r})
check({name})
"""


def humaneval_checks(example: Example) -> str:
    """The harness's side: the prompt (its helpers, e.g. ``poly`` or ``encode_cyclic``, and imports), the tests,
    the entry point's name bound to the program's function (some tests call it by name), and ``check`` on it."""
    return _HUMANEVAL_CHECKS.format(prompt=example.question, tests=example.tests, name=example.entry_point)


def check_function(example: Example, completion: str, *, limits: CodeLimits) -> Score:
    """HumanEval: ``check(...)`` returned, run in the sandbox's harness on the program's function."""
    result = run_program(humaneval_program(example, completion), mode="tests", checks=humaneval_checks(example),
                         **limits.run_kwargs())
    return Score(result.ok, None, result.status)


def timed_out(detail: str) -> bool:
    """Did a code check end at its time limit (its :class:`Score` ``detail``: ``timeout`` or ``test N: timeout``)?"""
    return detail == "timeout" or detail.endswith(": timeout")


def _same_output(actual: str, expected: str) -> bool:
    lines = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return lines(actual) == lines(expected)


def check_stdio(example: Example, response: str, *, limits: CodeLimits) -> Score:
    """LiveCodeBench: every test passes - a ``stdin`` test prints the expected output for its input and
    ends normally (``SystemExit`` 0 included), a ``functional`` one returns the expected JSON value from
    ``Solution().<entry_point>(*args)`` with the driver run to its end."""
    code = extract_code(response) or response  # a block found is never empty
    for n, test in enumerate(example.tests or []):
        if test.get("testtype") == "functional":
            checks = functional_checks(example.entry_point, str(test["input"]))
            result = run_program(functional_program(code, example.entry_point), mode="tests", checks=checks,
                                 **limits.run_kwargs())
            output, same = result.checks_output, same_json_output
        else:
            result = run_program(code, stdin=str(test["input"]), mode="script", **limits.run_kwargs())
            output, same = result.stdout, _same_output
        if result.status != "ok" or not same(output, str(test["output"])):
            return Score(False, None, f"test {n}: {result.status if result.status != 'ok' else 'wrong output'}")
    return Score(bool(example.tests), None, "passed" if example.tests else "no tests")


def score(bench: Benchmark, example: Example, response: str, *, limits: CodeLimits | None = None) -> Score:
    """Check ``response`` to ``example`` the benchmark's way.

    Code benchmarks run the program in the sandbox (:mod:`tadm.tasks.sandbox`) with ``limits``, which
    carries the user's opt-in; without it they raise :class:`~tadm.tasks.sandbox.CodeExecutionNotAllowed`.
    """
    if bench.answer_type == "math":
        return check_math(response, example.answer)
    if bench.answer_type == "choice":
        return check_choice(response, example.answer, bench.letters)
    if bench.answer_type == "sum":
        return check_sum(response, example.answer)
    limits = CodeLimits() if limits is None else limits
    if bench.answer_type == "function":
        return check_function(example, response, limits=limits)
    return check_stdio(example, response, limits=limits)
