"""LLaDA and Dream: the stand-ins against the public implementations' logits, and their backbone adapters."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tadm.nn.dit import NEG_INF
from tadm.posttrain.backbone import BACKBONES, StackContext, load_backbone, wrap_backbone
from tadm.posttrain.backbones import DreamBackbone, LLaDABackbone
from tadm.posttrain.backbones.dream import shift_logits
from tadm.posttrain.model import AnchoredBackbone, SplitSpec
from tests.standins.dream import FIXTURE as DREAM_FIXTURE
from tests.standins.dream import load_dream
from tests.standins.llada import FIXTURE as LLADA_FIXTURE
from tests.standins.llada import load_llada

FAMILIES = {"llada": (load_llada, LLADA_FIXTURE, LLaDABackbone), "dream": (load_dream, DREAM_FIXTURE, DreamBackbone)}


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FAMILIES[name][1] / "logits.safetensors"))


def own_logits(name: str, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None,
               ref: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The stand-in's forward, called as the reference's generation calls it."""
    with torch.no_grad():
        if name == "llada":
            return model(ids, attention_mask=mask).logits
        if mask is None:
            return model(ids).logits
        return model(ids, ref["attention_mask_4d"], ref["position_ids"]).logits


@pytest.mark.parametrize("name", FAMILIES)
def test_stand_in_logits_equal_the_reference_implementation(name):
    model, ref = FAMILIES[name][0](), reference(name)
    plain = own_logits(name, model, ref["input_ids"])
    padded = own_logits(name, model, ref["input_ids"], ref["attention_mask"], ref)
    assert (plain - ref["logits"]).abs().max() <= 1e-5
    assert (padded - ref["logits_attention_mask"]).abs().max() <= 1e-5
    # the padding mask changes the logits: the fixture would catch a stand-in that ignored it
    assert (padded - plain).abs().max() > 1e-2


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("split", [(0, 4), (1, 2), (2, 1), (1, 3)])
@pytest.mark.parametrize("padded", [False, True])
def test_anchored_backbone_at_a_fresh_anchor_gives_the_models_own_logits(name, split, padded):
    model, ref = FAMILIES[name][0](), reference(name)
    anchored = AnchoredBackbone(wrap_backbone(model), SplitSpec(*split))
    mask = ref["attention_mask"] if padded else None
    own = own_logits(name, model, ref["input_ids"], mask, ref)
    if name == "dream":
        own = shift_logits(own)  # the adapter aligns position i's logits with token i, as diffusion_generate does
    with torch.no_grad():
        out = anchored(ref["input_ids"], StackContext(attention_mask=mask))
    assert out.dtype == torch.float32
    assert torch.equal(out, own)


def test_dream_logits_are_shifted_right_by_one_position():
    logits = torch.arange(12.0).view(1, 3, 4)
    shifted = shift_logits(logits)
    assert torch.equal(shifted[0, 0], logits[0, 0]) and torch.equal(shifted[0, 1:], logits[0, :2])


@pytest.mark.parametrize("name", FAMILIES)
def test_adapter_attributes_and_subs_output(name):
    backbone = wrap_backbone(FAMILIES[name][0]())
    assert isinstance(backbone, FAMILIES[name][2])
    assert (backbone.num_layers, backbone.hidden_size, backbone.vocab_size, backbone.mask_token_id) == (4, 32, 64, 60)
    assert backbone.prior == "mask" and not backbone.supports_self_conditioning and not backbone.time_conditioned
    assert backbone.dtype == torch.float32
    assert wrap_backbone(backbone) is backbone
    z = torch.tensor([[3, 60, 7, 60]])
    log_probs = backbone.log_probs(torch.randn(1, 4, 64), z)
    assert (log_probs[..., 60] <= NEG_INF).all()  # the mask is never predicted
    assert log_probs[0, 0, 3] == 0 and log_probs[0, 2, 7] == 0  # unmasked positions are carried over
    assert torch.allclose(log_probs[0, 1].exp().sum(), torch.tensor(1.0))


@pytest.mark.parametrize("name", FAMILIES)
def test_mask_id_can_be_set_and_is_checked(name):
    model = FAMILIES[name][0]()
    assert FAMILIES[name][2](model, mask_token_id=5).mask_token_id == 5
    with pytest.raises(ValueError, match="mask_token_id must be an id in 0..63, got 64"):
        FAMILIES[name][2](model, mask_token_id=64)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_backbone_stays_frozen_and_loading_by_path_is_refused(name):
    """The wrapped model is frozen and stays in eval mode; a path would need the checkpoint's own code, so it is refused."""
    backbone = FAMILIES[name][2](FAMILIES[name][0]())
    assert not any(p.requires_grad for p in backbone.parameters())
    assert not backbone.train().training and not backbone.model.training
    family = {"llada": "LLaDA", "dream": "Dream"}[name]
    with pytest.raises(ValueError, match=f"does not run code shipped with a checkpoint: load {family} yourself"):
        FAMILIES[name][2].from_pretrained("some/checkpoint")


@pytest.mark.parametrize("name", FAMILIES)
def test_bad_passes_are_one_line_errors(name):
    backbone = wrap_backbone(FAMILIES[name][0]())
    with pytest.raises(ValueError, match=r"attention_mask \(2, 5\) must be \(B, L\) = \(2, 4\)"):
        backbone.prepare(2, 4, torch.device("cpu"), StackContext(attention_mask=torch.ones(2, 5)))
    with pytest.raises(ValueError, match="put the prompt in the canvas"):
        backbone.prepare(2, 4, torch.device("cpu"), StackContext(prompt=object()))
    with pytest.raises(ValueError, match="no self-conditioning"):
        backbone.prepare(2, 4, torch.device("cpu"), StackContext(self_conditioning_logits=torch.zeros(2, 4, 64)))
    with pytest.raises(ValueError, match=r"layer range \[2, 5\) is outside 0..4"):
        backbone.run_layers(torch.zeros(1, 4, 32), 2, 5, backbone.prepare(1, 4, torch.device("cpu"), None))
    with pytest.raises(ValueError, match="LongTensor of token ids"):
        backbone.embed(torch.zeros(1, 4), backbone.prepare(1, 4, torch.device("cpu"), None))


@pytest.mark.parametrize("name", FAMILIES)
def test_a_model_without_the_layout_is_refused_by_name(name):
    with pytest.raises(TypeError, match="does not have .* layout.*missing"):
        FAMILIES[name][2](torch.nn.Linear(2, 2))


def test_wrap_backbone_lists_the_supported_classes():
    with pytest.raises(TypeError, match="no backbone adapter for Linear; supported: .*LLaDAModelLM, DreamModel"):
        wrap_backbone(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_loading_by_kind_says_how_to_load_the_model(kind):
    assert kind in BACKBONES
    with pytest.raises(ValueError, match="trust_remote_code=True.*wrap_backbone"):
        load_backbone(kind, "some/checkpoint")


def test_the_backbones_stay_frozen_and_in_eval_mode():
    backbone = wrap_backbone(load_llada())
    backbone.train()
    assert not backbone.training and not backbone.model.training
    assert not any(p.requires_grad for p in backbone.parameters())
