"""TADM:Post-train of a mask-prior base: a released MDLM checkpoint (the golden fixture) loaded, split and post-trained.

The rollouts corrupt canvases with masks and step with tadm's MDLM sampler; the loss counts the positions
still masked (SUBS carries the others over).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tadm.diffusion import get_schedule, kd_loss
from tadm.nn import load_released_mdlm
from tadm.posttrain import (AnchoredBackbone, FusionSpec, MDLMBackbone, PosttrainTrainer, SplitSpec,
                            load_posttrain_config)
from tadm.posttrain.data import CanvasBatch
from tadm.posttrain.rollout import draw_rollout
from tadm.posttrain.trainer import posttrain_loss
from tadm.sampling import MDLMSampler, generate

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "mdlm_owt"
T = 8
MASK = 32  # the fixture's vocabulary: 32 tokens + the mask
OVERRIDES = [f"rollout.sampler.num_steps={T}", "rollout.self_conditioning_prob=0.0", "train.precision=fp32",
             "train.grad_accum_steps=1", "optim.lr=3e-3", "optim.warmup_steps=5", "train.max_steps=100",
             "loss.ce_weight=0.0"]  # random canvases: the CE term would only teach noise; the KD term is the test


def split_model(time_conditioning: bool = False) -> AnchoredBackbone:
    mdlm = load_released_mdlm(FIXTURE, time_conditioning=time_conditioning or None).model
    return AnchoredBackbone(MDLMBackbone(mdlm), SplitSpec(0, 1), FusionSpec(rank=16, num_heads=2))


def canvases(generator: torch.Generator, B: int = 16, L: int = 12) -> CanvasBatch:
    x = torch.randint(0, MASK, (B, L), generator=generator)
    return CanvasBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool), x,
                       torch.ones(B, L, dtype=torch.bool))


def sampler() -> MDLMSampler:
    s = MDLMSampler(MASK)
    s.set_timesteps(T)
    return s


@pytest.mark.parametrize("mode", ["on-policy", "forward"])
@pytest.mark.parametrize("time_conditioning", [False, True])
def test_masked_rollouts_keep_what_the_forward_process_allows(mode, time_conditioning):
    model = split_model(time_conditioning)
    x0 = canvases(torch.Generator().manual_seed(0)).targets
    k = torch.tensor([0, 1, 2, 2] * 4)
    state = draw_rollout(model, x0, sampler=sampler(), schedule=get_schedule("loglinear"), mode=mode, cache_age=k,
                         self_conditioning_prob=0.0, generator=torch.Generator().manual_seed(1))
    anchor_masked, current_masked = state.z_anchor == MASK, state.z_current == MASK
    assert bool((current_masked <= anchor_masked).all())  # the current canvas is less masked than the anchor's
    kept = ~current_masked
    if mode == "forward":
        assert torch.equal(state.z_current[kept], x0[kept])  # drawn from q(. | x0): unmasked tokens are clean
    assert torch.equal(state.z_current[k == 0], state.z_anchor[k == 0])
    assert bool((state.i_a - state.i_s == k).all()) and not bool(state.self_conditioning.any())
    out = posttrain_loss(model, state)
    assert out.tokens == int(current_masked.sum()) and torch.isfinite(out.loss)


def test_load_backbone_reads_both_released_layouts_without_their_custom_code():
    """The released config.json maps classes to the authors' code (auto_map); tadm reads the layout itself."""
    from tadm.posttrain import load_backbone

    for source in (FIXTURE, FIXTURE / "last.ckpt"):
        backbone = load_backbone("mdlm", source)
        assert isinstance(backbone, MDLMBackbone) and backbone.num_layers == 2 and backbone.mask_token_id == MASK


def test_a_fresh_row_is_the_frozen_model():
    """k = 0: the fused prediction equals the backbone's own (the fusion passes a fresh anchor unchanged)."""
    model = split_model()
    x0 = canvases(torch.Generator().manual_seed(0)).targets
    state = draw_rollout(model, x0, sampler=sampler(), schedule=get_schedule("loglinear"),
                         cache_age=torch.zeros(16, dtype=torch.long), self_conditioning_prob=0.0,
                         generator=torch.Generator().manual_seed(1))
    out = posttrain_loss(model, state, ce_weight=0.0)
    assert out.kd == pytest.approx(0.0, abs=1e-6)


def _held_out_kl(model: AnchoredBackbone, mode: str, age: int = 2) -> float:
    """KL(fresh || stale) per masked token on held-out canvases, the anchor ``age`` MDLM steps old."""
    saved = model.fusion_mode
    model.fusion_mode = mode
    try:
        x0 = canvases(torch.Generator().manual_seed(99), B=64).targets
        state = draw_rollout(model, x0, sampler=sampler(), schedule=get_schedule("loglinear"),
                             cache_age=torch.full((64,), age), self_conditioning_prob=0.0,
                             generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            stale = model.predict_logits(state.z_current, state.c_current, state.anchor, prepared=state.prepared)
            fresh = model.fresh_logits(state.c_current, state.prepared)
        masked = state.z_current == MASK
        return float((kd_loss(fresh, stale) * masked).sum() / masked.sum())
    finally:
        model.fusion_mode = saved


@pytest.mark.slow
def test_post_training_the_released_checkpoint_lowers_the_stale_anchor_kl_below_naive_reuse():
    torch.manual_seed(0)
    model = split_model()
    trainer = PosttrainTrainer(model, load_posttrain_config(None, OVERRIDES))
    assert isinstance(trainer.sampler, MDLMSampler) and trainer.sampler.num_steps == T
    naive = _held_out_kl(model, "naive")
    assert _held_out_kl(model, "paired") == pytest.approx(naive)  # the fusion starts as the identity
    data = torch.Generator().manual_seed(1)
    for _ in range(100):
        metrics = trainer.train_step([canvases(data)])
    assert metrics["step"] == 100
    fused = _held_out_kl(model, "paired")
    assert fused < 0.6 * naive  # measured: 0.039 against naive reuse's 0.095 nats per masked token
    # the post-trained split model samples with tadm's sampler; at K = 1 it is the loaded checkpoint itself
    run = lambda net, K: generate(net, MDLMSampler(MASK), batch_size=2, seq_len=12, num_steps=T, refresh_interval=K,
                                  generator=torch.Generator().manual_seed(3)).tokens
    assert torch.equal(run(model, 1), run(model.backbone.model, 1))
    assert run(model, 3).shape == (2, 12)
