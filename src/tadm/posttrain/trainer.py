"""TADM:Post-train training: the cache objective and the fusion-only training loop (schema: :mod:`tadm.posttrain.config`).

Objective, Eq. (anchor-sft-objective): for a rollout end point ``z~_t`` (see
:mod:`tadm.posttrain.rollout`) with cached anchor ``h_t'``, the student prediction
``x^ = D(Phi(S(z~_t), [H0, C0]))`` is trained with

    L = L_CE(x^, x0) + lambda_KD * KL(p_theta0(. | z~_t) || x^),

averaged over the canvas' response tokens, where the teacher ``p_theta0`` is the frozen base model
run fresh on the same state (its own anchor, no fusion) at temperature 1. For an absorbing backbone
(LLaDA, Dream, MDLM) both distributions are the backbone's SUBS parameterisation and the average runs
over the response positions that are masked in ``z~_t`` (elsewhere SUBS carries the token over and
both terms are zero). LLaDA's and Dream's canvas holds the prompt, never corrupted nor trained on;
tadm's MDLM is post-trained on the response canvas alone, as it was pretrained (unconditionally). The backbone is frozen:
only the fusion receives gradients; they flow to it through the frozen denoiser layers. Because
``S`` and ``A`` hold no trainable parameter, the shallow state and cached anchor of the rollout are
reused as they are instead of being recomputed with autograd (the result is identical).

Optimisation (appendix "TADM:Post-train", training details): AdamW (lr 1.5e-4, betas (0.95, 0.99),
eps 1e-8, weight decay 1e-4), cosine decay after 100 warm-up steps to 0.1 of the peak, gradient
accumulation, clipping at norm 1.0, bf16 autocast on GPU, and data parallelism with ``torchrun``
(the fusion is wrapped in ``DistributedDataParallel``; the frozen backbone is replicated, not
synchronised).
"""

from __future__ import annotations

import importlib
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor, nn
from tqdm.auto import tqdm

from tadm.config import check_resumable
from tadm.diffusion import get_schedule, kd_loss
from tadm.hf import first_line, load_hf_tokenizer
from tadm.posttrain.adapter_io import ADAPTER_CONFIG_NAME, save_adapter
from tadm.posttrain.anchorize import anchorize, is_anchorized
from tadm.posttrain.architectures import find_architecture, rollout_sampler_for
from tadm.posttrain.backbone import load_backbone
from tadm.posttrain.config import PosttrainConfig, PosttrainConfigError
from tadm.posttrain.data import CanvasBatch, ChatCanvasDataset, collate_canvases, read_chat_jsonl
from tadm.posttrain.model import AnchoredBackbone, FusionSpec, SplitSpec
from tadm.posttrain.rollout import ROLLOUT_PRIORS, RolloutState, draw_rollout
from tadm.records import write_text
from tadm.sampling.entropy_bound import EntropyBoundSampler
from tadm.sampling.registry import SAMPLERS, build_sampler
from tadm.training.checkpoint import STATE_FILENAME, STATE_FORMAT, load_training_state, save_training_state
from tadm.training.distributed import DistInfo, barrier, cleanup, init_distributed, wrap_model
from tadm.training.lr import build_lr_scheduler
from tadm.training.metrics import MetricsLogger
from tadm.training.precision import autocast_context
from tadm.training.rundir import claim_run_dir, remove_stale_temporaries

__all__ = ["CONFIG_FILENAME", "PosttrainLoss", "PosttrainTrainer", "canvas_batches", "posttrain_loss", "rollout_sampler",
           "run_posttrain"]

CONFIG_FILENAME = "posttrain_config.yaml"  # the resolved config, beside the adapter and its training state

# What a resumed run may not change: all but the step count, logging, saving, device and precision.
RESUME_FIXED = ("base.path", "base.backbone", "split", "fusion", "rollout", "loss", "data", "optim",
                "train.micro_batch_size", "train.grad_accum_steps", "train.seed")


# ========================================================================================= objective
@dataclass
class PosttrainLoss:
    """One micro-batch's objective: ``loss`` carries gradients, the rest are detached floats."""

    loss: Tensor
    ce: float
    kd: float
    tokens: int
    loss_by_age: dict[int, float] = field(default_factory=dict)


def posttrain_loss(
    model: AnchoredBackbone,
    state: RolloutState,
    *,
    token_mask: Tensor | None = None,
    ce_weight: float = 1.0,
    kd_weight: float = 1.0,
    kd_temperature: float = 1.0,
    fusion: Callable[..., Tensor] | None = None,
) -> PosttrainLoss:
    """Eq. (anchor-sft-objective) at a rollout end point, averaged over ``token_mask`` (B, L) tokens (for a
    mask-prior backbone, those still masked in the current canvas: the others are carried over, not predicted).

    ``fusion`` is the module to evaluate (default ``model.fusion``; a DDP wrapper when distributed);
    it is always evaluated, also for fresh rows (k = 0) where its correction is exactly zero.
    """
    runner = model.fusion if fusion is None else fusion
    backbone = model.backbone
    student = model.predict_logits(state.z_current, state.c_current, state.anchor, prepared=state.prepared,
                                   fusion=runner)  # (B, L, V)
    with torch.no_grad():
        teacher = model.fresh_logits(state.c_current, state.prepared)  # (B, L, V)
    log_q = backbone.log_probs(student, state.z_current)  # (B, L, V)
    ce = -log_q.gather(-1, state.x0.unsqueeze(-1)).squeeze(-1).float()  # (B, L)
    absorbing = backbone.prior == "mask"
    if absorbing:  # SUBS distributions, at the masked positions only (module docstring)
        kd = kd_loss(backbone.log_probs(teacher, state.z_current), log_q, temperature=kd_temperature).float()
    else:
        kd = kd_loss(teacher, student, temperature=kd_temperature).float()  # (B, L)
    per_token = ce_weight * ce + kd_weight * kd  # (B, L)
    mask = torch.ones_like(per_token) if token_mask is None else token_mask.to(per_token.dtype)
    if absorbing:  # SUBS carries unmasked tokens over: only masked positions are predicted
        mask = mask * (state.z_current == backbone.mask_token_id).to(mask.dtype)
    count = mask.sum().clamp_min(1.0)
    loss = (per_token * mask).sum() / count
    by_age: dict[int, float] = {}
    with torch.no_grad():
        ce_mean, kd_mean = float((ce * mask).sum() / count), float((kd * mask).sum() / count)
        row_tokens = mask.sum(-1)  # (B,)
        row_loss = (per_token * mask).sum(-1)  # (B,)
        for age in torch.unique(state.cache_age).tolist():
            rows = state.cache_age == age
            by_age[int(age)] = float(row_loss[rows].sum() / row_tokens[rows].sum().clamp_min(1.0))
    return PosttrainLoss(loss=loss, ce=ce_mean, kd=kd_mean, tokens=int(mask.sum()), loss_by_age=by_age)


# =========================================================================================== trainer
def rollout_sampler(model: AnchoredBackbone, config: PosttrainConfig) -> Any:
    """The sampler the rollouts share with inference: Algorithm 2 (``rollout.sampler``) for a uniform-prior base;
    for a mask-prior one the family's own sampler (``rollout.masked_sampler``, default LLaDA's for LLaDA, Dream's
    ``origin`` for Dream, tadm's MDLM sampler on ``rollout.schedule`` for MDLM bases) on the same
    T = ``rollout.sampler.num_steps`` grid."""
    r = config.rollout
    if model.backbone.prior == "mask":
        name = r.masked_sampler or rollout_sampler_for(model.backbone)
        options = {"schedule": r.schedule} if "schedule" in SAMPLERS[name].options() else {}
        sampler = build_sampler(name, model, **options)
        sampler.set_timesteps(int(r.sampler.num_steps))
        return sampler
    return EntropyBoundSampler.from_config(model.vocab_size, r.sampler)


class PosttrainTrainer:
    """Trains the fusion of an :class:`AnchoredBackbone` on canvas batches with on-policy rollouts.

    Args:
        model: the split backbone; only ``model.fusion`` is optimised.
        config: the full config (the trainer reads rollout, loss, optim and train).
        device: where the batches go (the model must already be there).
        fusion_runner: the callable evaluated as the fusion in the loss (a DDP wrapper of
            ``model.fusion`` when distributed; default ``model.fusion``).
        rank: data-parallel rank, used to decorrelate the rollout noise.
    """

    def __init__(
        self,
        model: AnchoredBackbone,
        config: PosttrainConfig,
        *,
        device: torch.device | str = "cpu",
        fusion_runner: nn.Module | None = None,
        rank: int = 0,
    ) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.fusion_runner = fusion_runner if fusion_runner is not None else model.fusion
        r = config.rollout
        self.sampler = rollout_sampler(model, config)
        self.schedule = get_schedule(r.schedule)
        o = config.optim
        self.params = [p for p in model.fusion.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = build_lr_scheduler(self.optimizer, warmup_steps=o.warmup_steps, schedule=o.lr_schedule,
                                            max_steps=config.train.max_steps, min_lr_ratio=o.min_lr_ratio)
        self.generator = torch.Generator(device=self.device).manual_seed(config.train.seed * 1000 + rank)
        self.step = 0

    def micro_step(self, batch: CanvasBatch, *, scale: float = 1.0, sync: bool = True) -> PosttrainLoss:
        """Rollout, loss and backward (loss multiplied by ``scale``) on one micro-batch."""
        r, lc = self.config.rollout, self.config.loss
        if self.model.fusion_mode != "paired":
            raise ValueError(f"post-training trains the fusion, but the model's fusion_mode is "
                             f"{self.model.fusion_mode!r} (naive reuse bypasses it); set fusion_mode='paired'")
        batch = batch.to(self.device)
        backbone = self.model.backbone
        sync_context = nullcontext() if sync or not hasattr(self.fusion_runner, "no_sync") else self.fusion_runner.no_sync()
        with autocast_context(self.device, self.config.train.precision):
            prompt, frozen, padding = None, None, None
            x0, token_mask = batch.targets, None if lc.loss_on_padding else batch.target_mask
            if hasattr(backbone, "prefill"):
                with torch.no_grad():
                    prompt = backbone.prefill(batch.context_ids, batch.context_mask)
            elif getattr(backbone, "prompt_in_canvas", False):  # LLaDA, Dream: the prompt goes into the canvas,
                x0, target, padding = batch.whole_sequence()  # never corrupted nor trained on
                frozen = ~target
                token_mask = target if lc.loss_on_padding else target & torch.cat(
                    [batch.context_mask, batch.target_mask], dim=1)
            state = draw_rollout(
                self.model, x0, sampler=self.sampler, schedule=self.schedule, mode=r.mode, prompt=prompt,
                frozen=frozen, attention_mask=padding,
                cache_ages=r.cache_ages, cache_age_probs=r.cache_age_probs, antithetic=r.antithetic,
                self_conditioning_prob=r.self_conditioning_prob if backbone.supports_self_conditioning else 0.0,
                generator=self.generator,
            )
            with sync_context:
                out = posttrain_loss(self.model, state, token_mask=token_mask,
                                     ce_weight=lc.ce_weight, kd_weight=lc.kd_weight, kd_temperature=lc.kd_temperature,
                                     fusion=self.fusion_runner)
                (out.loss * scale).backward()
        return out

    def train_step(self, micro_batches: Sequence[CanvasBatch]) -> dict[str, Any]:
        """One optimiser step over ``micro_batches`` (gradient accumulation); returns metrics."""
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        self.model.train()
        start = time.perf_counter()
        n = len(micro_batches)
        outs = [self.micro_step(batch, scale=1.0 / n, sync=m == n - 1) for m, batch in enumerate(micro_batches)]
        clip = self.config.optim.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else math.inf)  # 0: no clipping
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "step": self.step,
            "loss": sum(float(out.loss.detach()) for out in outs) / n,
            "ce": sum(out.ce for out in outs) / n,
            "kd": sum(out.kd for out in outs) / n,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": sum(out.tokens for out in outs),
            "seconds": time.perf_counter() - start,
        }

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only, so that :func:`~tadm.training.checkpoint.load_training_state` reads it."""
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "fusion": self.model.fusion.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.fusion.load_state_dict(state["fusion"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])


def canvas_batches(
    dataset: Sequence[Any],
    batch_size: int,
    pad_id: int,
    *,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[CanvasBatch]:
    """Endless shuffled batches of this rank's shard; epoch e uses permutation seed ``seed + e``."""
    per_epoch = len(dataset) // (batch_size * world_size)
    if per_epoch < 1:
        raise ValueError(f"{len(dataset)} canvases cannot fill one batch of {batch_size} on each of {world_size} ranks")
    for epoch in itertools.count():
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        shard = order[rank::world_size]
        for b in range(per_epoch):
            yield collate_canvases([dataset[i] for i in shard[b * batch_size : (b + 1) * batch_size]], pad_id)


# ======================================================================================= entry point

def _canvas_dataset(config: PosttrainConfig, backbone: Any) -> tuple[ChatCanvasDataset, int]:
    """The chat JSONL cut into canvases, and the pad id."""
    d = config.data
    try:
        tokenizer = load_hf_tokenizer(d.tokenizer or config.base.path)
    except FileNotFoundError as err:
        if d.tokenizer is not None:
            raise
        raise PosttrainConfigError(f"{err}: set data.tokenizer=DIR, the base model's chat tokenizer") from None
    if not getattr(tokenizer, "chat_template", None):
        raise PosttrainConfigError(
            f"the tokenizer of {d.tokenizer or config.base.path} has no chat template, which post-training needs to "
            "turn each record into prompt and response tokens: give a chat tokenizer (data.tokenizer=DIR); a tadm "
            "base gets one at pretraining with tadm.posttrain.data.make_chat_tokenizer")
    pad_id = d.pad_id if d.pad_id is not None else tokenizer.pad_token_id
    if pad_id is None:
        raise PosttrainConfigError("the tokenizer has no pad token; set data.pad_id")
    if not 0 <= pad_id < len(tokenizer):
        raise PosttrainConfigError(f"data.pad_id {pad_id} is not a token id of the tokenizer (0..{len(tokenizer) - 1})")
    if d.pad_id is not None and pad_id >= backbone.vocab_size:
        raise PosttrainConfigError(f"data.pad_id {pad_id} is not a token id of the base's vocabulary "
                                   f"(0..{backbone.vocab_size - 1})")
    canvas_length = d.canvas_length if d.canvas_length is not None else getattr(backbone, "canvas_length", None)
    if canvas_length is None:
        raise PosttrainConfigError("data.canvas_length is required for backbones without a canvas length")
    examples = read_chat_jsonl(d.train_file, prompt_field=d.prompt_field, response_field=d.response_field)
    dataset = ChatCanvasDataset(examples, tokenizer, canvas_length=canvas_length, pad_id=pad_id,
                                max_prompt_tokens=d.max_prompt_tokens, max_response_tokens=d.max_response_tokens,
                                canvases_per_example=d.canvases_per_example, vocab_size=backbone.vocab_size)
    return dataset, pad_id


def _build_trainer(config: PosttrainConfig, info: DistInfo,
                   base: nn.Module | None = None) -> tuple[PosttrainTrainer, ChatCanvasDataset, int]:
    """Frozen backbone, canvases and pad id, fusion (DDP-wrapped when distributed; the backbone is not) and trainer.

    ``base``: a model the user loaded (LLaDA and Dream, whose code ships with their checkpoints), anchorized here
    with the config's split and fusion unless it is already; else ``config.base.path`` is loaded."""
    torch.manual_seed(config.train.seed)
    if not config.data.train_file:
        raise PosttrainConfigError("data.train_file is empty: give the chat JSONL to train on")
    split, fusion = SplitSpec(**asdict(config.split)), FusionSpec(**asdict(config.fusion))
    if base is not None:
        kind = find_architecture(base).name
        if kind != config.base.backbone:
            raise PosttrainConfigError(f"base.backbone is {config.base.backbone!r} but the given model is a {kind!r} "
                                       f"model; set base.backbone={kind}")
        served = base if is_anchorized(base) else anchorize(base, split, fusion, base_model=config.base.path)
        model = served.to(info.device).stage_view()
        dataset, pad_id = _canvas_dataset(config, model.backbone)
    elif config.base.backbone == "diffusion-gemma":
        # The fusion trains inside the model class that serves it: the time-anchored DiffusionGemma, seen stage by
        # stage (its stage view shares its layers and fusion).
        # by name: hf_model subclasses a transformers model (an optional extra), loaded for a DiffusionGemma only
        load_time_anchored = importlib.import_module("tadm.posttrain.hf_model").load_time_anchored
        served, _ = load_time_anchored(config.base.path, split=split, fusion=fusion, dtype=config.base.dtype,
                                       device=info.device)
        model = served.stage_view()
        dataset, pad_id = _canvas_dataset(config, model.backbone)
    else:
        backbone = load_backbone(config.base.backbone, config.base.path, dtype=config.base.dtype, device=info.device)
        if backbone.prior not in ROLLOUT_PRIORS:
            raise PosttrainConfigError(
                f"base.backbone {config.base.backbone} cannot be post-trained: the rollouts corrupt canvases with "
                f"uniform noise or masks ({', '.join(ROLLOUT_PRIORS)}), and this backbone's prior is {backbone.prior!r}")
        dataset, pad_id = _canvas_dataset(config, backbone)
        model = AnchoredBackbone(backbone, split, fusion)
    model.fusion.to(info.device)
    runner = wrap_model(model.fusion, info)  # every fusion parameter takes part in every step
    trainer = PosttrainTrainer(model, config, device=info.device, fusion_runner=runner, rank=info.rank)
    return trainer, dataset, pad_id


def _save(trainer: PosttrainTrainer, adapter_dir: Path) -> None:
    """Write the resolved config, the adapter and the training state, each atomically; called on rank 0 only.

    The config comes first, so that a training state to resume from always has its config beside it."""
    config = trainer.config
    write_text(adapter_dir / CONFIG_FILENAME, OmegaConf.to_yaml(OmegaConf.structured(config)))
    extra = {"step": trainer.step, "config": config.to_dict()}
    save_adapter(adapter_dir, trainer.model, base_model=config.base.path, extra=extra)
    save_training_state(trainer.state_dict(), adapter_dir / STATE_FILENAME)


def _saved_config(path: Path, state_path: Path) -> dict[str, Any]:
    """The config a run was saved with (``posttrain_config.yaml``); a one-line error naming the file when it is not
    a whole config (a copy cut off or damaged outside tadm, whose own writes are atomic)."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:  # YAML and OmegaConf raise many types; every one means "not a config"
        saved, problem = None, first_line(err)
    else:
        missing = [key for key in RESUME_FIXED if not _has_key(saved, key)]
        problem = (f"it holds {type(saved).__name__}, not a mapping of sections" if not isinstance(saved, dict) else
                   "it is empty" if not saved else f"it lacks {', '.join(missing)}" if missing else None)
    if problem is not None:
        raise PosttrainConfigError(f"cannot resume: {path} is corrupt or truncated ({problem}); restore it (the run's "
                                   f"config is also under 'extra.config' in {path.parent / ADAPTER_CONFIG_NAME}) or "
                                   f"start over with another train.out_dir (the training state is {state_path})")
    return saved


def _has_key(tree: Any, dotted: str) -> bool:
    """Whether the nested mapping ``tree`` holds the dotted key ``dotted`` (``"base.path"``)."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def run_posttrain(config: PosttrainConfig, *, log: Callable[[str], None] = print, model: nn.Module | None = None) -> Path:
    """Post-train a fusion as ``config`` says; returns the adapter directory (``out_dir/adapter``).

    ``model``: a base loaded by the user (required for LLaDA and Dream, whose code ships with the checkpoint;
    ``base.backbone`` must name its architecture and ``base.path`` is recorded as its name), anchorized in place
    with the config's split and fusion (or as it is, if anchorized already); the trained fusion is its fusion.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) each rank trains on its shard and gradients of the fusion
    are averaged by DDP. With ``train.resume`` a run continues from ``out_dir/adapter/training_state.pt``
    (read with ``weights_only=True``: a file holding other objects is refused). Metrics go to
    ``out_dir/metrics.jsonl`` (records ``{"step", "split": "train", "loss", "ce", "kd", ...}``) and the
    other ``train.loggers`` (TensorBoard in ``out_dir/tensorboard``, W&B), as in pretraining. As there too,
    ``train.out_dir`` is locked for the whole call (``.tadm.lock``): a second run on it is refused, naming the
    holder, before it reads or writes anything.
    """
    out_dir = Path(config.train.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise PosttrainConfigError(f"train.out_dir {str(out_dir)!r} is an existing file; choose another train.out_dir")
    info = init_distributed(config.train.device)
    try:
        # one run per out_dir: a second one is refused (naming the holder) before it reads or writes anything
        with claim_run_dir(out_dir, info):
            return _run_claimed(config, info, log, model)
    finally:
        cleanup(info)


def _state_to_resume(config: PosttrainConfig, info: DistInfo) -> dict[str, Any] | None:
    """The training state a run continues from (None for a fresh run), once the checks that it may have passed."""
    t = config.train
    out_dir = Path(t.out_dir)
    adapter_dir = out_dir / "adapter"
    state_path = adapter_dir / STATE_FILENAME
    if not t.resume and state_path.is_file():
        raise PosttrainConfigError(f"train.out_dir {str(out_dir)!r} already holds a post-training run and "
                                   f"train.resume=false would overwrite it; delete {adapter_dir} to start afresh, or "
                                   "choose another train.out_dir")
    if info.is_main:
        remove_stale_temporaries(adapter_dir)  # leftovers of saves killed midway
    # Refused before anything is built when it holds anything but tensors and plain values (UnsafeStateError).
    state = load_training_state(state_path) if t.resume and state_path.is_file() else None
    saved_config = adapter_dir / CONFIG_FILENAME
    if state is not None and saved_config.is_file():
        check_resumable(_saved_config(saved_config, state_path), config.to_dict(), RESUME_FIXED,
                        state_path, PosttrainConfigError, "; start over with another train.out_dir")
    if state is not None and int(state.get("step", 0)) > t.max_steps:
        raise PosttrainConfigError(f"the run in {str(out_dir)!r} has done {int(state['step'])} steps, more than "
                                   f"train.max_steps={t.max_steps}; its adapter is in {adapter_dir} (to continue, "
                                   "raise train.max_steps)")
    return state


def _run_claimed(config: PosttrainConfig, info: DistInfo, log: Callable[[str], None],
                 model: nn.Module | None = None) -> Path:
    """:func:`run_posttrain` once ``train.out_dir`` is held."""
    t = config.train
    out_dir = Path(t.out_dir)
    adapter_dir = out_dir / "adapter"
    state = _state_to_resume(config, info)
    trainer, dataset, pad_id = _build_trainer(config, info, model)
    if state is not None:
        trainer.load_state_dict(state)
        log(f"resumed from {adapter_dir / STATE_FILENAME} at step {trainer.step}")
    batches = canvas_batches(dataset, t.micro_batch_size, pad_id, seed=t.seed, rank=info.rank,
                             world_size=info.world_size)
    for _ in range(trainer.step * t.grad_accum_steps):  # replay the data order up to the resume point
        next(batches)
    if info.is_main:
        split = trainer.model.layer_split
        log(f"post-training {sum(p.numel() for p in trainer.model.fusion.parameters()):,} fusion parameters on "
            f"{len(dataset)} canvases (split {split.shared}/{split.anchor}/{split.denoiser})")
    # Rank 0 writes metrics.jsonl and the other train.loggers; on resume, records after its step are dropped.
    metrics = MetricsLogger(out_dir, enabled=info.is_main, loggers=t.loggers,
                            resume_step=trainer.step if state is not None else None, notice=log,
                            wandb_project=t.wandb_project, config=config.to_dict())
    # a progress bar on a terminal (rank 0); elsewhere (a log file, a pipe) one line per log_every steps
    bar = tqdm(total=t.max_steps, initial=trainer.step, unit="step", desc="posttrain", dynamic_ncols=True,
               disable=None if info.is_main else True)
    try:
        while trainer.step < t.max_steps:
            values = trainer.train_step([next(batches) for _ in range(t.grad_accum_steps)])
            tokens_per_s = values["tokens"] / max(values["seconds"], 1e-9)
            bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            bar.update(1)
            if info.is_main and (trainer.step % t.log_every == 0 or trainer.step == 1):
                metrics.log(trainer.step, "train", {k: v for k, v in values.items() if k != "step"})
                if bar.disable:
                    log(f"step {trainer.step}/{t.max_steps} | loss {values['loss']:.4f} (ce {values['ce']:.4f}, "
                        f"kd {values['kd']:.4f}) | lr {values['lr']:.2e} | {tokens_per_s:,.0f} tok/s")
            if info.is_main and trainer.step % t.save_every == 0:
                _save(trainer, adapter_dir)
        if info.is_main:
            _save(trainer, adapter_dir)
    finally:
        bar.close()
        metrics.close()
    barrier(info)
    return adapter_dir
