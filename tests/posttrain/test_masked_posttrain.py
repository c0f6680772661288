"""TADM:Post-train for the absorbing families (LLaDA, Dream, tadm's MDLM): rollouts corrupted with the mask
token, the family's own sampler with one step index per row, the loss on masked positions, and a trained fusion
that beats naive reuse on held-out canvases, saved and loaded through AnchoredModel.from_pretrained."""

import json

import pytest
import torch

from tadm.diffusion import get_schedule, kd_loss
from tadm.nn.dit import subs_log_probs
from tadm.posttrain import (AnchoredModel, CanvasBatch, FusionSpec, PosttrainConfigError, PosttrainTrainer,
                            anchorize, draw_rollout, generate_sequence, load_posttrain_config, posttrain_loss,
                            run_posttrain, save_adapter)
from tadm.posttrain.diagnostics import stale_fresh_divergence
from tadm.sampling import DreamSampler, LLaDASampler, build_sampler, generate
from tadm.sampling.mdlm import MDLMSampler
from tests.standins.dream import load_dream
from tests.standins.llada import load_llada

from .anchorize_helpers import tiny_mdlm
from .conftest import randomize, tiny_chat_tokenizer

MASK, P, G, T = 60, 4, 8, 8
FAMILIES = {"llada": (load_llada, "llada", LLaDASampler), "dream": (load_dream, "dream-origin", DreamSampler),
            "mdlm": (tiny_mdlm, "mdlm", MDLMSampler)}


def _model(family, rank=16):
    return anchorize(FAMILIES[family][0](), (1, 2), FusionSpec(rank=rank, num_heads=2)).stage_view()


def _config(**overrides):
    values = {"rollout.sampler.num_steps": T, "rollout.cache_ages": [1, 2], "rollout.cache_age_probs": [0.5, 0.5],
              "train.max_steps": 200, "optim.warmup_steps": 0, "optim.lr": 3e-3, "train.seed": 0, **overrides}
    return load_posttrain_config(None, [f"{k}={v}" for k, v in values.items()])


def _batch(B=4, seed=0, padded=True):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, MASK, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.bool)
    if padded:
        mask[0, :2] = False
    targets = torch.randint(0, MASK, (B, G), generator=g)
    return CanvasBatch(context, mask, targets, torch.ones(B, G, dtype=torch.bool))


def _rollout(view, batch, mode, ages, seed=1):
    x0, target, padding = batch.whole_sequence()
    sampler = build_sampler(FAMILIES["llada"][1] if type(view.backbone).__name__ == "LLaDABackbone" else "mdlm", view)
    sampler.set_timesteps(T)
    return draw_rollout(view, x0, sampler=sampler, schedule=get_schedule("loglinear"), mode=mode, frozen=~target,
                        attention_mask=padding, cache_age=ages, t_anchor=torch.full((len(ages),), 0.7),
                        self_conditioning_prob=0.0,
                        generator=torch.Generator().manual_seed(seed)), target


@pytest.mark.parametrize("mode", ["on-policy", "forward"])
def test_masked_rollouts_keep_the_prompt_and_corrupt_with_the_mask(mode):
    view = _model("llada")
    batch = _batch()
    ages = torch.tensor([0, 1, 2, 2])
    state, target = _rollout(view, batch, mode, ages)
    x0, masked_now, masked_then = state.x0, state.z_current == MASK, state.z_anchor == MASK
    for z in (state.z_anchor, state.z_current):
        assert torch.equal(z[~target], x0[~target])  # the prompt is never corrupted
    assert bool(((state.z_anchor == x0) | masked_then).all())  # Eq. (fwd), absorbing: the token or the mask
    assert bool((masked_now <= masked_then).all())  # the current canvas is the anchor's, less some masks
    assert torch.equal(state.z_current[~masked_then], state.z_anchor[~masked_then])
    assert torch.equal(state.z_current[0], state.z_anchor[0])  # age 0: the anchor's own canvas
    if mode == "forward":  # teacher-forced: the current canvas is x0 with masks as well
        assert bool(((state.z_current == x0) | masked_now).all())
    else:  # k reverse steps of LLaDA's sampler from the anchor's canvas, with its stale anchor
        decoded = (masked_then & ~masked_now).sum(dim=1)
        assert bool((decoded[1:] > 0).all()) and int(decoded[0]) == 0
        assert not bool(((state.z_current == x0) | masked_now).all())  # the student's own tokens, not x0's


def test_the_loss_is_subs_ce_and_kd_at_masked_response_positions():
    view = _model("llada")
    randomize(view.fusion, seed=0, std=0.2)
    batch = _batch()
    state, target = _rollout(view, batch, "on-policy", torch.tensor([1, 2, 1, 2]))
    out = posttrain_loss(view, state, token_mask=target, kd_weight=0.7)
    with torch.no_grad():
        student = view.predict_logits(state.z_current, state.c_current, state.anchor, prepared=state.prepared)
        teacher = view.fresh_logits(state.c_current, state.prepared)
    log_q, log_p = subs_log_probs(student, state.z_current, MASK), subs_log_probs(teacher, state.z_current, MASK)
    ce = -log_q.gather(-1, state.x0[..., None])[..., 0]
    kd = (log_p.exp() * (log_p - log_q)).sum(-1)
    m = (target & (state.z_current == MASK)).float()
    torch.testing.assert_close(out.loss.detach(), ((ce + 0.7 * kd) * m).sum() / m.sum())
    assert out.tokens == int(m.sum()) and out.kd > 0
    torch.testing.assert_close(kd, kd_loss(log_p, log_q))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trainer_rolls_out_with_the_familys_sampler_and_trains_the_fusion_only(family):
    view = _model(family)
    trainer = PosttrainTrainer(view, _config())
    assert isinstance(trainer.sampler, FAMILIES[family][2]) and trainer.sampler.num_steps == T
    trainer.micro_step(_batch(padded=family != "mdlm"))
    assert all(p.grad is None for p in view.backbone.parameters() if not any(p is q for q in view.fusion.parameters()))
    assert torch.count_nonzero(view.fusion.up.weight.grad) > 0
    other = PosttrainTrainer(view, _config(**{"rollout.masked_sampler": "mdlm"}))
    assert isinstance(other.sampler, MDLMSampler)


def test_a_bad_masked_sampler_is_a_config_error():
    with pytest.raises(PosttrainConfigError, match="rollout.masked_sampler 'entropy-bound' is not a masked sampler; "
                                                   "valid: mdlm, remdm-cap"):
        _config(**{"rollout.masked_sampler": "entropy-bound"})


def _distilled(view, family, seed, batches, B=8):
    """Canvases the stand-in generates itself (temperature 1) after random prompts (MDLM: unconditionally, as it is
    post-trained): data the base can fit."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        context = torch.randint(0, MASK, (B, P), generator=g)
        if family == "mdlm":
            tokens = generate(view, "mdlm", batch_size=B, seq_len=G, num_steps=T, generator=g).tokens
        else:
            tokens = generate_sequence(view, build_sampler(FAMILIES[family][1], view, temperature=1.0), context,
                                       gen_length=G, num_steps=T, generator=g).new_tokens
        out.append(CanvasBatch(context, torch.ones(B, P, dtype=torch.bool), tokens, torch.ones(B, G, dtype=torch.bool)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_200_steps_lower_the_stale_kl_below_naive_reuse_on_held_out_canvases(family, tmp_path):
    view = _model(family)
    train, held_out = _distilled(view, family, seed=0, batches=16), _distilled(view, family, seed=1, batches=4)
    sampler = build_sampler(FAMILIES[family][1], view)
    sampler.set_timesteps(T)

    def divergence():
        pairs = [(batch, torch.Generator().manual_seed(7 + n)) for n, batch in enumerate(held_out)]
        return stale_fresh_divergence(view, pairs, sampler, intervals=(3,))[3]

    before = divergence()
    assert before["kl_fused"] == before["kl_naive"] > 0.05  # an untrained fusion is the identity: naive reuse
    trainer = PosttrainTrainer(view, _config())
    for step in range(200):
        trainer.train_step([train[step % len(train)]])
    after = divergence()
    assert after["kl_naive"] == before["kl_naive"]
    print(f"{family}: K = 3 KL(fresh || stale) naive {after['kl_naive']:.4f}, fused {after['kl_fused']:.4f}")
    assert after["kl_fused"] < 0.95 * after["kl_naive"], (before, after)
    # the adapter the trainer saves is served by AnchoredModel.from_pretrained
    save_adapter(tmp_path / "adapter", view, base_model=f"{family}-stand-in")
    served = AnchoredModel.from_pretrained(FAMILIES[family][0](), tmp_path / "adapter", refresh_interval=3)
    for name, tensor in view.fusion.state_dict().items():
        assert torch.equal(served.fusion.state_dict()[name], tensor)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["backbone"] == family


@pytest.mark.slow
def test_run_posttrain_trains_a_model_the_user_loaded(tmp_path):
    tokenizer = tiny_chat_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    chat = [("the cat", "sat on a mat"), ("how are you", "fine thanks"), ("what is it", "the dog ran far away")]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"prompt": p, "response": r}) for p, r in chat) + "\n")
    overrides = [f"data.train_file={tmp_path / 'chat.jsonl'}", f"data.tokenizer={tmp_path / 'tokenizer'}",
                 "data.canvas_length=4", "data.canvases_per_example=1", "split.shared_layers=1",
                 "split.anchor_layers=2", "split.denoiser_layers=1", "fusion.rank=8", "fusion.num_heads=2",
                 "rollout.sampler.num_steps=4", "train.max_steps=3", "train.micro_batch_size=2",
                 "train.grad_accum_steps=1", "optim.warmup_steps=0", "base.path=GSAI-ML/LLaDA-8B-Instruct"]
    with pytest.raises(PosttrainConfigError, match="base.backbone is 'diffusion-gemma' but the given model is a "
                                                   "'llada' model; set base.backbone=llada"):
        run_posttrain(load_posttrain_config(None, [*overrides, f"train.out_dir={tmp_path / 'x'}"]), model=load_llada())
    config = load_posttrain_config(None, [*overrides, "base.backbone=llada", f"train.out_dir={tmp_path / 'run'}"])
    model = load_llada()
    adapter = run_posttrain(config, model=model, log=lambda m: None)
    assert model.layer_split.anchor == 2 and torch.count_nonzero(model.fusion.up.weight) > 0  # trained in place
    served = AnchoredModel.from_pretrained(load_llada(), adapter, refresh_interval=2)
    assert torch.equal(served.fusion.up.weight, model.fusion.up.weight)
    assert served.anchor_state.base_model == "GSAI-ML/LLaDA-8B-Instruct"  # base.path, recorded in the adapter
