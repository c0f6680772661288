"""How far a stale anchor moves the prediction from the fresh one, with and without the fusion.

:func:`stale_fresh_divergence` runs the base model's own sampler (K = 1, the fresh anchor at every
step) on held-out prompts and records the visited states. At every step that a sampler with refresh
interval K would serve from a stale anchor (cache age a = (T - i) mod K > 0), the anchor is taken
from the state a steps earlier on the same trajectory and two stale predictions are compared with
the fresh one, D(A(C_i)):

* fused: D(Phi(C_i, [H0, C0])), the paired-attention fusion (paper Eq. stale-anchor-fusion-app);
* naive: D(H0), naive reuse of the stale anchor.

Reported per K: KL(fresh || stale) per token, in nats, and the share of tokens whose greedy choice
agrees with the fresh one. A fusion that helps lowers the KL below naive reuse's.

For an absorbing backbone (LLaDA, Dream, MDLM) the trajectory starts from masks with the family's
sampler (after the context, inside the canvas, for LLaDA and Dream), the distributions are the
backbone's SUBS parameterisation, and the tokens compared are the response positions still masked at
each step (the others are carried over, identical in every prediction).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tadm.posttrain.backbone import StackContext
from tadm.posttrain.data import CanvasBatch
from tadm.posttrain.model import AnchoredBackbone

__all__ = ["stale_fresh_divergence"]


@torch.no_grad()
def stale_fresh_divergence(
    model: AnchoredBackbone,
    batches: Iterable[tuple[CanvasBatch, torch.Generator]],
    sampler: Any,
    intervals: Sequence[int] = (2, 3),
) -> dict[int, dict[str, Any]]:
    """KL(fresh || stale) and greedy agreement of fused and naive stale predictions (module docstring).

    Args:
        model: the split base with its fusion (its ``fusion_mode`` is restored afterwards).
        batches: (held-out batch, generator) pairs; only the batch's context and canvas shape are used.
        sampler: the base's sampler, T = ``sampler.num_steps``: the entropy-bound sampler for
            DiffusionGemma, the family's masked sampler (``llada``, ``dream-*``, ``mdlm``) for an absorbing one.
        intervals: the refresh intervals K to compare at.

    Returns:
        ``{K: {"kl_naive", "kl_fused", "agreement_naive", "agreement_fused", "stale_tokens"}}``.
    """
    if model.backbone.prior == "mask":
        return _absorbing_divergence(model, batches, sampler, intervals)
    T = sampler.num_steps
    mode = model.fusion_mode
    sums = {K: {"kl_naive": 0.0, "kl_fused": 0.0, "agreement_naive": 0.0, "agreement_fused": 0.0, "stale_tokens": 0}
            for K in intervals}
    try:
        for batch, generator in batches:
            prompt = model.backbone.prefill(batch.context_ids, batch.context_mask)
            B, L = batch.targets.shape
            z = sampler.initial_canvas(B, L, generator, batch.targets.device)  # (B, L)
            sc = None
            states = {}  # step i -> (z, prepared, C, anchor)
            model.fusion_mode = "paired"
            for i in range(T, 0, -1):
                prepared = model.prepare(z, StackContext(prompt=prompt, self_conditioning_logits=sc))
                c = model.encode(z, prepared=prepared)  # (B, L, d)
                anchor = model.compute_anchor(c, prepared=prepared)
                states[i] = (z, prepared, c, anchor)
                logits = model.predict_logits(z, c, anchor, prepared=prepared)  # fresh: the base model
                out = sampler.step(logits, i, z, generator)
                z, sc = out.prev_sample, out.scaled_logits
            for i, (z_i, prepared, c, _) in states.items():
                ages = {K: (T - i) % K for K in intervals}
                if not any(ages.values()):
                    continue
                fresh = model.fresh_logits(c, prepared).log_softmax(-1)  # (B, L, V)
                p = fresh.exp()
                for K, age in ages.items():
                    if age == 0:
                        continue
                    anchor = states[i + age][3]  # computed `age` steps earlier on the trajectory
                    for key, fusion_mode in (("fused", "paired"), ("naive", "naive")):
                        model.fusion_mode = fusion_mode
                        stale = model.predict_logits(z_i, c, anchor, prepared=prepared).log_softmax(-1)
                        sums[K][f"kl_{key}"] += float((p * (fresh - stale)).sum())
                        sums[K][f"agreement_{key}"] += float((stale.argmax(-1) == fresh.argmax(-1)).sum())
                    sums[K]["stale_tokens"] += B * L
    finally:
        model.fusion_mode = mode
    return {K: {key: value if key == "stale_tokens" else value / max(1, s["stale_tokens"]) for key, value in s.items()}
            for K, s in sums.items()}


def _absorbing_divergence(model: AnchoredBackbone, batches: Iterable[tuple[CanvasBatch, torch.Generator]],
                          sampler: Any, intervals: Sequence[int]) -> dict[int, dict[str, Any]]:
    """:func:`stale_fresh_divergence` for an absorbing backbone that reads the whole sequence (module docstring)."""
    T, mask_id, backbone = sampler.num_steps, model.mask_token_id, model.backbone
    mode = model.fusion_mode
    sums = {K: {"kl_naive": 0.0, "kl_fused": 0.0, "agreement_naive": 0.0, "agreement_fused": 0.0, "stale_tokens": 0}
            for K in intervals}
    try:
        for batch, generator in batches:
            if getattr(backbone, "prompt_in_canvas", False):
                ids, target, padding = batch.whole_sequence()
            else:  # tadm's MDLM: the response canvas alone
                ids, padding = batch.targets, None
                target = torch.ones_like(ids, dtype=torch.bool)
            z = torch.where(target, mask_id, ids)  # (B, N): the context (if any), then masks
            context = StackContext(attention_mask=padding)
            sampler.set_timesteps(T)  # a new run (LLaDA's sampler reads its block layout at the first step)
            states = {}  # step i -> (z, prepared, C, anchor)
            model.fusion_mode = "paired"
            for i in range(T, 0, -1):
                prepared = model.prepare(z, context)
                c = model.encode(z, prepared=prepared)  # (B, N, d)
                anchor = model.compute_anchor(c, prepared=prepared)
                states[i] = (z, prepared, c, anchor)
                logits = model.predict_logits(z, c, anchor, prepared=prepared)  # fresh: the base model
                out = logits if sampler.consumes == "logits" else backbone.log_probs(logits, z)
                z = sampler.step(out, i, z, generator).prev_sample
            for i, (z_i, prepared, c, _) in states.items():
                ages = {K: (T - i) % K for K in intervals}
                predicted = (z_i == mask_id) & target  # (B, N) the positions a step predicts
                if not any(ages.values()) or not bool(predicted.any()):
                    continue
                fresh = backbone.log_probs(model.fresh_logits(c, prepared), z_i)[predicted]  # (n, V)
                p = fresh.exp()
                for K, age in ages.items():
                    if age == 0:
                        continue
                    anchor = states[i + age][3]  # computed `age` steps earlier on the trajectory
                    for key, fusion_mode in (("fused", "paired"), ("naive", "naive")):
                        model.fusion_mode = fusion_mode
                        stale = backbone.log_probs(model.predict_logits(z_i, c, anchor, prepared=prepared),
                                                   z_i)[predicted]
                        sums[K][f"kl_{key}"] += float((p * (fresh - stale)).sum())
                        sums[K][f"agreement_{key}"] += float((stale.argmax(-1) == fresh.argmax(-1)).sum())
                    sums[K]["stale_tokens"] += int(predicted.sum())
    finally:
        model.fusion_mode = mode
    return {K: {key: value if key == "stale_tokens" else value / max(1, s["stale_tokens"]) for key, value in s.items()}
            for K, s in sums.items()}
