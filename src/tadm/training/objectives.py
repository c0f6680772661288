"""Pretraining objectives, one per architecture: ``objective(model, x, generator, cfg) -> LossOutput``.

Every objective draws its own noise from ``generator``, runs the model once and returns a scalar
loss normalised per token as MDLM does: the per-token losses of the batch summed and divided by
the number of tokens B * L (B * (L - 1) for the autoregressive model). With ``rows`` (a slice of
the batch) the noise is still drawn for all B rows, then only those rows are run and scored: the
losses of pieces of a batch, weighted by their ``num_tokens``, add up to the whole batch's loss,
so validation can score a large batch in pieces without changing its number. For the diffusion models
this is a one-sample Monte-Carlo estimate of the continuous-time NELBO in nats per token, so
``exp(loss)`` averaged over batches bounds the perplexity.

* ``"tadm"``: the T-ANELBO of Theorem (T-ANELBO) with a stale anchor (appendix "TADM:Pretrain").
* ``"mdlm"``: the masked-diffusion NELBO, Eq. (masked-nelbo) in continuous time.
* ``"adlm"``: the ANELBO, Eq. (anelbo-old): NELBO of the two-stage model plus ``gamma`` times the
  anchor network's cross-entropy on rare clean tokens (see :func:`rare_token_mask`).
* ``"ar"``: next-token cross-entropy.

The model may be wrapped (``DistributedDataParallel``); it is always called through the wrapper so
that gradients synchronise, and its attributes are read from ``model.module``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from tadm.diffusion import (NoiseSchedule, further_mask, get_schedule, mask_corrupt, masked_diffusion_loss,
                            sample_stale_anchor_times, sample_t, t_anelbo_loss)

__all__ = ["OBJECTIVES", "LossOutput", "Objective", "ObjectiveConfig", "adlm_objective", "ar_objective",
           "get_objective", "mdlm_objective", "rare_token_mask", "tadm_objective", "validation_config"]


@dataclass(frozen=True)
class ObjectiveConfig:
    """Settings of the pretraining objectives (appendix "TADM:Pretrain", training details).

    Attributes:
        schedule: noise schedule name ("loglinear", "linear", "cosine").
        eps: t ~ U(eps, 1).
        antithetic: stratify t across the batch.
        gamma: anchor-loss weight (TADM and ADLM); 0 turns the anchor term off.
        refresh_intervals: candidate anchor refresh intervals K (TADM); (1,) means fresh anchors.
        step_budgets: candidate sampling budgets T (TADM).
        anchor_token_mask: (V,) bool, True for ids that count as anchor tokens (ADLM); None: all.
    """

    schedule: str = "loglinear"
    eps: float = 1e-3
    antithetic: bool = True
    gamma: float = 0.0
    refresh_intervals: tuple[int, ...] = (1, 2, 4, 8)
    step_budgets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    anchor_token_mask: Tensor | None = field(default=None, compare=False)


@dataclass
class LossOutput:
    """What an objective returns."""

    loss: Tensor  # () differentiable loss per token
    num_tokens: int  # tokens the loss is normalised by
    parts: dict[str, Tensor] = field(default_factory=dict)  # () detached per-token parts, for logging
    tensors: dict[str, Tensor] = field(default_factory=dict)  # detached intermediates (z_t, t, ...), for inspection


class Objective(Protocol):
    """``objective(model, x (B, L) clean ids, generator, cfg, rows=None) -> LossOutput`` (of ``x[rows]``)."""

    def __call__(
        self, model: nn.Module, x: Tensor, generator: torch.Generator | None, cfg: ObjectiveConfig,
        rows: slice | None = None,
    ) -> LossOutput: ...


def _unwrap(model: nn.Module) -> nn.Module:
    """The network inside a DistributedDataParallel wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _mask_id(model: nn.Module) -> int:
    mask_id = getattr(_unwrap(model), "mask_token_id", None)
    if mask_id is None:
        raise ValueError(f"{type(_unwrap(model)).__name__} has no mask token: it is not a masked diffusion model")
    return int(mask_id)


def _take(rows: slice | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` cut to the batch rows ``rows`` (all of them when None); each is (B, ...)."""
    return tensors if rows is None else tuple(t[rows] for t in tensors)


def _per_token_mean(per_token: Tensor) -> Tensor:
    return per_token.sum() / per_token.numel()


def _schedule_mask_and_t(model: nn.Module, x: Tensor, generator: torch.Generator | None,
                         cfg: ObjectiveConfig) -> tuple[NoiseSchedule, int, Tensor]:
    """What every masked diffusion objective starts with: its schedule, the mask id and t ~ U(eps, 1), (B,)."""
    schedule, mask_id = get_schedule(cfg.schedule), _mask_id(model)
    return schedule, mask_id, sample_t(x.shape[0], cfg.eps, cfg.antithetic, generator, device=x.device)


def _anchored_output(total: Tensor, diffusion: Tensor, anchor: Tensor, x: Tensor, **tensors: Tensor) -> LossOutput:
    """The output of an objective with an anchor term, from its (B, L) total, diffusion and anchor losses."""
    parts = {"diffusion": _per_token_mean(diffusion).detach(), "anchor": _per_token_mean(anchor).detach()}
    return LossOutput(loss=_per_token_mean(total), num_tokens=x.numel(), parts=parts, tensors=tensors)


def tadm_objective(
    model: nn.Module, x: Tensor, generator: torch.Generator | None, cfg: ObjectiveConfig,
    rows: slice | None = None,
) -> LossOutput:
    """T-ANELBO with a stale anchor, Theorem (T-ANELBO) with sigma = 0 in continuous time.

    t ~ U(eps, 1) (antithetic); K, T and the cache age k ~ U{0..K-1} give t' = min(1, t + k / T);
    z_t ~ q(z_t | x) by Eq. (fwd); z_t' ~ q(z_t' | z_t) by Eq. (fwd_t_t'), so its masks contain those
    of z_t; the denoiser predicts x from z_t with the anchor computed from z_t'. With gamma > 0 the
    anchor LM head is trained on the clean tokens at the positions masked in z_t', weighted by
    loss_weight(t') (anchor-token selection of section "TADM:Pretraining").

    Args:
        model: a :class:`tadm.nn.TADM` (possibly DDP-wrapped); with gamma > 0 it needs its anchor LM head.
        x: (B, L) clean token ids.
        generator: source of every random draw here.
        cfg: objective settings.
        rows: score only these rows of the batch (the noise is drawn for all of them).

    Returns:
        LossOutput with parts "diffusion" and "anchor" and tensors z_t, z_tp, t, t_anchor.
    """
    schedule, mask_id, t = _schedule_mask_and_t(model, x, generator, cfg)
    times = sample_stale_anchor_times(t, cfg.refresh_intervals, cfg.step_budgets, generator)
    alpha_t = schedule.alpha(times.t)  # (B,)
    alpha_tp = schedule.alpha(times.t_anchor)  # (B,)
    z_t = mask_corrupt(x, alpha_t, mask_id, generator)  # (B, L)
    z_tp = further_mask(z_t, alpha_t, alpha_tp, mask_id, generator)  # (B, L)
    x, z_t, z_tp, t, t_anchor, cache_age = _take(rows, x, z_t, z_tp, times.t, times.t_anchor, times.cache_age)
    out = model(z_t, z_anchor=z_tp, t=t, t_anchor=t_anchor)
    if cfg.gamma > 0 and out.anchor_log_probs is None:
        raise ValueError("objective.gamma > 0 needs a TADM built with anchor_lm_head=True")
    terms = t_anelbo_loss(
        out.log_probs,
        x,
        z_t,
        t,
        schedule,
        mask_id,
        anchor_log_probs=out.anchor_log_probs,
        z_tp=z_tp,
        t_anchor=t_anchor,
        gamma=cfg.gamma,
    )
    return _anchored_output(terms.total, terms.diffusion, terms.anchor, x, z_t=z_t, z_tp=z_tp, t=t,
                            t_anchor=t_anchor, cache_age=cache_age)


def mdlm_objective(
    model: nn.Module, x: Tensor, generator: torch.Generator | None, cfg: ObjectiveConfig,
    rows: slice | None = None,
) -> LossOutput:
    """Continuous-time masked NELBO of MDLM (Eq. (masked-nelbo) as T -> infinity).

    Args:
        model: a :class:`tadm.nn.MDLM` (possibly DDP-wrapped), ``model(z_t, t) -> (B, L, V)`` log-probs.
        x: (B, L) clean ids.
        generator: source of the t and mask draws.
        cfg: objective settings (schedule, eps, antithetic).
        rows: score only these rows of the batch (the noise is drawn for all of them).
    """
    schedule, mask_id, t = _schedule_mask_and_t(model, x, generator, cfg)
    z_t = mask_corrupt(x, schedule.alpha(t), mask_id, generator)  # (B, L)
    x, z_t, t = _take(rows, x, z_t, t)
    log_probs = model(z_t, t)  # (B, L, V)
    per_token = masked_diffusion_loss(log_probs, x, z_t, t, schedule, mask_id)  # (B, L)
    loss = _per_token_mean(per_token)
    return LossOutput(loss=loss, num_tokens=x.numel(), parts={"diffusion": loss.detach()}, tensors={"z_t": z_t, "t": t})


def adlm_objective(
    model: nn.Module, x: Tensor, generator: torch.Generator | None, cfg: ObjectiveConfig,
    rows: slice | None = None,
) -> LossOutput:
    """ANELBO of ADLM, Eq. (anelbo-old) in continuous time, with fresh anchors (t' = t).

    diffusion^l = loss_weight(t) (-log <x_theta(z_t), x^l>) at masked positions;
    anchor^l    = loss_weight(t) (-log <y_A(z_t), x^l>)     at masked positions whose clean token
    is an anchor token (``cfg.anchor_token_mask[x^l]``, all tokens when the mask is None);
    loss = mean over tokens of diffusion + gamma * anchor.

    Args:
        model: a :class:`tadm.nn.ADLM` (possibly DDP-wrapped), ``model(z_t, t) -> (log_probs, anchor_log_probs)``.
        x: (B, L) clean ids.
        generator: source of the t and mask draws.
        cfg: objective settings; ``anchor_token_mask`` selects the anchor tokens.
        rows: score only these rows of the batch (the noise is drawn for all of them).
    """
    schedule, mask_id, t = _schedule_mask_and_t(model, x, generator, cfg)
    z_t = mask_corrupt(x, schedule.alpha(t), mask_id, generator)  # (B, L)
    x, z_t, t = _take(rows, x, z_t, t)
    log_probs, anchor_log_probs = model(z_t, t)  # (B, L, V) each
    diffusion = masked_diffusion_loss(log_probs, x, z_t, t, schedule, mask_id)  # (B, L)
    anchor = masked_diffusion_loss(anchor_log_probs, x, z_t, t, schedule, mask_id)  # (B, L)
    if cfg.anchor_token_mask is not None:
        is_anchor = cfg.anchor_token_mask.to(x.device)[x]  # (B, L)
        anchor = torch.where(is_anchor, anchor, torch.zeros((), dtype=anchor.dtype, device=anchor.device))
    total = diffusion + cfg.gamma * anchor if cfg.gamma > 0 else diffusion
    return _anchored_output(total, diffusion, anchor, x, z_t=z_t, t=t)


def ar_objective(
    model: nn.Module, x: Tensor, generator: torch.Generator | None, cfg: ObjectiveConfig,
    rows: slice | None = None,
) -> LossOutput:
    """Next-token cross-entropy: position i predicts x[i + 1]; mean over the B * (L - 1) predictions
    (of the rows ``rows`` only, when given).

    ``generator`` and ``cfg`` are unused (the objective is deterministic given the model).
    """
    (x,) = _take(rows, x)
    B, L = x.shape
    if L < 2:
        raise ValueError(f"the autoregressive objective needs sequences of at least 2 tokens, got L={L}")
    logits = model(x)  # (B, L, V)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
    return LossOutput(loss=loss, num_tokens=B * (L - 1), parts={"nll": loss.detach()})


OBJECTIVES: dict[str, Objective] = {
    "tadm": tadm_objective,
    "mdlm": mdlm_objective,
    "adlm": adlm_objective,
    "ar": ar_objective,
}


def get_objective(arch: str) -> Objective:
    """The objective of architecture ``arch`` ("tadm", "mdlm", "adlm", "ar")."""
    try:
        return OBJECTIVES[arch]
    except KeyError:
        raise ValueError(f"no objective for architecture {arch!r}; valid: {', '.join(OBJECTIVES)}") from None


def validation_config(cfg: ObjectiveConfig) -> ObjectiveConfig:
    """The settings validation uses: the plain NELBO (gamma = 0) with fresh anchors (K = 1).

    The validation loss then bounds the model's own negative log-likelihood per token for every
    architecture, so TADM, MDLM and ADLM numbers are comparable.
    """
    return replace(cfg, gamma=0.0, refresh_intervals=(1,))


def rare_token_mask(counts: Tensor, common_mass: float, exclude: Sequence[int] = ()) -> Tensor:
    """ADLM's anchor tokens: ids outside the most frequent ones that cover ``common_mass`` of the corpus.

    Ids are sorted by count (descending, ties by id); the "common" set is the shortest prefix whose
    counts sum to at least ``common_mass`` of all tokens. Every other id is an anchor ("rare") token,
    except the ids in ``exclude`` (BOS/EOS, the mask), which never are. ``common_mass = 1`` leaves only
    unseen ids as anchors.

    Args:
        counts: (V,) token counts of the training split.
        common_mass: share of the tokens covered by the common set, in (0, 1].
        exclude: ids that are never anchor tokens.

    Returns:
        (V,) bool, True for anchor tokens.
    """
    if counts.dim() != 1:
        raise ValueError(f"counts must be a (V,) tensor, got shape {tuple(counts.shape)}")
    if not 0.0 < common_mass <= 1.0:
        raise ValueError(f"common_mass must be in (0, 1], got {common_mass}")
    counts = counts.to(torch.float64)
    total = counts.sum()
    rare = torch.ones(counts.shape[0], dtype=torch.bool)
    if total > 0:
        order = torch.sort(-counts, stable=True).indices  # (V,) most frequent first, ties by id
        covered = torch.cumsum(counts[order], 0)  # (V,)
        n_common = int(torch.searchsorted(covered, common_mass * total).item()) + 1
        rare[order[:n_common]] = False
    for i in exclude:
        rare[int(i)] = False
    return rare
