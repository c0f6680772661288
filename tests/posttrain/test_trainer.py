"""The cache objective, fusion-only gradients, the optimiser/schedule, configs, resume and DDP."""

import math

import pytest
import torch

from tadm.config import PRESET_DIR

from tadm.diffusion import get_schedule
from tadm.posttrain import (
    AnchoredBackbone,
    CanvasBatch,
    DiffusionGemmaBackbone,
    FusionSpec,
    PosttrainConfigError,
    PosttrainTrainer,
    SplitSpec,
    StackContext,
    load_posttrain_config,
    on_policy_rollout,
    posttrain_loss,
)
from tadm.sampling.entropy_bound import EntropyBoundSampler
from tadm.training.checkpoint import load_training_state, save_training_state
from tadm.training.lr import WarmupSchedule

from .conftest import build_tiny_gemma

V, L = 128, 8
CONFIGS = PRESET_DIR


def _config(**overrides):
    base = {
        "rollout.sampler.num_steps": 12,
        "rollout.cache_ages": [1, 2],
        "rollout.cache_age_probs": [0.5, 0.5],
        "train.max_steps": 40,
        "optim.warmup_steps": 0,
        "optim.lr": 1e-2,
        "train.seed": 0,
    }
    base.update(overrides)
    return load_posttrain_config(None, [f"{k}={v}" for k, v in base.items()])


def _model(gemma):
    return AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), FusionSpec(rank=8, num_heads=2))


def _batch(B=4, P=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(3, V, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.bool)
    mask[0, :2] = False
    target_mask = torch.ones(B, L, dtype=torch.bool)
    target_mask[1, -3:] = False
    return CanvasBatch(context, mask, torch.randint(3, V, (B, L), generator=g), target_mask)


def _rollout(model, batch, seed, ages=None, sc=0.5, T=12):
    prompt = model.backbone.prefill(batch.context_ids, batch.context_mask)
    return on_policy_rollout(model, batch.targets, sampler=EntropyBoundSampler(V, num_steps=T),
                             schedule=get_schedule("loglinear"), prompt=prompt, cache_age=ages,
                             self_conditioning_prob=sc, generator=torch.Generator().manual_seed(seed))


def test_loss_is_ce_plus_kd_against_the_frozen_teacher(gemma):
    model = _model(gemma)
    with torch.no_grad():
        model.fusion.up.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    batch = _batch()
    state = _rollout(model, batch, seed=1, ages=torch.tensor([1, 2, 1, 2]))
    out = posttrain_loss(model, state, token_mask=batch.target_mask, kd_weight=0.7, kd_temperature=1.0)
    # By hand: the student fuses the stale anchor, the teacher is the unsplit model on the same state.
    with torch.no_grad():
        student = model.predict_logits(state.z_current, state.c_current, state.anchor, prepared=state.prepared)
        teacher = model.fresh_logits(state.c_current, state.prepared)
    log_q, log_p = student.log_softmax(-1), teacher.log_softmax(-1)
    ce = -log_q.gather(-1, batch.targets[..., None])[..., 0]
    kd = (log_p.exp() * (log_p - log_q)).sum(-1)
    m = batch.target_mask.float()
    torch.testing.assert_close(out.loss.detach(), ((ce + 0.7 * kd) * m).sum() / m.sum())
    assert out.kd > 0 and out.tokens == int(m.sum())
    assert set(out.loss_by_age) == {1, 2}


def test_fresh_rows_give_zero_kd_and_zero_gradient(gemma):
    model = _model(gemma)
    with torch.no_grad():
        model.fusion.up.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    state = _rollout(model, _batch(), seed=2, ages=torch.zeros(4, dtype=torch.long))
    out = posttrain_loss(model, state)
    assert out.kd == pytest.approx(0.0, abs=1e-6)
    out.loss.backward()
    grads = [p.grad for p in model.fusion.parameters()]
    assert all(g is not None for g in grads)  # the fusion is evaluated, so every parameter takes part
    assert all(torch.count_nonzero(g) == 0 for g in grads)  # but C == C0 makes the correction exactly zero


def test_only_fusion_parameters_receive_gradients(gemma):
    model = _model(gemma)
    trainer = PosttrainTrainer(model, _config())
    trainer.micro_step(_batch())
    assert all(p.grad is None for p in gemma.parameters())
    fusion_grads = {n: p.grad for n, p in model.fusion.named_parameters()}
    assert all(g is not None for g in fusion_grads.values())
    assert torch.count_nonzero(fusion_grads["up.weight"]) > 0  # W_up starts at zero and is what moves first


@pytest.mark.slow
def test_a_few_steps_lower_the_loss():
    """Twenty fusion-only steps lower the cache objective on fixed rollout end points.

    The canvases are the model's own greedy predictions (distillation-style data the frozen model
    can fit), and the loss is measured before and after on the same six rollouts so that only the
    fusion changes between the two evaluations.
    """
    gemma = build_tiny_gemma(seed=1)
    torch.manual_seed(0)
    model = _model(gemma)
    raw = _batch(B=8, seed=3)
    with torch.no_grad():
        noisy = torch.randint(0, V, (8, L), generator=torch.Generator().manual_seed(0))
        targets = model(noisy, StackContext(prompt=model.backbone.prefill(raw.context_ids, raw.context_mask))).argmax(-1)
    batch = CanvasBatch(raw.context_ids, raw.context_mask, targets, raw.target_mask)
    states = [_rollout(model, batch, seed=s) for s in range(6)]

    def eval_loss():
        with torch.no_grad():
            return sum(posttrain_loss(model, state).loss.item() for state in states) / len(states)

    trainer = PosttrainTrainer(model, _config(**{"optim.lr": 0.03}))  # a large step size: few steps suffice
    before = eval_loss()
    history = [trainer.train_step([batch])["loss"] for _ in range(20)]
    after = eval_loss()
    assert after < before - 0.02, (before, after, history)
    assert trainer.step == 20


def test_optimizer_and_schedule_follow_the_config(gemma):
    cfg = load_posttrain_config(None, ["train.max_steps=1000"])
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.eps) == (1.5e-4, [0.95, 0.99], 1e-4, 1e-8)
    trainer = PosttrainTrainer(_model(gemma), cfg)
    group = trainer.optimizer.param_groups[0]
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert (group["betas"], group["weight_decay"], group["eps"]) == ((0.95, 0.99), 1e-4, 1e-8)
    assert group["lr"] == pytest.approx(1.5e-4 / 100)  # first warm-up step
    # The pretraining schedule in its cosine form: linear warm-up over 100 steps, then cosine to 0.1.
    schedule = trainer.scheduler.lr_lambdas[0]
    assert isinstance(schedule, WarmupSchedule) and schedule.schedule == "cosine"

    def by_hand(step):
        if step < 100:
            return (step + 1) / 100
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 100) / 900)))

    assert schedule(99) == 1.0 and schedule(100) == 1.0
    assert schedule(550) == pytest.approx(0.55) and schedule(1000) == pytest.approx(0.1)
    assert schedule(325) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    for step in range(1200):  # the optimiser follows it step by step (no gradients: the weights stay put)
        assert group["lr"] == pytest.approx(1.5e-4 * by_hand(step), rel=1e-12, abs=0), step
        trainer.optimizer.step()
        trainer.scheduler.step()


def test_gradient_accumulation_and_clipping(gemma):
    cfg = _config(**{"optim.grad_clip": 1e-4})
    model = _model(gemma)
    trainer = PosttrainTrainer(model, cfg)
    before = {n: p.detach().clone() for n, p in model.fusion.named_parameters()}
    metrics = trainer.train_step([_batch(seed=1), _batch(seed=2)])
    assert metrics["grad_norm"] > 1e-4  # the pre-clipping norm is reported
    assert metrics["tokens"] == 2 * int(_batch().target_mask.sum())
    moved = sum(float((p.detach() - before[n]).abs().sum()) for n, p in model.fusion.named_parameters())
    assert moved > 0
    assert all(p.grad is None for p in model.fusion.parameters())  # zeroed after the step


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run(tmp_path):
    batches = [[_batch(seed=s)] for s in range(3)]
    straight = PosttrainTrainer(_model(build_tiny_gemma()), _config())
    for b in batches:
        straight.train_step(b)
    first = PosttrainTrainer(_model(build_tiny_gemma()), _config())
    for b in batches[:2]:
        first.train_step(b)
    # through a file read with weights_only=True: the state holds only tensors and plain values
    state = load_training_state(save_training_state(first.state_dict(), tmp_path / "training_state.pt"))
    resumed = PosttrainTrainer(_model(build_tiny_gemma()), _config())
    resumed.load_state_dict(state)
    resumed.train_step(batches[2])
    for (n, a), b in zip(straight.model.fusion.state_dict().items(), resumed.model.fusion.state_dict().values()):
        assert torch.equal(a, b), n


@pytest.mark.slow
def test_ddp_wrapped_fusion_trains_like_the_plain_one(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain = PosttrainTrainer(_model(build_tiny_gemma()), _config())
        model = _model(build_tiny_gemma())
        wrapped = PosttrainTrainer(model, _config(), fusion_runner=DistributedDataParallel(model.fusion))
        for seed in range(2):
            plain.train_step([_batch(seed=seed), _batch(seed=seed + 5)])
            wrapped.train_step([_batch(seed=seed), _batch(seed=seed + 5)])
        for a, b in zip(plain.model.fusion.parameters(), model.fusion.parameters()):
            torch.testing.assert_close(a, b)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("name", ["posttrain-diffusiongemma.yaml", "posttrain-tiny.yaml"])
def test_shipped_configs_load(name):
    cfg = load_posttrain_config(CONFIGS / name)
    assert cfg.rollout.cache_ages == [0, 1, 2] and cfg.rollout.cache_age_probs == [0.34, 0.33, 0.33]
    assert cfg.loss.kd_weight == 1.0 and cfg.rollout.self_conditioning_prob == 0.5
    header = (CONFIGS / name).read_text().splitlines()[:12]
    assert any("tadm posttrain train" in line for line in header)  # the launch command is in the header
    if name == "posttrain-diffusiongemma.yaml":
        assert SplitSpec(cfg.split.shared_layers, cfg.split.anchor_layers, cfg.split.denoiser_layers).resolve(30)
        assert (cfg.fusion.rank, cfg.fusion.num_heads, cfg.optim.warmup_steps, cfg.train.grad_accum_steps) == (
            256, 4, 100, 4)


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(PosttrainConfigError, match="rollout.bogus"):
        load_posttrain_config(None, ["rollout.bogus=1"])
    with pytest.raises(PosttrainConfigError, match="train.max_steps"):
        load_posttrain_config(None, ["train.max_steps=many"])
    with pytest.raises(PosttrainConfigError, match="cache_age_probs"):
        load_posttrain_config(None, ["rollout.cache_age_probs=[1.0]"])
    with pytest.raises(PosttrainConfigError, match="categorical draw"):
        load_posttrain_config(None, ["rollout.sampler.categorical=topk"])
    with pytest.raises(PosttrainConfigError, match="key=value"):
        load_posttrain_config(None, ["train.max_steps"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  betas: [0.9]\n")
    with pytest.raises(PosttrainConfigError, match="optim.betas"):
        load_posttrain_config(bad)
    with pytest.raises(FileNotFoundError):
        load_posttrain_config(tmp_path / "missing.yaml")
