"""The six benchmarks as data, prompts, and answer checking (math-verify, letters, code in the sandbox)."""

from __future__ import annotations

import pytest

from tadm.tasks.sandbox import CodeLimits
from tadm.tasks.benchmarks import (BENCHMARKS, Example, build_prompt, check_choice, check_math, extract_choice,
                                   extract_code, extract_math_answer, get_benchmark, parse_task_list, score)


def test_the_papers_six_benchmarks():
    table = {b.name: (b.shots, b.max_gen_toks, b.answer_type, b.metric) for b in BENCHMARKS.values()}
    assert table == {
        "gsm8k": (5, 1024, "math", "accuracy"), "humaneval": (0, 1024, "function", "pass@1"),
        "gpqa": (0, 2048, "choice", "accuracy"), "mmlu_pro": (5, 2048, "choice", "accuracy"),
        "livecodebench": (0, 2000, "stdio", "pass@1"), "aime": (0, 4096, "math", "accuracy")}
    assert get_benchmark("gpqa").letters == "ABCD" and len(get_benchmark("mmlu_pro").letters) == 10


def test_task_lists():
    assert [b.name for b in parse_task_list(None)] == list(BENCHMARKS)
    assert [b.name for b in parse_task_list("aime, gsm8k,aime")] == ["aime", "gsm8k"]
    with pytest.raises(ValueError, match="unknown task 'mmlu'.*known tasks: gsm8k"):
        parse_task_list("gsm8k,mmlu")


@pytest.mark.parametrize("response, gold, correct", [
    ("She pays 3 * 6 = 18 dollars. The answer is 18.", "18", True),
    ("Total: 1,234 apples.\n#### 1,234", "1234", True),
    ("so the result is $\\boxed{\\frac{1}{2}}$", "0.5", True),
    ("The answer is 17.", "18", False),
    ("I think 18 is close but the answer is 20.", "18", False),
    ("no number here", "18", False),
    ("The answer is 072.", "72", True),
])
@pytest.mark.slow
def test_math_answers_through_math_verify(response, gold, correct):
    assert check_math(response, gold).correct is correct


def test_math_extraction_prefers_explicit_answers():
    assert extract_math_answer("3 + 4 = 7, then \\boxed{12} and 99") == "12"
    assert extract_math_answer("first 5 then 6") == "6"
    assert extract_math_answer("nothing") is None


@pytest.mark.parametrize("text, letter", [
    ("Reasoning... The answer is (C).", "C"), ("Answer: B", "B"), ("I pick (D) over (A)", "A"),
    ("the answer is b", "B"), ("A cat. So D", "D"), ("no letter here", None)])
def test_multiple_choice_takes_the_final_letter(text, letter):
    assert extract_choice(text, "ABCD") == letter


def test_choice_check_and_mmlu_pro_letters():
    assert check_choice("The answer is (J).", "J", "ABCDEFGHIJ").correct
    assert not check_choice("The answer is (J).", "J", "ABCD").correct


def test_few_shot_prompt_holds_the_shots_then_the_question():
    bench = get_benchmark("gsm8k")
    shots = [Example("s1", "What is 1+1?", "2", solution="1+1=2.\nThe answer is 2."), Example("s2", "2+2?", "4")]
    prompt = build_prompt(bench, Example("q", "What is 3+3?", "6"), shots)
    assert prompt.index("What is 1+1?") < prompt.index("The answer is 2.") < prompt.index("2+2?")
    assert "The answer is 4." in prompt and prompt.endswith("Question: What is 3+3?\nAnswer:")
    mc = build_prompt(get_benchmark("gpqa"), Example("q", "Which?", "B", choices=["x", "y", "z", "w"]))
    assert "(A) x\n(B) y\n(C) z\n(D) w" in mc


# Programs that finish get a time-out they cannot reach, however loaded the machine; a program that loops forever
# gets a short one (it times out whatever the machine's speed).
ROOMY = CodeLimits(timeout=600, allow_execution=True)
LOOP_LIMITS = CodeLimits(timeout=2, allow_execution=True)
HUMANEVAL = Example("he/0", 'def add(a, b):\n    """Sum."""\n', tests="def check(f):\n    assert f(2, 3) == 5\n",
                    entry_point="add")


@pytest.mark.parametrize("completion, passed", [
    ("    return a + b\n", True),
    ("    return a - b\n", False),
    ("    while True:\n        pass\n", False),
    ("    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return a + b\n", False),
    ("Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n", True),
])
@pytest.mark.slow
def test_humaneval_completions_run_in_the_sandbox(completion, passed):
    looping = "while True" in completion  # only it meets its time-out: the others get one they cannot reach
    result = score(get_benchmark("humaneval"), HUMANEVAL, completion, limits=LOOP_LIMITS if looping else ROOMY)
    assert result.correct is passed
    if "while True" in completion:
        assert result.detail == "timeout"


def test_livecodebench_programs_must_pass_every_test():
    example = Example("lcb/0", "Reverse the line.", tests=[{"input": "abc\n", "output": "cba\n"},
                                                          {"input": "xy\n", "output": "yx"}])
    good = "```python\nprint(input()[::-1])\n```"
    assert score(get_benchmark("livecodebench"), example, good, limits=ROOMY).correct
    bad = score(get_benchmark("livecodebench"), example, "```python\nprint(input())\n```", limits=ROOMY)
    assert not bad.correct and bad.detail == "test 0: wrong output"
    assert extract_code("no fence") is None


def test_the_laptop_addition_task_is_named_only():
    bench = get_benchmark("addition")
    assert "addition" not in [b.name for b in parse_task_list(None)]
    assert [b.name for b in parse_task_list("addition")] == ["addition"]
    prompt = build_prompt(bench, Example("0", "What is 47+385?", "432"))
    assert prompt == "Give only the sum.\n\nQuestion: What is 47+385?\nAnswer:"
    assert score(bench, Example("0", "What is 47+385?", "432"), "432").correct
    assert not score(bench, Example("0", "What is 47+385?", "432"), "423").correct
    assert not score(bench, Example("0", "What is 47+385?", "432"), "").correct


@pytest.mark.parametrize("response, correct, extracted", [
    ("58+79", True, "58+79"), ("137+0", True, "137+0"), (" 70 + 67<eos>", True, "70+67"),
    ("58+78", False, "58+78"), ("59+79", False, "59+79"), ("58+79+1", True, "58+79"),  # the first a+b counts
    ("5879", False, None), ("", False, None), ("-1+138", True, "-1+138"),
])
def test_split_answers_any_pair_with_the_right_sum(response, correct, extracted):
    bench = get_benchmark("split")
    example = Example("0", "Write 137 as a sum of two numbers.", "137")
    assert "split" not in [b.name for b in parse_task_list(None)]
    checked = score(bench, example, response)
    assert (checked.correct, checked.extracted) == (correct, extracted)
    assert build_prompt(bench, example) == ("Give two numbers whose sum is the given number, as a+b.\n\n"
                                            "Question: Write 137 as a sum of two numbers.\nAnswer:")
