"""Golden tokens of the time-anchored DiffusionGemma on a tiny random base with a randomised fusion.

``python -m tests.posttrain.anchored_gemma_golden`` (from the repository root) writes the base, the adapter
and ``tokens.json`` under ``tests/fixtures/anchored_gemma/``; ``test_anchored_gemma_golden.py`` checks that
generation reproduces every stored sequence. The tokens were first produced by tadm's own block loop
(``generate_blocks``), before the anchor cache moved into the model; the base and adapter weights are stored
so that the tokens do not depend on how a transformers release initialises a model.

Every case seeds torch's global generator (as the base's own ``generate`` draws from it) and generates after a
random prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "anchored_gemma"
V = 128
SPLIT = (1, 3)  # shared, anchor layers of the tiny model's 6
FIXED_STEPS = dict(stability_threshold=None, confidence_threshold=None, eos_token_id=None)


def prompt(seed: int, batch: int, length: int = 5, left_pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, V, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if left_pad:
        mask[0, :2] = 0
    return ids, mask


def _cases() -> list[dict]:
    cases = []
    refresh = {"K1": dict(refresh_interval=1), "K2": dict(refresh_interval=2), "K3": dict(refresh_interval=3),
               "K4": dict(refresh_interval=4), "adaptive": dict(refresh_policy="adaptive:tau=0.3:max_interval=4"),
               "naive-K2": dict(refresh_interval=2, naive=True), "naive-K3": dict(refresh_interval=3, naive=True)}
    settings = {
        "fixed-steps": dict(max_new_tokens=16, max_denoising_steps=6, **FIXED_STEPS),
        "model-defaults": dict(max_new_tokens=20, max_denoising_steps=6),  # adaptive stopping on
        "eos-pad": dict(max_new_tokens=24, max_denoising_steps=5, t_min=0.2, t_max=1.0, stability_threshold=0,
                        confidence_threshold=1.0, eos_token_id=[18, 5], pad_token_id=0),
    }
    for setting_name, setting in settings.items():
        for refresh_name, policy in refresh.items():
            for batch, prompt_seed, left_pad in ((1, 0, False), (2, 1, True)):
                for seed in (7, 11):
                    if setting_name != "fixed-steps" and seed == 11:
                        continue
                    cases.append(dict(name=f"{setting_name}/{refresh_name}/B{batch}/seed{seed}", batch=batch,
                                      prompt_seed=prompt_seed, left_pad=left_pad, seed=seed, settings=setting,
                                      refresh=policy))
    return cases


def main() -> None:
    # deferred: the fixture is written once, by hand, with the tadm version named in the module docstring
    from tests.posttrain.conftest import build_tiny_gemma, randomize
    from tadm.posttrain import AnchoredBackbone, DiffusionGemmaBackbone, FusionSpec, SplitSpec, save_adapter
    from tadm.posttrain.hf_model import TimeAnchoredDiffusionGemma

    FIXTURE.mkdir(parents=True, exist_ok=True)
    gemma = build_tiny_gemma()
    gemma.save_pretrained(FIXTURE / "base")
    split = AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(*SPLIT), FusionSpec(rank=8, num_heads=2))
    randomize(split.fusion, seed=1, std=0.5)
    save_adapter(FIXTURE / "adapter", split, base_model="tests/fixtures/anchored_gemma/base")
    model = TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=FIXTURE / "adapter")
    records = []
    for case in _cases():
        ids, mask = prompt(case["prompt_seed"], case["batch"], left_pad=case["left_pad"])
        torch.manual_seed(case["seed"])
        out = model.generate(ids, attention_mask=mask, **case["refresh"], **case["settings"])
        calls = model.last_generation.layer_calls
        records.append({**case, "sequences": out.sequences.tolist(),
                        "tokens_per_forward": out.tokens_per_forward.tolist(),
                        "anchor_refreshes": calls.anchor_refreshes, "denoiser_calls": calls.denoiser_calls})
    (FIXTURE / "tokens.json").write_text(json.dumps({"split": SPLIT, "cases": records}, indent=1) + "\n")
    print(f"{len(records)} cases written to {FIXTURE / 'tokens.json'}")


if __name__ == "__main__":
    main()
