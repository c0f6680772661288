"""TADM:Post-train configuration: the schema of ``tadm posttrain`` presets and its validation.

Sections: ``base`` (the frozen pretrained model), ``split`` (S / A / D layer counts), ``fusion``
(paired-attention size), ``rollout`` (cache ages and the sampler shared with inference), ``loss``
(weights of Eq. (anchor-sft-objective)), ``data`` (chat JSONL to canvases), ``optim`` (the
pretraining optimiser section with the appendix's post-training values) and ``train`` (loop length,
batching, precision, checkpoints). Loaded by :func:`load_posttrain_config`: defaults <- YAML <- overrides.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from tadm.config import (ConfigError, OptimSection, RecipeConfig, check_loggers, check_range, check_seed,
                         list_presets,
                         load_structured, resolve_config_path, validate_optim)
from tadm.diffusion import get_schedule
from tadm.posttrain.rollout import ROLLOUT_MODES
from tadm.sampling.entropy_bound import EntropyBoundSamplerConfig
from tadm.sampling.registry import SAMPLERS
from tadm.training.precision import PRECISIONS

__all__ = ["ChatDataSection", "DistillLossSection", "FrozenBaseSection", "FusionSection", "LayerSplitSection",
           "PosttrainConfig", "PosttrainConfigError", "PosttrainLoopSection", "PosttrainOptimSection", "RolloutSection",
           "load_posttrain_config"]


class PosttrainConfigError(ConfigError):
    """A post-training configuration problem; the message names the key."""


@dataclass
class FrozenBaseSection:
    """The frozen pretrained model."""

    path: str = "google/diffusiongemma-26B-A4B-it"  # checkpoint directory or hub id
    backbone: str = "diffusion-gemma"  # adapter kind, see tadm.posttrain.backbone.BACKBONES
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU


@dataclass
class LayerSplitSection:
    """Layer counts of S / A / D (paper, 30 layers: 2 / 20 / 8)."""

    shared_layers: int = 2
    anchor_layers: int = 20
    denoiser_layers: Optional[int] = 8


@dataclass
class FusionSection:
    """Paired-attention fusion size (paper: rank 256, 4 heads, gate bias -3)."""

    rank: int = 256
    num_heads: int = 4
    gate_bias: float = -3.0
    eps: float = 1e-6


@dataclass
class RolloutSection:
    """Rollout construction and the sampler it shares with inference."""

    cache_ages: list[int] = field(default_factory=lambda: [0, 1, 2])
    cache_age_probs: list[float] = field(default_factory=lambda: [0.34, 0.33, 0.33])
    sampler: EntropyBoundSamplerConfig = field(default_factory=EntropyBoundSamplerConfig)  # T = sampler.num_steps
    schedule: str = "loglinear"  # alpha_t of the uniform forward process for z_t'
    antithetic: bool = True
    self_conditioning_prob: float = 0.5
    mode: str = "on-policy"  # "on-policy" (the paper's rollouts) or "forward" (canvases of the forward process)
    # the sampler of an absorbing backbone's rollouts (llada, dream-origin, ..., mdlm; default: the family's own),
    # run with T = sampler.num_steps and one step index per row; the entropy-bound options above are not read
    masked_sampler: Optional[str] = None


@dataclass
class DistillLossSection:
    """Weights of Eq. (anchor-sft-objective)."""

    ce_weight: float = 1.0
    kd_weight: float = 1.0  # lambda_KD
    kd_temperature: float = 1.0
    loss_on_padding: bool = False  # also train the padding after a reply's end


@dataclass
class ChatDataSection:
    """Chat JSONL and how it becomes canvases."""

    train_file: str = ""
    tokenizer: Optional[str] = None  # default: base.path
    prompt_field: str = "prompt"
    response_field: str = "response"
    max_prompt_tokens: int = 2048
    max_response_tokens: int = 2048
    canvases_per_example: int = 8
    canvas_length: Optional[int] = None  # default: the backbone's canvas length
    pad_id: Optional[int] = None  # default: the tokenizer's pad id


@dataclass
class PosttrainOptimSection(OptimSection):
    """AdamW and its schedule with the appendix's post-training values (lr 1.5e-4, betas (0.95, 0.99),
    weight decay 1e-4, 100 warm-up steps, cosine decay to 0.1 of the peak); same keys as pretraining's."""

    lr: float = 1.5e-4
    betas: list[float] = field(default_factory=lambda: [0.95, 0.99])
    weight_decay: float = 1e-4
    warmup_steps: int = 100
    lr_schedule: str = "cosine"


@dataclass
class PosttrainLoopSection:
    """Loop length, batching, precision, checkpoints and logging.

    ``loggers`` and ``wandb_project`` mean what they mean in pretraining's ``train`` section
    (:class:`tadm.config.TrainSection`): ``out_dir/metrics.jsonl`` is always written, and
    ``tensorboard`` / ``wandb`` mirror it through the same :class:`~tadm.training.metrics.MetricsLogger`.
    """

    max_steps: int = 18750
    micro_batch_size: int = 1  # per device
    grad_accum_steps: int = 4
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    device: str = "auto"
    seed: int = 42
    out_dir: str = "runs/posttrain"
    log_every: int = 10
    save_every: int = 1000
    resume: bool = True
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # any of tadm.config.LOGGERS; jsonl always
    wandb_project: str = "tadm"


@dataclass
class PosttrainConfig(RecipeConfig):
    base: FrozenBaseSection = field(default_factory=FrozenBaseSection)
    split: LayerSplitSection = field(default_factory=LayerSplitSection)
    fusion: FusionSection = field(default_factory=FusionSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    loss: DistillLossSection = field(default_factory=DistillLossSection)
    data: ChatDataSection = field(default_factory=ChatDataSection)
    optim: PosttrainOptimSection = field(default_factory=PosttrainOptimSection)
    train: PosttrainLoopSection = field(default_factory=PosttrainLoopSection)


def _validate(cfg: PosttrainConfig) -> None:
    def positive(name: str, value: float) -> None:
        if value <= 0:
            raise PosttrainConfigError(f"{name} must be > 0, got {value!r}")

    ages, probs = list(cfg.rollout.cache_ages), list(cfg.rollout.cache_age_probs)
    if not ages or len(ages) != len(probs):
        raise PosttrainConfigError(
            f"rollout.cache_ages {ages} and rollout.cache_age_probs {probs} must be non-empty and equally long"
        )
    if any(a < 0 or a >= cfg.rollout.sampler.num_steps for a in ages):
        raise PosttrainConfigError(f"rollout.cache_ages must lie in 0..rollout.sampler.num_steps-1, got {ages}")
    for n, p in enumerate(probs):
        check_range(f"rollout.cache_age_probs[{n}]", p, 0.0, error=PosttrainConfigError)
    if sum(probs) <= 0:
        raise PosttrainConfigError(f"rollout.cache_age_probs must be >= 0 with a positive sum, got {probs}")
    check_range("rollout.self_conditioning_prob", cfg.rollout.self_conditioning_prob, 0.0, 1.0,
                error=PosttrainConfigError)
    if cfg.rollout.mode not in ROLLOUT_MODES:
        raise PosttrainConfigError(f"rollout.mode {cfg.rollout.mode!r} is unknown; valid: {', '.join(ROLLOUT_MODES)}")
    masked = cfg.rollout.masked_sampler
    if masked is not None and (masked not in SAMPLERS or SAMPLERS[masked].needs != "mask_id"):
        valid = ", ".join(name for name, entry in SAMPLERS.items() if entry.needs == "mask_id")
        raise PosttrainConfigError(f"rollout.masked_sampler {masked!r} is not a masked sampler; valid: {valid}")
    try:
        get_schedule(cfg.rollout.schedule)
    except ValueError as err:
        raise PosttrainConfigError(f"rollout.schedule: {err}") from None
    if sum(p for a, p in zip(ages, probs) if a > 0) <= 0:
        raise PosttrainConfigError(f"rollout.cache_age_probs {probs} give ages > 0 no probability, and at age 0 (a "
                                   "fresh anchor) the fusion returns the anchor unchanged: nothing would be trained")
    for name in ("ce_weight", "kd_weight"):
        check_range(f"loss.{name}", getattr(cfg.loss, name), 0.0, error=PosttrainConfigError)
    if cfg.loss.ce_weight + cfg.loss.kd_weight <= 0:
        raise PosttrainConfigError("loss.ce_weight and loss.kd_weight are both 0: nothing would be trained")
    check_range("loss.kd_temperature", cfg.loss.kd_temperature, 0.0, low_open=True, error=PosttrainConfigError)
    for name in ("rank", "num_heads"):
        positive(f"fusion.{name}", getattr(cfg.fusion, name))
    check_range("fusion.gate_bias", cfg.fusion.gate_bias, error=PosttrainConfigError)  # any finite number
    check_range("fusion.eps", cfg.fusion.eps, 0.0, low_open=True, error=PosttrainConfigError)
    if cfg.fusion.rank % cfg.fusion.num_heads:
        raise PosttrainConfigError(f"fusion.rank {cfg.fusion.rank} must be divisible by fusion.num_heads {cfg.fusion.num_heads}")
    for name in ("max_prompt_tokens", "max_response_tokens", "canvases_per_example"):
        positive(f"data.{name}", getattr(cfg.data, name))
    if cfg.data.canvas_length is not None and cfg.data.canvas_length < 1:
        raise PosttrainConfigError(f"data.canvas_length must be null (the base's canvas length) or an integer >= 1, "
                                   f"got {cfg.data.canvas_length!r}")
    validate_optim(cfg.optim, error=PosttrainConfigError)
    for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_every", "save_every"):
        positive(f"train.{name}", getattr(cfg.train, name))
    if cfg.train.precision not in PRECISIONS:
        valid = ", ".join(PRECISIONS)
        raise PosttrainConfigError(f"train.precision {cfg.train.precision!r} is unknown; valid: {valid}")
    check_loggers("train.loggers", cfg.train.loggers, error=PosttrainConfigError)
    check_seed("train.seed", cfg.train.seed, error=PosttrainConfigError)
    if not cfg.train.wandb_project.strip():
        raise PosttrainConfigError("train.wandb_project must not be empty")


def load_posttrain_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> PosttrainConfig:
    """Defaults <- YAML preset at ``path`` <- ``key=value`` overrides; unknown keys and bad types fail by name."""
    resolve = partial(resolve_config_path, presets=partial(list_presets, posttrain=True), kind="post-training")
    return load_structured(PosttrainConfig, path, overrides, error=PosttrainConfigError, validate=_validate,
                           resolve=resolve)
