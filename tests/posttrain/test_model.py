"""The split backbone: exactness against the unsplit model, fusion behaviour, split validation, MDLM adapter."""

import pytest
import torch
import torch.nn.functional as F

from tadm.nn import PairedAttentionFusion, mdlm_tiny
from tadm.posttrain import (
    AnchoredBackbone,
    DiffusionGemmaBackbone,
    FusionSpec,
    MDLMBackbone,
    SplitSpec,
    StackContext,
    load_backbone,
    wrap_backbone,
)
from tadm.sampling import MDLMSampler, generate
from tadm.protocol import CacheableDenoiser, LayerSplit

from .conftest import randomize

V, L = 128, 8


def _split(gemma, fusion=None, mode="paired", split=SplitSpec(1, 3)):
    return AnchoredBackbone(DiffusionGemmaBackbone(gemma), split, fusion or FusionSpec(rank=8, num_heads=2), mode)


def _inputs(seed=0, B=2, P=5):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(3, V, (B, P), generator=g),
        torch.randint(0, V, (B, L), generator=g),
        torch.randn(B, L, V, generator=g) * 2,
    )


def test_tiny_model_has_sliding_and_full_layers_and_moe(gemma):
    backbone = DiffusionGemmaBackbone(gemma)
    assert backbone.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert gemma.config.text_config.num_experts == 4
    assert not any(p.requires_grad for p in gemma.parameters())


@pytest.mark.parametrize("split", [SplitSpec(1, 3), SplitSpec(0, 6), SplitSpec(2, 2, 2)])
def test_fresh_split_reproduces_the_unsplit_model(gemma, split):
    """K = 1 with the zero-initialised fusion gives exactly the model's own forward logits."""
    prompt, z, sc = _inputs()
    reference = gemma(input_ids=prompt, decoder_input_ids=z, self_conditioning_logits=sc).logits
    model = _split(gemma, split=split)
    cache = model.backbone.prefill(prompt)
    logits = model(z, StackContext(prompt=cache, self_conditioning_logits=sc))
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)
    # Without self-conditioning (first step) as well.
    reference0 = gemma(input_ids=prompt, decoder_input_ids=z).logits
    torch.testing.assert_close(model(z, StackContext(prompt=model.backbone.prefill(prompt))), reference0, rtol=0, atol=0)


def test_soft_capping_in_place_without_gradients_is_bit_identical(gemma):
    """Sampling soft-caps the head's output in place (two (B, L, V) temporaries fewer); training keeps the graph."""
    backbone = DiffusionGemmaBackbone(gemma)
    h = torch.randn(2, L, backbone.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        sampled = backbone.logits(h)
    trained = backbone.logits(h.clone().requires_grad_())
    cap = gemma.final_logit_softcapping
    assert cap is not None and trained.requires_grad and not sampled.requires_grad
    assert torch.equal(sampled, trained.detach())
    assert torch.equal(sampled, torch.tanh(gemma.lm_head(backbone.decoder.norm(h)).float() / cap) * cap)
    assert float(sampled.abs().max()) < cap


def test_left_padded_prompts_match_the_model(gemma):
    prompt, z, sc = _inputs(seed=1, P=7)
    mask = torch.ones_like(prompt, dtype=torch.bool)
    mask[1, :3] = False
    reference = gemma(
        input_ids=prompt,
        attention_mask=mask,
        decoder_input_ids=z,
        decoder_attention_mask=F.pad(mask, (0, L), value=True),
        self_conditioning_logits=sc,
    ).logits
    model = _split(gemma)
    logits = model(z, StackContext(prompt=model.backbone.prefill(prompt, mask), self_conditioning_logits=sc))
    torch.testing.assert_close(logits, reference, rtol=0, atol=0)


def test_fusion_is_exact_on_a_fresh_anchor_even_when_trained(gemma):
    prompt, z, sc = _inputs(seed=2)
    model = _split(gemma)
    randomize(model.fusion, seed=3)
    ctx = StackContext(prompt=model.backbone.prefill(prompt), self_conditioning_logits=sc)
    prepared = model.prepare(z, ctx)
    c = model.encode(z, prepared=prepared)
    anchor = model.compute_anchor(c, prepared=prepared)
    h0, c0 = model.unpack_anchor(anchor)
    assert torch.equal(c0, c)
    # The fusion evaluated on C == C0 (no shortcut) returns H0 bit for bit.
    assert torch.equal(model.fuse(c.clone(), anchor, fusion=model.fusion), h0)
    fresh = model.predict_logits(z, c, anchor, prepared=prepared)
    assert torch.equal(fresh, gemma(input_ids=prompt, decoder_input_ids=z, self_conditioning_logits=sc).logits)


def test_stale_anchor_paired_versus_naive(gemma):
    prompt, z_old, _ = _inputs(seed=4)
    z_new = z_old.clone()
    z_new[:, :3] = (z_new[:, :3] + 7) % V
    model = _split(gemma)
    ctx = StackContext(prompt=model.backbone.prefill(prompt))
    p_old, p_new = model.prepare(z_old, ctx), model.prepare(z_new, ctx)
    anchor = model.compute_anchor(model.encode(z_old, prepared=p_old), prepared=p_old)
    c_new = model.encode(z_new, prepared=p_new)
    h0, c0 = model.unpack_anchor(anchor)
    naive = model.denoise_logits(h0, p_new)  # D reads the stale anchor directly
    # Zero-initialised W_up: paired fusion equals naive reuse exactly.
    assert torch.equal(model.predict_logits(z_new, c_new, anchor, prepared=p_new), naive)
    randomize(model.fusion, seed=5)
    paired = model.predict_logits(z_new, c_new, anchor, prepared=p_new)
    g, update = model.fusion.correction(c_new, c0, h0)
    torch.testing.assert_close(paired, model.denoise_logits(h0 + g * update, p_new))
    assert not torch.allclose(paired, naive)
    model.fusion_mode = "naive"
    assert torch.equal(model.predict_logits(z_new, c_new, anchor, prepared=p_new), naive)
    with pytest.raises(ValueError, match="valid: paired, naive"):
        model.fusion_mode = "gated"


def test_only_the_fusion_is_trainable(gemma):
    model = _split(gemma)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"fusion.{n}" for n in model.adapter_params()}
    model.train()
    assert model.fusion.training and not model.backbone.training and not gemma.training


@pytest.mark.parametrize(
    "split, message",
    [
        (SplitSpec(2, 0), "anchor_layers must be >= 1"),
        (SplitSpec(3, 4), "exceeds the backbone's 6 layers"),
        (SplitSpec(-1, 3), "shared_layers must be an integer >= 0"),
        (SplitSpec(1, 3, 1), "does not cover the backbone's 6 layers; set denoiser_layers=2"),
        (SplitSpec(1, 2.5), "anchor_layers must be an integer"),
    ],
)
def test_invalid_splits_are_clear_errors(gemma, split, message):
    with pytest.raises(ValueError, match=message):
        _split(gemma, split=split)


def test_split_resolution_and_paper_default():
    assert SplitSpec().resolve(30) == LayerSplit(2, 20, 8)
    assert SplitSpec(2, 20, 8).resolve(30) == LayerSplit(2, 20, 8)
    assert SplitSpec(0, 6).resolve(6) == LayerSplit(0, 6, 0)


def test_fusion_parameter_count_at_diffusiongemma_26b_size(capsys):
    """Paired-attention fusion at d = 2816 (DiffusionGemma-26B), r = 256, 4 heads: ~3.1M parameters."""
    d, r = 2816, 256
    fusion = PairedAttentionFusion(d, rank=r, num_heads=4)
    count = sum(p.numel() for p in fusion.parameters())
    # W_C, W_H, W_up: 3 d r; W_Q, W_K, W_V: 3 (2r) r; W_O: r^2; FFN: 2 (2r) r; W_g1: (4r) r; W_g2, b_g: r + 1.
    assert count == 3 * d * r + 6 * r * r + r * r + 4 * r * r + 4 * r * r + r + 1 == 3_145_985
    with capsys.disabled():
        print(f"\npaired-attention fusion parameters at d={d}, r={r}, 4 heads: {count:,}")


def test_fusion_hidden_size_must_match(gemma):
    with pytest.raises(ValueError, match="fusion hidden_size 64 != backbone hidden_size 32"):
        AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), PairedAttentionFusion(64, rank=8, num_heads=2))


def test_gemma_pass_needs_a_prompt(gemma):
    model = _split(gemma)
    with pytest.raises(ValueError, match="backbone.prefill"):
        model(torch.zeros(1, L, dtype=torch.long))


# ------------------------------------------------------------------------------------------ MDLM
def test_mdlm_adapter_is_a_cacheable_denoiser_and_exact_at_k1():
    torch.manual_seed(0)
    mdlm = mdlm_tiny()
    randomize(mdlm, seed=1, std=0.2)  # adaLN and output layers start at zero; make them non-trivial
    model = AnchoredBackbone(MDLMBackbone(mdlm), SplitSpec(1, 1), FusionSpec(rank=8, num_heads=2))
    assert isinstance(model, CacheableDenoiser)
    assert model.layer_split == LayerSplit(1, 1, 1)
    z = torch.randint(0, 65, (2, 10), generator=torch.Generator().manual_seed(2))
    c = model.encode(z)
    torch.testing.assert_close(model.predict(z, c, model.compute_anchor(c)), mdlm(z), rtol=0, atol=0)


def test_generic_anchor_cache_loop_drives_the_split_mdlm():
    torch.manual_seed(0)
    mdlm = mdlm_tiny()
    randomize(mdlm, seed=1, std=0.2)
    model = AnchoredBackbone(MDLMBackbone(mdlm), SplitSpec(1, 1), FusionSpec(rank=8, num_heads=2))
    run = lambda net, K: generate(net, MDLMSampler(64), batch_size=2, seq_len=10, num_steps=6, refresh_interval=K,
                                  generator=torch.Generator().manual_seed(3))
    fresh, own = run(model, 1), run(mdlm, 1)
    assert torch.equal(fresh.tokens, own.tokens)  # K = 1: the split model is the MDLM
    cached = run(model, 3)
    calls = cached.layer_calls
    assert (calls.shared, calls.anchor, calls.denoiser, calls.anchor_refreshes) == (6, 2, 6, 2)


def test_backbone_registry_errors():
    with pytest.raises(ValueError, match="valid: diffusion-gemma, dream, llada, mdlm"):
        load_backbone("sedd", "somewhere")
    with pytest.raises(TypeError, match="LayerStackBackbone"):
        wrap_backbone(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="MDLM has no self-conditioning"):
        MDLMBackbone(mdlm_tiny()).prepare(1, 4, torch.device("cpu"), StackContext(self_conditioning_logits=torch.zeros(1, 4, 65)))
