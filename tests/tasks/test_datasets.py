"""Loading benchmarks from local JSONL files (fields, few-shot files, errors) and the Hub fallback's errors."""

from __future__ import annotations

import json

import pytest

from tadm.tasks import datasets as task_datasets
from tadm.tasks.benchmarks import build_prompt, get_benchmark
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
    assert len(data.shots_for(data.examples[0])) == 5 and data.shots[0].solution == "Think. The answer is (B)."


def test_mmlu_pro_shots_are_those_of_the_question_s_category(tmp_path):
    categories = ["law"] * 5 + ["math"] * 5 + ["physics"] * 3
    write_jsonl(tmp_path / "mmlu_pro.fewshot.jsonl", [
        {"question": f"{c} shot {n}?", "options": ["x", "y"], "answer": "A", "category": c}
        for n, c in enumerate(categories)])
    write_jsonl(tmp_path / "mmlu_pro.jsonl", [
        {"question": f"Q {c}?", "options": ["x", "y"], "answer": "B", "category": c}
        for c in ("math", "law", "physics", "history")] + [{"question": "Q?", "options": ["x", "y"], "answer": "B"}])
    data = load_task(get_benchmark("mmlu_pro"), tmp_path)
    picked = {ex.question: [shot.question for shot in data.shots_for(ex)] for ex in data.examples}
    assert picked["Q math?"] == [f"math shot {n}?" for n in range(5, 10)]
    assert picked["Q law?"] == [f"law shot {n}?" for n in range(5)]
    # too few of its own: its three, then the first others in file order
    assert picked["Q physics?"] == [f"physics shot {n}?" for n in (10, 11, 12)] + ["law shot 0?", "law shot 1?"]
    assert picked["Q history?"] == picked["Q?"] == [f"law shot {n}?" for n in range(5)]  # no match: the first five
    prompt = build_prompt(get_benchmark("mmlu_pro"), data.examples[0], data.shots_for(data.examples[0]))
    assert "math shot 5?" in prompt and "law shot" not in prompt
    # gsm8k keeps its first five for every question
    write_jsonl(tmp_path / "gsm8k.jsonl", GSM)
    gsm = load_task(get_benchmark("gsm8k"), tmp_path)
    assert all(gsm.shots_for(ex) == gsm.shots for ex in gsm.examples) and len(gsm.shots) == 5


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


@pytest.mark.parametrize("answer", ["seventy", [1, 2], 2.5, True, "1e3", ""])
def test_an_integer_task_refuses_an_answer_that_is_not_an_integer(tmp_path, answer):
    write_jsonl(tmp_path / "aime.jsonl", [{"problem": "a", "answer": 7}, {"problem": "b", "answer": answer}])
    with pytest.raises(ValueError, match=r"aime.jsonl:2: 'answer' must be an integer .*, got ") as info:
        load_task(get_benchmark("aime"), tmp_path)
    assert "\n" not in str(info.value)


def test_an_integer_task_takes_integers_and_strings_of_digits(tmp_path):
    write_jsonl(tmp_path / "aime.jsonl", [{"problem": "a", "answer": 7}, {"problem": "b", "answer": " 042 "},
                                          {"problem": "c", "answer": 12.0}, {"problem": "d", "answer": "-3"}])
    assert [e.answer for e in load_task(get_benchmark("aime"), tmp_path).examples] == ["7", "042", "12", "-3"]


@pytest.mark.parametrize("task,record,message", [
    ("gpqa", {"question": "q", "choices": list("abcd"), "answer": "E"},
     r"gpqa.jsonl:1: 'answer' must be one letter A-D"),
    ("gpqa", {"question": "q", "choices": list("abcd"), "answer": "(B) b"}, r"'answer' must be one letter A-D"),
    ("gpqa", {"question": "q", "choices": list("abc"), "answer": "A"}, r"gpqa.jsonl:1: gpqa needs 4 choices, got 3"),
    ("gpqa", {"question": "q", "choices": "abcd", "answer": "A"}, r"gpqa.jsonl:1: 'choices' must be a list"),
    ("mmlu_pro", {"question": "q", "options": ["a", "b"], "answer": "C"}, r"mmlu_pro.jsonl:1: 'answer' .* A-B"),
])
def test_a_choice_answer_must_be_a_letter_of_its_options(tmp_path, task, record, message):
    with pytest.raises(ValueError, match=message):
        task_datasets.example_from_record(get_benchmark(task), record, 0, str(tmp_path / f"{task}.jsonl:1"))


def test_bad_tests_and_too_few_shots(tmp_path):
    write_jsonl(tmp_path / "livecodebench.jsonl", [{"question": "q", "tests": [{"input": "1"}]}])
    with pytest.raises(ValueError, match="'tests' must be a list"):
        load_task(get_benchmark("livecodebench"), tmp_path)
    write_jsonl(tmp_path / "gsm8k.jsonl", GSM[:5])
    with pytest.raises(ValueError, match="needs 5 few-shot examples"):
        load_task(get_benchmark("gsm8k"), tmp_path)


@pytest.mark.slow
def test_the_hub_failing_is_one_line_pointing_to_data_dir(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no route to the Hub\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError) as err:
        load_task(get_benchmark("gsm8k"))
    assert "openai/gsm8k" in str(err.value) and "--data-dir" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="split cannot be loaded from the Hub"):
        load_task(get_benchmark("split"))


def test_livecodebench_from_the_hub_is_its_raw_v6_file_converted(monkeypatch, tmp_path):

    from tests.tasks.test_livecodebench import raw_rows

    asked = []

    def download(repo_id, filename, repo_type=None, **kwargs):
        asked.append((repo_id, filename, repo_type))
        return str(write_jsonl(tmp_path / filename, raw_rows()))

    monkeypatch.setattr("tadm.tasks.datasets.hf_hub_download", download)
    data = load_task(get_benchmark("livecodebench"))
    assert asked == [("livecodebench/code_generation_lite", "test6.jsonl", "dataset")]
    assert data.source == "hub:livecodebench/code_generation_lite" and len(data.examples) == 2
    assert data.examples[1].entry_point == "twoSum" and data.examples[1].starter_code.startswith("class Solution")

    def unreachable(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr("tadm.tasks.datasets.hf_hub_download", unreachable)
    with pytest.raises(ValueError, match="could not load livecodebench/code_generation_lite.*--data-dir"):
        load_task(get_benchmark("livecodebench"))


def test_hub_gpqa_rows_become_lettered_choices():
    row = {"Question": "Q?", "Correct Answer": "right", "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2",
           "Incorrect Answer 3": "w3", "Record ID": "rec1"}
    record = task_datasets._gpqa_record(row)
    assert sorted(record["choices"]) == ["right", "w1", "w2", "w3"]
    assert record["choices"]["ABCD".index(record["answer"])] == "right"
    assert task_datasets._gpqa_record(row) == record  # the same order every time
