"""tadm.anchorize / tadm.AnchoredModel: the anchor cache inside LLaDA, Dream, tadm's MDLM (and DiffusionGemma).

Acceptance (on the stand-ins, whose logits equal the reference implementations', test_family_backbones.py):
at K = 1 each family's own generation path (a loop calling forward as LLaDA's ``generate`` does; Dream's
``diffusion_generate``; tadm's samplers for MDLM) returns exactly the un-anchored model's tokens; at K = 2 and 3
the anchor layers run at refresh passes only (exact layer-call counts); and the in-model cache gives the same
tokens as tadm's stage-by-stage loop over the family's backbone adapter, with a fusion far from the identity: two
implementations of Algorithm 1 checked against each other.
"""

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import tadm
from tadm.posttrain import AnchoredModel, FusionSpec, anchorize, is_anchorized
from tadm.posttrain.architectures import ARCHITECTURES, Architecture, find_architecture, register_architecture
from tadm.posttrain.backbones import DreamBackbone
from tadm.sampling import build_sampler, generate
from tests.standins.dream import DreamModel, load_dream
from tests.standins.llada import LLaDAConfig, LLaDAModelLM, load_llada

from .anchorize_helpers import (DREAM, LLADA, dream_generate, dream_stage_by_stage, llada_generate,
                                llada_stage_by_stage, mdlm_generate, tiny_mdlm)
from .conftest import build_tiny_gemma, randomize

SPLIT = (1, 2)  # of the stand-ins' 4 layers: 1 shared, 2 anchor, 1 denoiser
FUSION = FusionSpec(rank=8, num_heads=2)


def _anchored(load, K=1, seed=3):
    """A stand-in anchorized with a random fusion (far from the identity, so a stale anchor is corrected)."""
    model = anchorize(load(), SPLIT, FUSION, refresh_interval=K)
    randomize(model.fusion, seed=seed, std=0.2)
    return model


def _calls(record):
    return record.layer_calls.shared, record.layer_calls.anchor, record.layer_calls.denoiser


def _expected_calls(T, K, split=SPLIT):
    return split[0] * T, split[1] * math.ceil(T / K), (4 - sum(split)) * T


# ------------------------------------------------------------------------------------------ the registry
def test_each_family_is_recognised(gemma):
    assert find_architecture(load_llada()).name == "llada"
    assert find_architecture(load_dream()).name == "dream"
    assert find_architecture(tiny_mdlm()).name == "mdlm"
    assert find_architecture(gemma).name == "diffusion-gemma"
    assert list(ARCHITECTURES) == ["diffusion-gemma", "llada", "dream", "mdlm"]


def test_a_model_of_another_class_is_recognised_by_config_and_layout():
    model = load_llada()
    model.__class__ = type("RenamedLLaDA", (nn.Module,), {"forward": LLaDAModelLM.forward})  # config.model_type: llada
    assert find_architecture(model).name == "llada"


def test_an_unknown_architecture_is_one_line_naming_the_supported_ones():
    with pytest.raises(TypeError) as info:
        anchorize(nn.Linear(4, 4))
    message = str(info.value)
    assert "\n" not in message and message.startswith("tadm cannot time-anchorize a Linear")
    for name in ("diffusion-gemma (DiffusionGemmaForBlockDiffusion)", "llada (LLaDAModelLM)", "dream (DreamModel)",
                 "mdlm (MDLM)", "register_architecture(Architecture(...))"):
        assert name in message
    with pytest.raises(TypeError, match="anchorize takes a loaded model .* got str"):
        anchorize("GSAI-ML/LLaDA-8B-Instruct")


def test_another_family_is_one_registered_entry():
    class OwnLM(nn.Module):  # Dream's layout under another name, unknown to tadm
        pass

    model = load_dream()
    model.__class__ = type("OwnLM", (OwnLM,), {"forward": DreamModel.forward})
    model.config.model_type = "own"
    with pytest.raises(TypeError, match="cannot time-anchorize a OwnLM"):
        anchorize(model)
    entry = Architecture(name="own", class_names=("OwnLM",), layers="model.layers", embedding="model.embed_tokens",
                         final_norm="model.norm", head="lm_head", token_argument="input_ids",
                         parameterisation="subs-shifted", prior="mask", backbone=DreamBackbone,
                         description="OwnLM()", rollout_sampler="dream-origin")
    register_architecture(entry)
    try:
        with pytest.raises(ValueError, match="an architecture named 'own' is registered already"):
            register_architecture(entry)
        anchorize(model, SPLIT, FUSION, refresh_interval=2)
        assert model.architecture is entry and model.stage_view().backbone.num_layers == 4
    finally:
        ARCHITECTURES.pop("own")


def test_the_entry_points_are_tadms_top_level_names_and_import_nothing():
    assert tadm.anchorize is anchorize and tadm.AnchoredModel is AnchoredModel and tadm.FusionSpec is FusionSpec
    code = "import sys, tadm; print(sorted(m for m in ('torch', 'tadm.posttrain') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------ the model
def test_the_model_is_converted_in_place_and_keeps_its_keys():
    model, plain = load_llada(), load_llada()
    out = anchorize(model, SPLIT, FUSION)
    assert out is model and isinstance(model, LLaDAModelLM) and is_anchorized(model)
    keys = set(model.state_dict())
    assert keys - set(plain.state_dict()) == {f"fusion.{k}" for k in model.fusion.state_dict()}
    assert model.layer_split.shared == 1 and model.layer_split.anchor == 2 and model.refresh_policy.fixed_interval == 1
    assert [p for p in model.parameters() if p.requires_grad] == list(model.fusion.parameters())
    assert model.fusion.up.weight.dtype == torch.float32


def test_questions_transformers_answers_from_the_class_module_get_the_bases_answer():
    class ReadsItsModule(LLaDAModelLM):  # as transformers decides whether attention implementations can be switched
        @classmethod
        def _can_set_attn_implementation(cls):
            return cls.__module__ == __name__

    model = ReadsItsModule(load_llada().config)
    anchorize(model, SPLIT)
    assert type(model).__module__ == "tadm.posttrain.anchorize" and type(model)._can_set_attn_implementation()


def test_defaults_are_the_papers_split_and_fusion_scaled_to_the_model():
    model = anchorize(load_llada())
    assert (model.layer_split.shared, model.layer_split.anchor, model.layer_split.denoiser) == (0, 3, 1)
    assert (model.fusion.rank, model.fusion.num_heads) == (4, 4)
    naive = anchorize(load_dream(), SPLIT, fusion=False, refresh_interval=2)
    assert naive.fusion is None and naive.anchor_cache.mode == "naive"
    assert naive.stage_view().fusion_mode == "naive"


def test_llada_k1_through_its_own_loop_is_the_unanchored_model():
    plain, model = load_llada(), _anchored(load_llada, K=1)
    for case in LLADA["cases"]:
        tokens = llada_generate(model, case)
        assert tokens.tolist() == case["tokens"] == llada_generate(plain, case).tolist()
    assert model.anchor_cache.record.layer_calls.anchor == 2 * sum(c["steps"] for c in LLADA["cases"])


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("index", [0, 5, 18, 27])  # low-confidence / random, one block / blocks, padded or not
def test_llada_in_model_cache_equals_the_stage_by_stage_loop(K, index):
    model, case = _anchored(load_llada, K=K), LLADA["cases"][index]
    with model.anchor_cache.generation() as record:
        tokens = llada_generate(model, case)
    assert _calls(record) == _expected_calls(case["steps"], K)
    assert record.refresh_steps == [list(range(0, case["steps"], K))]  # passes n that refreshed
    assert tokens.tolist() == llada_stage_by_stage(model.stage_view(), case, K).sequences.tolist()


@pytest.mark.slow
def test_llada_in_model_cache_equals_the_stage_by_stage_loop_on_every_case():
    model, view, differs = _anchored(load_llada), None, 0
    view = model.stage_view()
    for K in (2, 3):
        model.refresh_policy = K
        for case in LLADA["cases"]:
            with model.anchor_cache.generation() as record:
                tokens = llada_generate(model, case)
            assert _calls(record) == _expected_calls(case["steps"], K)
            assert tokens.tolist() == llada_stage_by_stage(view, case, K).sequences.tolist()
            differs += tokens.tolist() != case["tokens"]
    assert differs > len(LLADA["cases"])  # the stale anchor changes most generations: the check is not vacuous


def test_consecutive_generations_never_share_an_anchor():
    model = _anchored(load_llada, K=3)
    first, second = LLADA["cases"][0], LLADA["cases"][1]  # same shape, another seed
    alone = llada_generate(model, second).tolist()
    model.anchor_cache.start_record()
    assert llada_generate(model, first).tolist() != alone
    assert llada_generate(model, second).tolist() == alone  # a new canvas is detected: the cache starts afresh
    assert model.anchor_cache.finish_record().refresh_steps == [[0, 3, 6], [0, 3, 6]]
    # an explicit reset restarts the step count in the middle of a loop
    model.anchor_cache.start_record()
    x = torch.full((2, 6), 60)
    with torch.no_grad():
        model(x)
        model(x)
        model.anchor_cache.reset()
        model(x)
    assert model.anchor_cache.finish_record().refresh_steps == [[0], [0]]


def test_a_copy_runs_its_own_cache():
    model = _anchored(load_llada, K=3)
    twin = copy.deepcopy(model)
    case = LLADA["cases"][2]
    assert llada_generate(twin, case).tolist() == llada_generate(model, case).tolist()
    assert twin.anchor_cache is not model.anchor_cache and twin.anchor_cache.fusion is twin.fusion


def test_dream_k1_through_diffusion_generate_is_the_unanchored_model():
    plain, model = load_dream(), _anchored(load_dream, K=1)
    for case in DREAM["cases"]:
        tokens = dream_generate(model, case)
        assert tokens.tolist() == case["tokens"] == dream_generate(plain, case).tolist()
        assert model.last_generation.layer_calls.anchor == 2 * case["steps"]


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("index", [0, 13, 30, 52, 70])  # origin, maskgit_plus, topk_margin, entropy; padded or not
def test_dream_in_model_cache_equals_the_stage_by_stage_loop(K, index):
    model, case = _anchored(load_dream, K=K), DREAM["cases"][index]
    tokens = dream_generate(model, case)
    record = model.last_generation  # diffusion_generate starts a new generation and records it
    assert _calls(record) == _expected_calls(case["steps"], K)
    assert record.refresh_steps == [[case["steps"] - n for n in range(0, case["steps"], K)]]  # i, from steps=
    assert tokens.tolist() == dream_stage_by_stage(model.stage_view(), case, K).sequences.tolist()


@pytest.mark.slow
def test_dream_in_model_cache_equals_the_stage_by_stage_loop_on_every_case():
    model, differs = _anchored(load_dream), 0
    view = model.stage_view()
    for K in (2, 3):
        model.refresh_policy = K
        for case in DREAM["cases"]:
            tokens = dream_generate(model, case)
            assert _calls(model.last_generation) == _expected_calls(case["steps"], K)
            assert tokens.tolist() == dream_stage_by_stage(view, case, K).sequences.tolist()
            differs += tokens.tolist() != case["tokens"]
    assert differs > len(DREAM["cases"])


def test_naive_reuse_in_the_model_equals_naive_reuse_stage_by_stage():
    model = anchorize(load_dream(), SPLIT, FUSION, refresh_interval=3, naive=True)
    randomize(model.fusion, seed=3, std=0.2)
    case = DREAM["cases"][13]
    view = model.stage_view()
    assert view.fusion_mode == "naive"
    assert dream_generate(model, case).tolist() == dream_stage_by_stage(view, case, 3).sequences.tolist()


def test_mdlm_k1_through_tadms_samplers_is_the_unanchored_model():
    plain, model = tiny_mdlm(), anchorize(tiny_mdlm(), SPLIT, FUSION)
    randomize(model.fusion, seed=3, std=0.2)
    view = model.stage_view()
    for name in ("mdlm", "remdm-cap"):
        options = dict(batch_size=3, seq_len=12, num_steps=8)
        a = generate(plain, name, generator=torch.Generator().manual_seed(5), **options)
        b = generate(view, name, generator=torch.Generator().manual_seed(5), **options)
        assert torch.equal(a.tokens, b.tokens)
    sampler = build_sampler("mdlm", view)
    own = mdlm_generate(model, sampler, batch_size=3, seq_len=12, num_steps=8, seed=5)
    assert torch.equal(own, generate(plain, "mdlm", batch_size=3, seq_len=12, num_steps=8,
                                     generator=torch.Generator().manual_seed(5)).tokens)


@pytest.mark.parametrize("K", [2, 3])
def test_mdlm_in_model_cache_equals_the_stage_by_stage_loop(K):
    model = anchorize(tiny_mdlm(), SPLIT, FUSION, refresh_interval=K)
    randomize(model.fusion, seed=3, std=0.2)
    view, T = model.stage_view(), 8
    stage = generate(view, "mdlm", batch_size=3, seq_len=12, num_steps=T, refresh_interval=K,
                     generator=torch.Generator().manual_seed(5))
    assert (stage.layer_calls.shared, stage.layer_calls.anchor, stage.layer_calls.denoiser) == _expected_calls(T, K)
    with model.anchor_cache.generation() as record:
        own = mdlm_generate(model, build_sampler("mdlm", view), batch_size=3, seq_len=12, num_steps=T, seed=5)
    assert _calls(record) == _expected_calls(T, K)
    assert torch.equal(own, stage.tokens)
    fresh = generate(view, "mdlm", batch_size=3, seq_len=12, num_steps=T, generator=torch.Generator().manual_seed(5))
    assert not torch.equal(fresh.tokens, stage.tokens)


def test_tadms_samplers_on_the_anchorized_mdlm_itself_are_refused():
    model = anchorize(tiny_mdlm(), SPLIT, FUSION, refresh_interval=2)
    with pytest.raises(TypeError, match=r"would bypass its anchor cache; .* pass model.stage_view\(\)"):
        generate(model, "mdlm", batch_size=1, seq_len=4, num_steps=2)


# ------------------------------------------------------------------------------------------ adapters
def test_an_adapter_saved_from_the_model_loads_into_a_fresh_one(tmp_path):
    model = _anchored(load_llada, K=3)
    model.save_pretrained(tmp_path / "adapter", base_model="GSAI-ML/LLaDA-8B-Instruct")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["backbone"], config["base_model"], config["num_layers"]) == ("llada", "GSAI-ML/LLaDA-8B-Instruct", 4)
    assert config["refresh_policy"] == {"policy": "fixed", "skip_unchanged": False, "interval": 3} and (tmp_path / "adapter" / "README.md").is_file()
    loaded = AnchoredModel.from_pretrained(load_llada(), tmp_path / "adapter")
    assert loaded.refresh_policy.fixed_interval == 3  # the saved policy, unless one is given
    for name, tensor in model.fusion.state_dict().items():
        assert torch.equal(loaded.fusion.state_dict()[name], tensor)
    case = LLADA["cases"][5]
    assert llada_generate(loaded, case).tolist() == llada_generate(model, case).tolist()
    at_two = AnchoredModel.from_pretrained(load_llada(), tmp_path / "adapter", refresh_interval=2)
    assert at_two.refresh_policy.fixed_interval == 2


def test_a_diffusion_gemma_is_converted_by_its_own_class(tmp_path):
    from tadm.posttrain.hf_model import TimeAnchoredDiffusionGemma

    gemma = build_tiny_gemma()
    model = anchorize(gemma, (1, 3), FUSION, refresh_interval=2)
    assert model is gemma and isinstance(model, TimeAnchoredDiffusionGemma) and is_anchorized(model)
    assert model.layer_split.anchor == 3 and model.refresh_policy.fixed_interval == 2 and model.fusion.rank == 8
    model.save_pretrained(tmp_path / "gemma-adapter")
    loaded = AnchoredModel.from_pretrained(build_tiny_gemma(), tmp_path / "gemma-adapter")
    assert isinstance(loaded, TimeAnchoredDiffusionGemma) and loaded.refresh_policy.fixed_interval == 2
    with pytest.raises(ValueError, match="trained for a 'diffusion-gemma' model; this LLaDAModelLM is a 'llada' model"):
        AnchoredModel.from_pretrained(load_llada(), tmp_path / "gemma-adapter")


# ------------------------------------------------------------------------------------------ bad input
def _untouched(model, reference):
    assert type(model) is type(reference) and not is_anchorized(model) and "fusion" not in model.__dict__
    assert "fusion" not in model._modules
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert all(p.requires_grad for p in model.parameters()) and model.training == reference.training


def test_bad_input_is_one_line_and_leaves_the_model_as_it_was(tmp_path):
    dream_adapter = _anchored(load_dream).save_pretrained(tmp_path / "dream")
    wide = LLaDAModelLM(LLaDAConfig(n_layers=5))
    cases = [
        (lambda m: anchorize(m, (3, 2)), ValueError,
         "split shared_layers + anchor_layers = 3 + 2 = 5 exceeds the backbone's 4 layers"),
        (lambda m: anchorize(m, (1, 0)), ValueError, "split anchor_layers must be >= 1"),
        (lambda m: anchorize(m, "1/2"), ValueError, "split must be (shared, anchor) layer counts"),
        (lambda m: anchorize(m, SPLIT, refresh_interval=0), ValueError, "refresh interval"),
        (lambda m: anchorize(m, SPLIT, fusion=8), ValueError, "fusion must be a FusionSpec"),
        (lambda m: AnchoredModel.from_pretrained(m, dream_adapter), ValueError,
         "was trained for a 'dream' model; this LLaDAModelLM is a 'llada' model"),
        (lambda m: AnchoredModel.from_pretrained(m, tmp_path / "none"), FileNotFoundError, "does not exist"),
        (lambda m: AnchoredModel.from_pretrained(m, dream_adapter, refresh_interval=0), ValueError,
         "refresh interval"),
    ]
    for convert, error, message in cases:
        model, reference = load_llada().train(), load_llada().train()
        with pytest.raises(error) as info:
            convert(model)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
        _untouched(model, reference)
    llada_adapter = _anchored(load_llada).save_pretrained(tmp_path / "llada")
    with pytest.raises(ValueError, match="trained on a 4-layer llada of hidden size 32 .* this model has 5 layers"):
        AnchoredModel.from_pretrained(wide, llada_adapter)
    _untouched(wide, LLaDAModelLM(LLaDAConfig(n_layers=5)))
    model = anchorize(load_llada(), SPLIT)
    with pytest.raises(ValueError, match="is time-anchorized already"):
        anchorize(model)
    with pytest.raises(TypeError, match="AnchoredModel is not instantiated"):
        AnchoredModel()


@pytest.mark.parametrize("time_conditioning", [False, True])
def test_a_released_mdlm_checkpoint_is_anchorized_as_tadms_mdlm(time_conditioning):
    """The released MDLM layout (tests/fixtures/mdlm_owt, the reference DiT's logits within 1e-5) loads into tadm's
    MDLM, which anchorize recognises: K = 1 is the loaded model, K = 2 runs the anchor layers at refreshes only."""
    from pathlib import Path

    from tadm.nn import load_released_mdlm

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "mdlm_owt"
    load = lambda: load_released_mdlm(fixture, time_conditioning=time_conditioning or None).model.eval()  # noqa: E731
    plain, model = load(), anchorize(load(), (0, 1), FusionSpec(rank=8, num_heads=2))
    assert model.architecture.name == "mdlm" and model.time_conditioned == time_conditioning
    view = model.stage_view()
    options = dict(batch_size=2, seq_len=12, num_steps=8)
    assert torch.equal(generate(plain, "mdlm", generator=torch.Generator().manual_seed(3), **options).tokens,
                       generate(view, "mdlm", generator=torch.Generator().manual_seed(3), **options).tokens)
    cached = generate(view, "mdlm", refresh_interval=2, generator=torch.Generator().manual_seed(3), **options)
    assert (cached.layer_calls.shared, cached.layer_calls.anchor, cached.layer_calls.denoiser) == (0, 4, 8)
