"""LLaDA's and Dream's samplers run through tadm's loop reproduce the public implementations' tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tadm.posttrain.backbone import wrap_backbone
from tadm.posttrain.model import AnchoredBackbone, SplitSpec
from tadm.posttrain.sequence import generate_sequence
from tadm.sampling import build_sampler, generate
from tests.standins.dream import FIXTURE as DREAM_FIXTURE
from tests.standins.dream import load_dream
from tests.standins.llada import FIXTURE as LLADA_FIXTURE
from tests.standins.llada import load_llada

LLADA = json.loads((LLADA_FIXTURE / "generate.json").read_text())
DREAM = json.loads((DREAM_FIXTURE / "generate.json").read_text())


def case_id(case: dict) -> str:
    keys = ("alg", "remasking", "temperature", "top_p", "top_k", "alg_temp", "steps", "block_length", "attention_mask")
    return "-".join(f"{case[k]}" for k in keys if k in case)


@pytest.fixture(scope="module")
def llada():
    return AnchoredBackbone(wrap_backbone(load_llada()), SplitSpec(1, 2))


@pytest.fixture(scope="module")
def dream():
    return AnchoredBackbone(wrap_backbone(load_dream()), SplitSpec(1, 2))


def llada_run(model, case, refresh_interval=1):
    sampler = build_sampler("llada", model, block_length=case["block_length"], remasking=case["remasking"],
                            temperature=case["temperature"])
    mask = torch.tensor(LLADA["prompt_attention_mask"]) if case["attention_mask"] else None
    return generate_sequence(model, sampler, torch.tensor(LLADA["prompt"]), gen_length=case["gen_length"],
                             num_steps=case["steps"], attention_mask=mask, refresh_interval=refresh_interval,
                             generator=torch.Generator().manual_seed(case["seed"]))


def dream_run(model, case, refresh_interval=1):
    sampler = build_sampler("dream-" + case["alg"].replace("_", "-"), model, temperature=case["temperature"],
                            top_p=case["top_p"], top_k=case["top_k"], alg_temp=case["alg_temp"], eps=case["eps"])
    mask = torch.tensor(DREAM["prompt_attention_mask"]) if case["attention_mask"] else None
    return generate_sequence(model, sampler, torch.tensor(DREAM["prompt"]), gen_length=case["max_new_tokens"],
                             num_steps=case["steps"], attention_mask=mask, refresh_interval=refresh_interval,
                             generator=torch.Generator().manual_seed(case["seed"]))


@pytest.mark.parametrize("case", LLADA["cases"], ids=case_id)
def test_llada_sampler_gives_the_tokens_of_llada_generate(llada, case):
    assert llada_run(llada, case).sequences.tolist() == case["tokens"]


@pytest.mark.parametrize("case", DREAM["cases"], ids=case_id)
def test_dream_samplers_give_the_tokens_of_diffusion_generate(dream, case):
    assert dream_run(dream, case).sequences.tolist() == case["tokens"]


def test_the_fixtures_cover_every_setting():
    llada = {(c["remasking"], c["temperature"] > 0, c["block_length"] < c["gen_length"], c["attention_mask"])
             for c in LLADA["cases"]}
    assert len(llada) == 16
    algs = {(c["alg"], c["temperature"] > 0, c["top_p"] is not None, c["top_k"] is not None) for c in DREAM["cases"]}
    assert {a for a, *_ in algs} == {"origin", "maskgit_plus", "topk_margin", "entropy"}
    assert {c["alg"] for c in DREAM["cases"] if c["alg_temp"]} == {"maskgit_plus", "topk_margin", "entropy"}
    # the prompts are kept and every generated position is decoded
    for data in (LLADA, DREAM):
        for case in data["cases"]:
            tokens = torch.tensor(case["tokens"])
            assert tokens[:, :6].tolist() == data["prompt"]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("K", [2, 3])
def test_anchor_layers_run_only_at_refresh_steps(family, K, llada, dream):
    model, run, case = ((llada, llada_run, LLADA["cases"][2]) if family == "llada"
                        else (dream, dream_run, DREAM["cases"][8]))
    out = run(model, case, refresh_interval=K)
    T, split = case["steps"], model.layer_split
    refreshes = math.ceil(T / K)
    calls = out.layer_calls
    assert (calls.shared, calls.anchor, calls.denoiser) == (split.shared * T, split.anchor * refreshes, split.denoiser * T)
    assert calls.anchor_refreshes == refreshes
    assert out.refresh_steps == [T - n for n in range(0, T, K)]
    assert out.new_tokens.shape[1] == (case.get("gen_length") or case["max_new_tokens"])
    fresh = run(model, case, refresh_interval=1).layer_calls
    assert fresh.anchor == split.anchor * T


def test_unconditional_generation_through_tadm_generate(llada):
    out = generate(llada, "llada", batch_size=2, seq_len=8, num_steps=4, refresh_interval=2,
                   generator=torch.Generator().manual_seed(0))
    assert (out.tokens != llada.mask_token_id).all()
    assert out.layer_calls.anchor == llada.layer_split.anchor * 2


def test_the_same_seed_gives_the_same_tokens(dream):
    case = DREAM["cases"][3]
    assert torch.equal(dream_run(dream, case).sequences, dream_run(dream, case).sequences)


def test_bad_prompts_are_one_line_errors(llada):
    sampler = build_sampler("llada", llada)
    with pytest.raises(ValueError, match="prompt ids must be a \\(B, P\\) LongTensor"):
        generate_sequence(llada, sampler, torch.zeros(2, 3), gen_length=4, num_steps=4)
    with pytest.raises(ValueError, match=r"attention_mask \(2, 2\) must match the prompt ids \(2, 3\)"):
        generate_sequence(llada, sampler, torch.zeros(2, 3, dtype=torch.long), gen_length=4, num_steps=4,
                          attention_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="gen_length must be an integer >= 1"):
        generate_sequence(llada, sampler, torch.zeros(2, 3, dtype=torch.long), gen_length=0, num_steps=4)
    with pytest.raises(ValueError, match="not a multiple of block_length=3"):
        generate_sequence(llada, build_sampler("llada", llada, block_length=3), torch.zeros(1, 3, dtype=torch.long),
                          gen_length=4, num_steps=4)
    with pytest.raises(ValueError, match="T = 3 steps do not divide evenly over 2 blocks"):
        generate_sequence(llada, build_sampler("llada", llada, block_length=2), torch.zeros(1, 3, dtype=torch.long),
                          gen_length=4, num_steps=3)
