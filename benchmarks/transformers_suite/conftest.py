"""Harness conftest for transformers' DiffusionGemma model tests (copied beside the tests by run.sh).

It never edits a test body. It does three things:

1. registers the pytest markers transformers' own pyproject/conftest declare;
2. optionally substitutes the class under test (TADM_HF_CLASS, TADM_HF_K): every collected test module's
   global ``DiffusionGemmaForBlockDiffusion`` and every test class's ``all_model_classes`` /
   ``all_generative_model_classes`` entry that is ``DiffusionGemmaForBlockDiffusion`` are replaced by the
   substituted class before any test runs (see README.md for the contract);
3. writes a per-test summary JSON (TADM_HF_SUMMARY=path): outcome, skip/failure reason, duration, and, with
   TADM_HF_TRACE=1, how often the class under test was constructed / called / asked to generate.

At TADM_HF_K > 1, tests that classification.json marks ``k1_only`` (they compare tokens or logits with values
recorded from the base model) are skipped with that reason.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BASE_NAME = "DiffusionGemmaForBlockDiffusion"
MARKERS = ["generate", "torch_compile_test", "torch_export_test", "onnx_export_test", "executorch_export_test",
           "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "all_flash_attn_test", "bitsandbytes",
           "is_training_test", "is_tensor_parallel_test", "is_fsdp_test", "accelerate_tests", "timeout"]

_STATE = {"substitute": None, "base": None, "k": 1, "spec": None, "trace": {}, "current": None, "results": {},
          "classification": {}}


def _env_k() -> int:
    raw = os.environ.get("TADM_HF_K", "1")
    try:
        k = int(raw)
    except ValueError:
        raise pytest.UsageError(f"TADM_HF_K must be an integer >= 1, got {raw!r}") from None
    if k < 1:
        raise pytest.UsageError(f"TADM_HF_K must be an integer >= 1, got {raw!r}")
    return k


def _resolve(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(f"TADM_HF_CLASS must be 'package.module:name', got {spec!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _with_refresh_interval(cls: type, k: int) -> type:
    """A thin subclass of ``cls`` whose constructor defaults ``refresh_interval`` to ``k``. It keeps the name,
    qualified name and module of ``cls`` so that transformers' source heuristics (``_can_set_attn_implementation``
    / ``_can_set_experts_implementation`` read the class's module source) and name checks see ``cls``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("refresh_interval", k)
        cls.__init__(self, *args, **kwargs)

    functools.update_wrapper(__init__, cls.__init__)
    sub = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return sub


def _build_substitute(base: type, spec: str, k: int) -> type:
    obj = _resolve(spec)
    if isinstance(obj, type):
        return obj if k == 1 else _with_refresh_interval(obj, k)
    if callable(obj):
        made = obj(base, k)
        if not isinstance(made, type):
            raise pytest.UsageError(f"{spec}(base_cls, K) must return a class, got {type(made).__name__}")
        return made
    raise pytest.UsageError(f"TADM_HF_CLASS={spec!r} names neither a class nor a make_class(base_cls, K) callable")


def _install_trace(cls: type) -> None:
    """Count constructions, forward calls and generate calls of ``cls`` per test (wrappers keep signatures)."""

    def counting(name, fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if type(self) is cls or isinstance(self, cls):
                test = _STATE["current"]
                if test is not None:
                    counts = _STATE["trace"].setdefault(test, {})
                    counts[name] = counts.get(name, 0) + 1
            return fn(self, *args, **kwargs)

        return wrapper

    for name in ("__init__", "forward", "generate"):
        fn = cls.__dict__.get(name) or getattr(cls, name, None)
        if fn is not None:
            setattr(cls, name, counting(name, fn))


def pytest_configure(config):
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    _STATE["k"] = _env_k()
    classification = HERE / "classification.json"
    if classification.is_file():
        _STATE["classification"] = json.loads(classification.read_text())["tests"]
    spec = os.environ.get("TADM_HF_CLASS", "").strip()
    import transformers

    base = getattr(transformers, BASE_NAME)
    _STATE["base"] = base
    if spec:
        _STATE["spec"] = spec
        _STATE["substitute"] = _build_substitute(base, spec, _STATE["k"])
    elif _STATE["k"] != 1:
        raise pytest.UsageError("TADM_HF_K applies only with TADM_HF_CLASS (the base model has no refresh interval)")
    if os.environ.get("TADM_HF_TRACE") == "1":
        _install_trace(_STATE["substitute"] or base)


def _substitute_in(module) -> None:
    sub, base = _STATE["substitute"], _STATE["base"]
    if getattr(module, "_tadm_hf_substituted", False):
        return
    if getattr(module, BASE_NAME, None) is base:
        setattr(module, BASE_NAME, sub)
    for value in list(vars(module).values()):
        if isinstance(value, type):
            for attr in ("all_model_classes", "all_generative_model_classes"):
                classes = value.__dict__.get(attr)
                if isinstance(classes, (tuple, list)) and base in classes:
                    setattr(value, attr, tuple(sub if c is base else c for c in classes))
    module._tadm_hf_substituted = True


def pytest_collection_modifyitems(session, config, items):
    k = _STATE["k"]
    for item in items:
        module = getattr(item, "module", None)
        if _STATE["substitute"] is not None and module is not None:
            _substitute_in(module)
        if k > 1:
            entry = _STATE["classification"].get(_test_key(item))
            if entry and entry.get("k1_only"):
                item.add_marker(pytest.mark.skip(reason=f"K={k}: {entry.get('why', 'compares with the base model')}"))


def _test_key(item) -> str:
    cls = item.cls.__name__ if getattr(item, "cls", None) else ""
    return f"{Path(item.fspath).name}::{cls}::{item.name}"


def pytest_runtest_setup(item):
    _STATE["current"] = _test_key(item)


def pytest_runtest_teardown(item, nextitem):
    _STATE["current"] = None


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0][:300] if crash.message else ""
    return str(report.longrepr).splitlines()[-1][:300] if report.longrepr else ""


def pytest_runtest_logreport(report):
    key = report.nodeid.split("/")[-1]
    entry = _STATE["results"].setdefault(key, {"outcome": "passed", "reason": "", "duration": 0.0,
                                                "subtests_failed": 0})
    entry["duration"] += getattr(report, "duration", 0.0)
    if type(report).__name__ == "SubtestReport":
        if report.failed:
            entry["subtests_failed"] += 1
            if entry["outcome"] != "failed":
                entry["outcome"], entry["reason"] = "failed", "subtest: " + _reason(report)
        return
    if report.failed and entry["outcome"] != "failed":
        entry["outcome"], entry["reason"] = ("failed" if report.when == "call" else "error"), _reason(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"], entry["reason"] = "skipped", _reason(report)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("TADM_HF_SUMMARY")
    if not path:
        return
    import transformers
    import torch

    results = _STATE["results"]
    for key, calls in _STATE["trace"].items():
        if key in results:
            results[key]["trace"] = calls
    counts = {}
    for entry in results.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    sub = _STATE["substitute"]
    summary = {
        "class": _STATE["spec"] or f"transformers:{BASE_NAME}",
        "substituted": None if sub is None else f"{sub.__module__}.{sub.__qualname__}",
        "k": _STATE["k"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "counts": counts,
        "tests": dict(sorted(results.items())),
    }
    Path(path).write_text(json.dumps(summary, indent=1))
