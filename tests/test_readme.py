"""The README's Python examples run, in order, in one namespace (as a reader would paste them).

``runs/quickstart/final`` (what the README's first command trains) is a tiny saved model with a
tokenizer here, and the likelihood example reads 2 blocks instead of 64. Three examples need what a
test cannot have and are not run: the DiffusionGemma one and the one time-anchorizing LLaDA, Dream and
DiffusionGemma (checkpoints from the Hub), and the judge one (an OpenAI-compatible server); the count of
skipped examples is pinned so a new one is not skipped by accident.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.eval.test_evaluator import tiny_diffusion, tiny_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS_THE_HUB_OR_A_SERVER = ("google/diffusiongemma", "make_judge_client")


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_readme_python_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "runs" / "quickstart" / "final"
    tiny_diffusion("tadm", max_seq_len=128).save_pretrained(final)
    tiny_tokenizer().save(final)
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks()
    runnable = [b for b in blocks if not any(marker in b for marker in NEEDS_THE_HUB_OR_A_SERVER)]
    assert len(blocks) - len(runnable) == 3 and len(runnable) >= 4
    namespace: dict = {}
    for block in runnable:
        exec(compile(block.replace("max_blocks=64", "max_blocks=2"), str(README), "exec"), namespace)
    # what the examples say they give
    assert tuple(namespace["out"].tokens.shape) == (2, 32)
    assert namespace["out"].layer_calls.total > 0
    curve = namespace["curve"]
    assert set(curve.curves) == {32, 128} and len(curve.curves[32]) == 8
