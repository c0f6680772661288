"""Every Python example of the README runs as a script of its own, as a reader would save and run it.

``runs/quickstart/final`` (what the README's first command trains) is a tiny saved model with its
tokenizer here, and the likelihood example reads 2 blocks instead of 64. Two examples need what a
test cannot have and are not run: the DiffusionGemma one (a 26B base from the Hub) and the judge
one (an OpenAI-compatible server); the count of skipped examples is pinned so a new one is not
skipped by accident.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.eval.test_evaluator import tiny_diffusion, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NEEDS_THE_HUB_OR_A_SERVER = ("google/diffusiongemma", "make_judge_client")


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


RUNNABLE = [b for b in python_blocks() if not any(marker in b for marker in NEEDS_THE_HUB_OR_A_SERVER)]
# what an example prints, by a line of it: sampled text starts with its prompt, numbers and configs are shown
PRINTS = {
    "prefix=prompt": lambda out: out.count("The jury said") == 2 and "LayerCallCounter(shared=0, anchor=" in out,
    "stale_anchor_nelbo": lambda out: re.search(r"^\{1: [\d.]+, 2: [\d.]+, 4: [\d.]+, 8: [\d.]+\}$", out, re.M),
    "AdaptiveRefresh(": lambda out: out.startswith("adaptive tau=0.2,<=16 ") and "\nschedule(4) 72 [64, 56, 40, 16] " in out,
    "sampler_config(": lambda out: out.startswith("ReMDMSamplerConfig(strategy='loop', eta=0.02,"),
}


def test_every_example_is_run_but_those_that_need_the_hub_or_a_server():
    assert len(python_blocks()) - len(RUNNABLE) == 2 and len(RUNNABLE) >= 4
    assert [sum(marker in block for marker in PRINTS) for block in RUNNABLE] == [1] * len(RUNNABLE)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder holding ``runs/quickstart/final``: a tiny TADM saved with its tokenizer."""
    root = tmp_path_factory.mktemp("readme")
    tiny_diffusion("tadm", max_seq_len=128).save_pretrained(root / "runs" / "quickstart" / "final",
                                                            tokenizer=tiny_tokenizer())
    return root


@pytest.mark.slow
@pytest.mark.parametrize("number", range(len(RUNNABLE)))
def test_a_readme_example_runs_as_its_own_script(workdir: Path, number: int) -> None:
    script = workdir / f"example_{number}.py"
    script.write_text(RUNNABLE[number].replace("max_blocks=64", "max_blocks=2"), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, script.name], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "<|endoftext|>" not in out  # decoded text ends before the end-of-text token
    marker = next(marker for marker in PRINTS if marker in RUNNABLE[number])
    assert PRINTS[marker](out), out[-2000:]
