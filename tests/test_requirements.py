"""The package's requirements are lower bounds that GPU environments meet; CI's exact pins live in constraints.txt."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": [Requirement(r) for r in project["dependencies"]]}
    for extra, reqs in project["optional-dependencies"].items():
        groups[extra] = [Requirement(r) for r in reqs if not r.startswith("tadm[")]
    return groups


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower().replace("_", "-")] = spec.version
    return pins


@pytest.mark.parametrize("package, version", [("torch", "2.11.0"), ("transformers", "5.17.0")])
def test_a_typical_gpu_environment_satisfies_every_requirement(package, version):
    """torch 2.11.0 (CUDA 13) and transformers 5.17.0: what an H100 environment without network has."""
    found = [(extra, req) for extra, reqs in _requirements().items() for req in reqs if req.name == package]
    assert found, f"{package} is not a requirement"
    for extra, req in found:
        assert req.specifier.contains(Version(version)), f"{req} (extra {extra or 'core'}) excludes {version}"


def test_requirements_are_ranges_not_pins():
    for extra, reqs in _requirements().items():
        for req in reqs:
            assert not any(s.operator in ("==", "===") for s in req.specifier), f"{req} in {extra or 'core'} is pinned"
            assert any(s.operator == ">=" for s in req.specifier), f"{req} in {extra or 'core'} has no lower bound"


def test_ci_pins_live_in_constraints_and_satisfy_the_requirements():
    pins = _pins(ROOT / "constraints.txt")
    assert pins["torch"] == "2.13.0" and "transformers" in pins
    for extra, reqs in _requirements().items():
        for req in reqs:
            name = req.name.lower().replace("_", "-")
            assert name in pins, f"{req.name} (extra {extra or 'core'}) is not pinned in constraints.txt"
            assert req.specifier.contains(Version(pins[name])), f"constraints.txt pins {name}=={pins[name]}: {req}"
    assert "-c constraints.txt" in (ROOT / ".ci" / "run").read_text()


# diffusers 0.42 requires huggingface_hub >= 1.32, above tadm's bound (1.5): pip cannot install both at once.
LEFT_OUT_OF_THE_LOWEST_RUN = {"diffusers"}


def test_the_lowest_run_installs_every_extra_but_those_left_out():
    """CI's second run installs each extra whose lower bounds fit together with the core's (and not test, which
    pulls diffusers back in)."""
    run = (ROOT / ".ci" / "run").read_text()
    (line,) = [line for line in run.splitlines() if "-c constraints-lowest.txt" in line]
    installed = set(line.split("-e '.[", 1)[1].split("]'", 1)[0].split(","))
    extras = set(_requirements()) - {"", "test"}
    assert installed == extras - LEFT_OUT_OF_THE_LOWEST_RUN


def test_the_lowest_versions_are_the_lower_bounds():
    """constraints-lowest.txt installs each requirement at its lower bound (the versions verified together)."""
    lowest = _pins(ROOT / "constraints-lowest.txt")
    for extra, reqs in _requirements().items():
        if extra in LEFT_OUT_OF_THE_LOWEST_RUN:
            assert all(req.name not in lowest for req in reqs), f"constraints-lowest.txt pins the {extra} extra"
            continue
        for req in reqs:
            name = req.name.lower().replace("_", "-")
            bound = next(Version(s.version) for s in req.specifier if s.operator == ">=")
            assert Version(lowest[name]) == bound, f"{name}: constraints-lowest.txt has {lowest[name]}, not {req}'s bound"
