"""The time-anchored DiffusionGemma reproduces the stored golden tokens (``anchored_gemma_golden.py``).

56 cases: K = 1, 2, 3, 4, adaptive refresh and naive reuse at K = 2 and 3; batch 1 and 2 (left padded);
every step, adaptive stopping, and EOS with padding; two seeds. Layer calls are checked as well.
"""

import json

import pytest
import torch

from tadm.posttrain.hf_model import TimeAnchoredDiffusionGemma

from .anchored_gemma_golden import FIXTURE, prompt

GOLDEN = json.loads((FIXTURE / "tokens.json").read_text())


@pytest.fixture(scope="module")
def model():
    return TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=FIXTURE / "adapter")


def test_the_golden_cases_differ_between_refresh_intervals():
    """The fixture can catch a wrong cache: within a setting, K = 1, 2, 3 and naive reuse give different tokens."""
    by_group = {}
    for case in GOLDEN["cases"]:
        setting, refresh, batch, seed = case["name"].split("/")
        by_group.setdefault((setting, batch, seed), {})[refresh] = case["sequences"]
    for group in by_group.values():
        assert len({json.dumps(group[r]) for r in ("K1", "K2", "K3", "naive-K2", "naive-K3")}) == 5


@pytest.mark.slow
@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_generation_reproduces_the_golden_tokens(model, case):
    ids, mask = prompt(case["prompt_seed"], case["batch"], left_pad=case["left_pad"])
    torch.manual_seed(case["seed"])
    out = model.generate(ids, attention_mask=mask, **case["refresh"], **case["settings"])
    assert out.sequences.tolist() == case["sequences"]
    torch.testing.assert_close(out.tokens_per_forward, torch.tensor(case["tokens_per_forward"]))
    calls = model.last_generation.layer_calls
    assert (calls.anchor_refreshes, calls.denoiser_calls) == (case["anchor_refreshes"], case["denoiser_calls"])
