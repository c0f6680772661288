"""Loading benchmarks from local JSONL files (fields, few-shot files, errors) and the Hub fallback's errors."""

from __future__ import annotations

import json

import pytest

from tadm.tasks import datasets as task_datasets
from tadm.tasks.benchmarks import get_benchmark
from tadm.tasks.datasets import load_task


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


GSM = [{"question": f"What is {n} + 1?", "answer": f"{n} + 1 = {n + 1}\n#### {n + 1:,}"} for n in range(998, 1006)]


def test_gsm8k_shots_come_from_the_first_records_without_a_fewshot_file(tmp_path):
    write_jsonl(tmp_path / "gsm8k.jsonl", GSM)
    data = load_task(get_benchmark("gsm8k"), tmp_path)
    assert len(data.shots) == 5 and len(data.examples) == 3 and data.source.endswith("gsm8k.jsonl")
    assert data.examples[0].question == "What is 1003 + 1?" and data.examples[0].answer == "1004"
    assert data.shots[0].solution == "998 + 1 = 999\nThe answer is 999."
    assert len(load_task(get_benchmark("gsm8k"), tmp_path, limit=2).examples) == 2


def test_a_fewshot_file_provides_the_shots(tmp_path):
    write_jsonl(tmp_path / "mmlu_pro.jsonl", [{"question": "Q?", "options": list("abcdefghij"), "answer": "j"}])
    write_jsonl(tmp_path / "mmlu_pro.fewshot.jsonl", [
        {"question": f"S{n}?", "options": ["x", "y"], "answer": "B", "cot_content": "Think. The answer is (B)."}
        for n in range(7)])
    data = load_task(get_benchmark("mmlu_pro"), tmp_path)
    assert len(data.examples) == 1 and data.examples[0].answer == "J" and len(data.examples[0].choices) == 10
    assert len(data.shots) == 5 and data.shots[0].solution == "Think. The answer is (B)."


def test_every_task_reads_its_documented_fields(tmp_path):
    write_jsonl(tmp_path / "humaneval.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\n",
                                                "test": "def check(c): pass", "entry_point": "f"}])
    write_jsonl(tmp_path / "gpqa.jsonl", [{"question": "Q", "choices": ["a", "b", "c", "d"], "answer": "C"}])
    write_jsonl(tmp_path / "livecodebench.jsonl", [{"question": "Echo.", "tests": [{"input": "1", "output": "1"}]}])
    write_jsonl(tmp_path / "aime.jsonl", [{"problem": "Find n.", "answer": 204}])
    assert load_task(get_benchmark("humaneval"), tmp_path).examples[0].id == "HumanEval/0"
    assert load_task(get_benchmark("gpqa"), tmp_path).examples[0].choices == ["a", "b", "c", "d"]
    assert load_task(get_benchmark("livecodebench"), tmp_path).examples[0].tests == [{"input": "1", "output": "1"}]
    assert load_task(get_benchmark("aime"), tmp_path).examples[0].answer == "204"


def test_a_missing_file_names_the_path_and_the_fields(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_task(get_benchmark("gpqa"), tmp_path)
    message = str(err.value)
    assert str(tmp_path / "gpqa.jsonl") in message and "question, choices, answer" in message
    assert "\n" not in message


def test_a_malformed_line_is_named(tmp_path):
    (tmp_path / "aime.jsonl").write_text('{"problem": "a", "answer": 1}\n\n{"problem": oops}\n')
    with pytest.raises(ValueError, match=r"aime.jsonl:3: not valid JSON"):
        load_task(get_benchmark("aime"), tmp_path)


def test_a_missing_field_is_named(tmp_path):
    write_jsonl(tmp_path / "aime.jsonl", [{"problem": "a", "answer": 1}, {"problem": "b"}])
    with pytest.raises(ValueError, match=r"aime.jsonl:2: missing field\(s\) answer"):
        load_task(get_benchmark("aime"), tmp_path)


def test_bad_tests_and_too_few_shots(tmp_path):
    write_jsonl(tmp_path / "livecodebench.jsonl", [{"question": "q", "tests": [{"input": "1"}]}])
    with pytest.raises(ValueError, match="'tests' must be a list"):
        load_task(get_benchmark("livecodebench"), tmp_path)
    write_jsonl(tmp_path / "gsm8k.jsonl", GSM[:5])
    with pytest.raises(ValueError, match="needs 5 few-shot examples"):
        load_task(get_benchmark("gsm8k"), tmp_path)


def test_the_hub_failing_is_one_line_pointing_to_data_dir(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no route to the Hub\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError) as err:
        load_task(get_benchmark("gsm8k"))
    assert "openai/gsm8k" in str(err.value) and "--data-dir" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="livecodebench cannot be loaded from the Hub"):
        load_task(get_benchmark("livecodebench"))


def test_hub_gpqa_rows_become_lettered_choices():
    row = {"Question": "Q?", "Correct Answer": "right", "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2",
           "Incorrect Answer 3": "w3", "Record ID": "rec1"}
    record = task_datasets._gpqa_record(row)
    assert sorted(record["choices"]) == ["right", "w1", "w2", "w3"]
    assert record["choices"]["ABCD".index(record["answer"])] == "right"
    assert task_datasets._gpqa_record(row) == record  # the same order every time
