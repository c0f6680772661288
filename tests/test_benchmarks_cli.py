"""The benchmark scripts' arguments: bad values end in one line, before any model is built; and their arithmetic."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tadm.nn import tadm_tiny

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """A benchmark script as a module (as tests/test_gpu_campaign.py loads gpu_campaign.py)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_profile_sampling_divides_by_the_steps_the_loop_ran(monkeypatch):
    ps = load("profile_sampling")
    clock = iter([0.0, 1.0])  # the profiled run takes one second of wall time
    monkeypatch.setattr(ps, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    args = argparse.Namespace(sampler="remdm-loop", steps=4, batch_size=1, length=8, refresh=1, profile_steps=16,
                              dtype="float32")
    model = tadm_tiny().eval()
    assert ps.run_steps(model, args, ps.torch.device("cpu"), full_output=False) == 4
    clock = iter([0.0, 1.0])
    times = ps.breakdown(model, args, ps.torch.device("cpu"), full_output=False)
    assert times["total (wall)"] == pytest.approx(1000.0 / 4)  # 4 steps ran, not --profile-steps 16
