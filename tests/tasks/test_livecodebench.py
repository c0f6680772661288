"""LiveCodeBench: released rows (plain and compressed test cases) as records, and both kinds of test run."""

from __future__ import annotations

import base64
import json
import pickle
import zlib

import pytest

from tadm.tasks.sandbox import CodeLimits
from tadm.tasks.benchmarks import build_prompt, get_benchmark, score
from tadm.tasks.datasets import example_from_record
from tadm.tasks.livecodebench import (convert_rows, decode_test_cases, functional_checks, functional_program,
                                      record_from_row, same_json_output)

LCB = get_benchmark("livecodebench")


def compressed(value) -> str:
    """How the released files store private tests: base64(zlib(pickle(JSON string)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(value)))).decode()


def raw_rows():
    """Two released-format rows: an AtCoder stdin problem and a LeetCode functional one."""
    return [
        {"question_title": "Reverse", "question_content": "Print the line reversed.", "platform": "atcoder",
         "question_id": "abc001_a", "contest_date": "2025-02-01T00:00:00", "starter_code": "",
         "public_test_cases": json.dumps([{"input": "abc\n", "output": "cba\n", "testtype": "stdin"}]),
         "private_test_cases": compressed([{"input": "xy\n", "output": "yx\n", "testtype": "stdin"}]),
         "metadata": "{}"},
        {"question_title": "Two Sum", "question_content": "Return indices of two numbers adding to target.",
         "platform": "leetcode", "question_id": "1", "contest_date": "2025-04-10T00:00:00",
         "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
         "public_test_cases": json.dumps([{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"}]),
         "private_test_cases": compressed([{"input": "[3, 3]\n6", "output": "[0, 1]", "testtype": "functional"}]),
         "metadata": json.dumps({"func_name": "twoSum"})},
    ]


def test_test_cases_decode_from_json_and_from_the_compressed_form():
    cases = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    assert decode_test_cases(json.dumps(cases)) == decode_test_cases(compressed(cases)) == cases
    assert decode_test_cases(cases) == cases and decode_test_cases("") == []
    with pytest.raises(ValueError, match="neither JSON nor compressed"):
        decode_test_cases("not a test list")


class Boom:
    def __reduce__(self):
        return (print, ("a pickle ran code",))


def test_a_pickle_with_a_global_is_refused(capsys):
    payload = base64.b64encode(zlib.compress(pickle.dumps(Boom()))).decode()
    with pytest.raises(ValueError, match="refusing builtins.print"):
        decode_test_cases(payload)
    assert "a pickle ran code" not in capsys.readouterr().out


def test_rows_become_records_with_every_test_and_dates_filter():
    stdin_row, leet_row = (record_from_row(r) for r in raw_rows())
    assert stdin_row["question"] == "Reverse\n\nPrint the line reversed." and stdin_row["date"] == "2025-02-01"
    assert [t["input"] for t in stdin_row["tests"]] == ["abc\n", "xy\n"] and stdin_row["func_name"] == ""
    assert leet_row["func_name"] == "twoSum" and len(leet_row["tests"]) == 2
    assert [r["id"] for r in convert_rows(raw_rows(), since="2025-03-01")] == ["1"]
    assert [r["id"] for r in convert_rows(raw_rows(), until="2025-03-01")] == ["abc001_a"]


# Programs that finish get a time-out they cannot reach, however loaded the machine (the looping one gets 1 s).
ROOMY = CodeLimits(timeout=600, allow_execution=True)


def _examples():
    return [example_from_record(LCB, record_from_row(r), n) for n, r in enumerate(raw_rows())]


@pytest.mark.slow
def test_stdin_and_functional_solutions_are_run_against_every_test():
    stdin_ex, leet_ex = _examples()
    assert score(LCB, stdin_ex, "```python\nprint(input()[::-1])\n```", limits=ROOMY).correct
    assert not score(LCB, stdin_ex, "```python\nprint(input())\n```", limits=ROOMY).correct
    good = ("```python\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
            "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
            "                return [seen[target - x], i]\n            seen[x] = i\n```")
    assert score(LCB, leet_ex, good, limits=ROOMY).correct
    first_only = good.replace("return [seen[target - x], i]", "return [0, 1] if len(nums) > 3 else [1, 0]")
    wrong = score(LCB, leet_ex, first_only, limits=ROOMY)
    assert not wrong.correct and wrong.detail == "test 1: wrong output"  # passes the public test only
    loops = good.replace("seen = {}", "while True: pass")
    assert score(LCB, leet_ex, loops, limits=CodeLimits(timeout=1, allow_execution=True)).detail == "test 0: timeout"


def test_prompts_show_the_starter_code_when_there_is_one():
    stdin_ex, leet_ex = _examples()
    assert "standard input" in build_prompt(LCB, stdin_ex) and "class Solution" not in build_prompt(LCB, stdin_ex)
    prompt = build_prompt(LCB, leet_ex)
    assert prompt.startswith("Complete the starter code") and "def twoSum(self" in prompt


def test_functional_driver_and_output_comparison():
    program = functional_program("class Solution:\n    def f(self, a, b):\n        return a + b\n", "f")
    assert program.startswith("from typing import *") and program.rstrip().endswith("return a + b")
    checks = functional_checks("f", "[1, 2]\n3")  # the call runs in the harness, not in the program
    assert "program.method(\"Solution\", 'f')" in checks and "print(json.dumps(" in checks
    assert same_json_output("[0, 1]\n", "[0,1]") and not same_json_output("[1, 0]", "[0, 1]")
    assert same_json_output("true", "true") and same_json_output("abc", " abc ")
    with pytest.raises(ValueError, match="func_name"):
        functional_program("x = 1", "")
    with pytest.raises(ValueError, match="func_name"):
        functional_checks("", "1")


def test_functional_tests_without_a_method_name_are_a_clear_error():
    record = record_from_row(raw_rows()[1])
    record["func_name"] = ""
    with pytest.raises(ValueError, match="need 'func_name'"):
        example_from_record(LCB, record, 0, "lcb.jsonl:2")


def test_the_convert_command_writes_what_eval_tasks_reads(tmp_path, capsys):
    from tadm.cli import main
    from tadm.tasks.datasets import load_task

    raw = tmp_path / "test6.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in raw_rows()))
    out = tmp_path / "data" / "livecodebench.jsonl"
    assert main(["eval", "convert-livecodebench", str(raw), "--out", str(out)]) == 0
    assert "2 problems (1 functional, 1 stdin), 4 tests" in capsys.readouterr().out
    data = load_task(LCB, out.parent)
    assert [e.id for e in data.examples] == ["abc001_a", "1"] and data.examples[1].entry_point == "twoSum"
    assert main(["eval", "convert-livecodebench", str(raw), "--out", str(out), "--since", "2026-01-01"]) == 2
    assert "no problem left of 2" in capsys.readouterr().err
    assert main(["eval", "convert-livecodebench", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    raw.write_text("{broken\n")
    assert main(["eval", "convert-livecodebench", str(raw), "--out", str(out)]) == 2
    assert "test6.jsonl:1: not valid JSON" in capsys.readouterr().err
    # records of another dataset, a row without test cases, and dates that are not dates are refused by name
    raw.write_text(json.dumps(raw_rows()[0]) + "\n" + json.dumps({"question_id": "q", "text": "hello"}) + "\n")
    assert main(["eval", "convert-livecodebench", str(raw), "--out", str(out)]) == 2
    assert "test6.jsonl: row 2 (q): not a LiveCodeBench problem: no question_content, public_test_cases, " \
           "contest_date" in capsys.readouterr().err
    raw.write_text(json.dumps({**raw_rows()[0], "public_test_cases": "[]", "private_test_cases": ""}) + "\n")
    assert main(["eval", "convert-livecodebench", str(raw), "--out", str(out)]) == 2
    assert "row 1 (abc001_a): no test cases" in capsys.readouterr().err
    for flags, message in ((["--since", "2025-13-01"], "--since: expected a date YYYY-MM-DD, got '2025-13-01'"),
                           (["--since", "2025-05-01", "--until", "2025-01-01"], "--since 2025-05-01 is after")):
        assert main(["eval", "convert-livecodebench", str(raw), "--out", str(out), *flags]) == 2
        assert message in capsys.readouterr().err
