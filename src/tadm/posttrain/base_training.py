"""Pretraining a small block-diffusion base model from scratch, so that post-training has a base to split.

The paper post-trains a released DiffusionGemma. Without one (CPU demonstrations, tests, the laptop
task), a random ``DiffusionGemmaForBlockDiffusion`` is first taught the data through its own
``forward`` on (context, canvas) pairs: each canvas is corrupted with uniform noise, Eq. (fwd) with
pi = 1/V, at t ~ U(eps, 1) (antithetic) and the loss is either

* ``"ce"``: the flat cross-entropy of the clean canvas, averaged over response tokens; or
* ``"usdm"``: the uniform-state NELBO integrand, Eq. (usdm-continuous-nelbo), whose weight
  -alpha'_t / (V alpha_t) puts almost all of the signal on the noisiest times. Within a CPU budget
  it leaves the model a context-free unigram predictor, so ``"ce"`` is the default.

Self-conditioning is trained as DiffusionGemma's recipe does: with probability 0.5 per row, a first
pass without gradients supplies the logits the second pass conditions on. Optimisation: AdamW
(lr 3e-3, betas (0.9, 0.98), no weight decay), linear warm-up over 5 % of the steps, then cosine
decay to 0.1 of the peak, gradient clipping at norm 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tadm.diffusion import get_schedule, sample_t, uniform_corrupt, usdm_loss
from tadm.posttrain.data import CanvasBatch

__all__ = ["BASE_OBJECTIVES", "pretrain_block_diffusion"]

BASE_OBJECTIVES = ("ce", "usdm")


def _lr_factor(step: int, steps: int) -> float:
    """Warm-up over 5 % of the steps, then cosine decay to 0.1 of the peak."""
    warmup = max(1, steps // 20)
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))


def pretrain_block_diffusion(
    model: nn.Module,
    batches: Iterator[CanvasBatch],
    *,
    steps: int,
    seed: int,
    objective: str = "ce",
    lr: float = 3e-3,
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """Train ``model`` (a ``DiffusionGemmaForBlockDiffusion``) for ``steps`` batches; returns the loss per step.

    Args:
        model: the block-diffusion LM, trained in place and left in eval mode.
        batches: (context, canvas) batches, e.g. :func:`tadm.posttrain.canvas_batches`.
        steps: optimiser steps (one batch each).
        seed: seed of the noise (times, corruption and self-conditioning rows use ``seed + 1``).
        objective: ``"ce"`` or ``"usdm"`` (module docstring).
        lr: peak learning rate.
        log: called ten times over the run with the recent mean loss.
    """
    if objective not in BASE_OBJECTIVES:
        raise ValueError(f"objective {objective!r} is unknown; valid: {', '.join(BASE_OBJECTIVES)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    V = model.config.text_config.vocab_size
    schedule = get_schedule("loglinear")
    generator = torch.Generator().manual_seed(seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
    model.train()
    history: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        batch = next(batches)
        B = batch.batch_size
        t = sample_t(B, eps=1e-3, generator=generator)  # (B,)
        z_t = uniform_corrupt(batch.targets, schedule.alpha(t.double()).float(), V, generator)  # (B, L)
        inputs = dict(
            input_ids=batch.context_ids,
            attention_mask=batch.context_mask,
            decoder_input_ids=z_t,
            decoder_attention_mask=F.pad(batch.context_mask, (0, z_t.shape[1]), value=True),
        )
        sc_rows = torch.rand(B, generator=generator) < 0.5  # (B,) rows that self-condition
        sc_logits = None
        if bool(sc_rows.any()):
            with torch.no_grad():
                sc_logits = model(**inputs).logits.detach()  # (B, L, V)
        logits = model(**inputs, self_conditioning_logits=sc_logits,
                       self_conditioning_mask=sc_rows if sc_logits is not None else None).logits  # (B, L, V)
        if objective == "usdm":
            per_token = usdm_loss(logits.float().softmax(-1), batch.targets, z_t, t, schedule, V)  # (B, L)
        else:
            per_token = F.cross_entropy(logits.float().transpose(1, 2), batch.targets, reduction="none")  # (B, L)
        mask = batch.target_mask.float()
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(loss.item())
        if log is not None and (step + 1) % max(1, steps // 10) == 0:
            recent = history[-50:]
            log(f"  pretrain step {step + 1}/{steps}: {objective} loss {sum(recent) / len(recent):.3f} "
                f"({time.perf_counter() - start:.0f}s)")
    model.eval()
    return history
