"""On-policy rollouts for TADM:Post-train (sec. "TADM:Post-train", Eq. (anchor-sft-rollout)).

For a clean response canvas ``x0`` each row draws a cache age ``k`` in {0, 1, 2} (probabilities
0.34 / 0.33 / 0.33) and an anchor time ``t' ~ U(0, 1)`` (antithetic across the batch), and is
corrupted with uniform noise: ``z_t' ~ q(. | x0)`` of Eq. (fwd). ``t'`` is projected on the T-step
grid,

    i_a = clip(floor(t' T + 1/2), k + 1, T),    i_s = i_a - k,

the anchor ``[H0, C0]`` is computed once at ``z~_{i_a} = z_t'`` and, keeping it fixed, the current
model makes ``k`` reverse transitions ``z~_{j-1} ~ S(p(. | z~_j, h_t'), j)`` for
``j = i_a, ..., i_s + 1`` with the same sampler as inference (Algorithm 2). The end point
``z~_{i_s}`` (the state at ``t = t' - k / T``) is what the loss trains on. The rollout is
stop-gradient (run under ``torch.no_grad``).

Self-conditioning (probability 0.5 per row): a row with it on conditions every pass on the previous
step's temperature-scaled logits, as at inference. Its anchor step ``i_a`` has a previous step
unless ``i_a = T``; that signal is bootstrapped from a fresh pass of the frozen model on ``z_t'``
without self-conditioning, scaled at the previous step's temperature (the usual two-pass
self-conditioning recipe). At ``i_a = T`` the signal is zero, as at the first inference step.

A backbone with the absorbing (mask) prior (tadm's MDLM, a converted released MDLM checkpoint) is
rolled out the same way with its own kind of sampler (a masked sampler such as tadm's ``MDLMSampler``
on the same T-step grid): ``z_t' ~ q(. | x0)`` masks tokens with probability 1 - alpha_t', each
reverse step j gives the denoiser the time t(j) = j / T (read by time-conditioned networks) and draws
z~_{j-1} from the sampler's posterior, and the forward-mode ablation masks further, Eq. (fwd_t_t').
Such backbones have no self-conditioning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tadm.diffusion import NoiseSchedule, further_mask, mask_corrupt, sample_t, uniform_corrupt
from tadm.posttrain.backbone import PromptCache, StackContext
from tadm.posttrain.model import AnchoredBackbone
from tadm.sampling.base import MaskedSampler
from tadm.sampling.entropy_bound import EntropyBoundOutput, EntropyBoundSampler
from tadm.sampling.loop import LoopContext, denoise
from tadm.sampling.refresh import FixedRefresh

__all__ = ["CACHE_AGES", "CACHE_AGE_PROBS", "ROLLOUT_MODES", "ROLLOUT_PRIORS", "RolloutState", "forward_rollout",
           "on_policy_rollout", "draw_rollout", "rollout_indices", "sample_cache_ages"]

CACHE_AGES: tuple[int, ...] = (0, 1, 2)
CACHE_AGE_PROBS: tuple[float, ...] = (0.34, 0.33, 0.33)
ROLLOUT_MODES = ("on-policy", "forward")  # the paper's rollouts; canvases of the forward process (an ablation)


def rollout_indices(t_anchor: Tensor, cache_age: Tensor, num_steps: int) -> tuple[Tensor, Tensor]:
    """Anchor and current grid indices ``i_a = clip(floor(t' T + 1/2), k + 1, T)``, ``i_s = i_a - k``.

    Args:
        t_anchor: (B,) anchor times t' in [0, 1].
        cache_age: (B,) integer cache ages k >= 0, each < T.
        num_steps: T >= 1.

    Returns:
        (i_a, i_s), each a (B,) LongTensor with 1 <= i_s <= i_a <= T.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"number of steps T must be an integer >= 1, got {num_steps!r}")
    k = cache_age.long()
    if k.numel() and (int(k.min()) < 0 or int(k.max()) >= num_steps):
        raise ValueError(f"cache ages must lie in 0..T-1 = 0..{num_steps - 1}, got values in [{int(k.min())}, {int(k.max())}]")
    if t_anchor.shape != k.shape:
        raise ValueError(f"t_anchor {tuple(t_anchor.shape)} and cache_age {tuple(k.shape)} must have the same shape")
    nearest = torch.floor(t_anchor.double() * num_steps + 0.5).long()  # (B,)
    i_a = torch.minimum(torch.maximum(nearest, k + 1), torch.full_like(k, num_steps))  # (B,)
    return i_a, i_a - k


def sample_cache_ages(
    batch_size: int,
    ages: Sequence[int] = CACHE_AGES,
    probs: Sequence[float] = CACHE_AGE_PROBS,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Draw ``batch_size`` cache ages from ``ages`` with probabilities ``probs`` (renormalised): (B,) long."""
    if len(ages) == 0 or len(ages) != len(probs):
        raise ValueError(f"cache ages {tuple(ages)} and probabilities {tuple(probs)} must be non-empty and equally long")
    if any(int(a) != a or a < 0 for a in ages):
        raise ValueError(f"cache ages must be integers >= 0, got {tuple(ages)}")
    if any(p < 0 for p in probs) or not math.isfinite(sum(probs)) or sum(probs) <= 0:
        raise ValueError(f"cache-age probabilities must be >= 0 with a positive sum, got {tuple(probs)}")
    where = generator.device if generator is not None else device
    weights = torch.tensor([float(p) for p in probs], dtype=torch.float64, device=where)
    index = torch.multinomial(weights, batch_size, replacement=True, generator=generator)  # (B,)
    return torch.tensor([int(a) for a in ages], dtype=torch.long, device=where)[index].to(device)


@dataclass
class RolloutState:
    """The end point of a rollout and everything the loss recomputes from; tensors are (B, ...)."""

    x0: Tensor  # (B, L) clean canvas
    z_anchor: Tensor  # (B, L) z_t', where the anchor was computed
    z_current: Tensor  # (B, L) z~_{i_s}, sampled by the model
    anchor: Tensor  # (B, L, 2d) cached [H0, C0] from z_t'
    c_current: Tensor  # (B, L, d) shallow state C of z~_{i_s}
    prepared: Any  # the backbone's per-pass state for z~_{i_s} (context, masks, rotary tables)
    t_anchor: Tensor  # (B,) t'
    cache_age: Tensor  # (B,) k
    i_a: Tensor  # (B,) anchor grid index
    i_s: Tensor  # (B,) current grid index, i_a - k
    self_conditioning: Tensor  # (B,) bool, rows trained with self-conditioning


def _where_rows(rows: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``a`` on rows where ``rows`` (B,) is True, else ``b``."""
    return torch.where(rows.view(-1, *([1] * (a.dim() - 1))), a, b)


@dataclass(eq=False)
class _RolloutContext(LoopContext):
    """Rollout loop state: the prompt, per-row ages, and per-row self-conditioning logits."""

    prompt: PromptCache | None
    cache_age: Tensor  # (B,) k
    sc_rows: Tensor  # (B,) bool, rows that self-condition
    has_signal: Tensor  # (B,) bool, rows whose self-conditioning signal is set
    sc_logits: Tensor | None  # (B, L, V)
    embed_dtype: torch.dtype

    def pass_context(self) -> StackContext:
        if self.sc_logits is None:
            return StackContext(prompt=self.prompt)
        return StackContext(prompt=self.prompt, self_conditioning_logits=self.sc_logits,
                            self_conditioning_mask=self.has_signal)

    def after_step(self, position: int, step_index: int | Tensor, z: Tensor, output: EntropyBoundOutput) -> Tensor:
        active = position < self.cache_age  # (B,) rows still rolling out
        learn = active & self.sc_rows
        if bool(learn.any()):
            new_sc = output.scaled_logits.to(self.embed_dtype)
            self.sc_logits = new_sc if self.sc_logits is None else _where_rows(learn, new_sc, self.sc_logits)
            self.has_signal = self.has_signal | learn
        return _where_rows(active, output.prev_sample, z)


ROLLOUT_PRIORS = ("uniform", "mask")  # what the rollouts corrupt canvases with, by the backbone's prior


def _check_rollout(model: AnchoredBackbone, sampler: Any, self_conditioning_prob: float) -> None:
    prior = model.backbone.prior
    if prior not in ROLLOUT_PRIORS:
        raise ValueError(f"post-training rollouts corrupt canvases with uniform noise or masks; backbone "
                         f"{type(model.backbone).__name__} has prior {prior!r}")
    if prior == "uniform" and not isinstance(sampler, EntropyBoundSampler):
        raise ValueError("a uniform-prior backbone rolls out with the entropy-bound sampler, got "
                         f"{type(sampler).__name__}")
    if prior == "mask" and not isinstance(sampler, MaskedSampler):
        raise ValueError(f"a mask-prior backbone ({type(model.backbone).__name__}) rolls out with a masked sampler "
                         f"(e.g. tadm's MDLMSampler), got {type(sampler).__name__}")
    if not 0.0 <= self_conditioning_prob <= 1.0:
        raise ValueError(f"self_conditioning_prob must be in [0, 1], got {self_conditioning_prob!r}")
    if self_conditioning_prob > 0 and not model.backbone.supports_self_conditioning:
        raise ValueError(f"{type(model.backbone).__name__} has no self-conditioning; set self_conditioning_prob=0")


def _self_conditioning(
    model: AnchoredBackbone, sampler: EntropyBoundSampler, z: Tensor, prompt: PromptCache | None, k: Tensor,
    i_a: Tensor, probability: float, generator: torch.Generator | None,
) -> _RolloutContext:
    """The rollout's per-pass context: which rows self-condition, bootstrapped from a fresh pass on z_t' (module
    docstring)."""
    B, T = z.shape[0], sampler.num_steps
    where = generator.device if generator is not None else z.device
    sc_rows = (torch.rand(B, generator=generator, device=where) < probability).to(z.device)  # (B,)
    has_signal = sc_rows & (i_a < T)  # (B,) a previous step exists
    embed_dtype = model.backbone.dtype
    sc_logits: Tensor | None = None
    if bool(has_signal.any()):
        first = model.prepare(z, StackContext(prompt=prompt))
        boot = model.fresh_logits(model.encode(z, first), first)  # (B, L, V)
        sc_logits = sampler.scale_logits(boot, torch.clamp(i_a + 1, max=T)).to(embed_dtype)  # (B, L, V)
    return _RolloutContext(prompt, k, sc_rows, has_signal, sc_logits, embed_dtype)


def _roll_out(
    model: AnchoredBackbone, sampler: EntropyBoundSampler, z: Tensor, k: Tensor, i_a: Tensor,
    rollout: _RolloutContext, generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Any, Tensor]:
    """k reverse steps from z_t' on the anchor cached there: (z~_t, anchor h_t', prepared state, c_t)."""
    T = sampler.num_steps
    max_age = int(k.max()) if k.numel() else 0
    if max_age == 0:
        prepared = model.prepare(z, rollout.pass_context())
        c = model.encode(z, prepared)  # (B, L, d)
        return z, model.compute_anchor(c, prepared), prepared, c  # anchor (B, L, 2d)
    # Reverse steps j = i_a - r for r < k per row; rows past their age idle at a valid index.
    steps = [torch.where(r < k, i_a - r, torch.full_like(i_a, T)) for r in range(max_age)]
    run = denoise(model, sampler, z, steps, policy=FixedRefresh(max_age), context=rollout, generator=generator)
    prepared = model.prepare(run.z, rollout.pass_context())
    return run.z, run.cache.hidden, prepared, model.encode(run.z, prepared)


def _masked_roll_out(
    model: AnchoredBackbone, sampler: MaskedSampler, z: Tensor, k: Tensor, i_a: Tensor,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Any, Tensor]:
    """k reverse steps of a mask-prior backbone from z_t' with the anchor cached there (module docstring):
    (z~_t, anchor h_t', prepared state, c_t). Rows at the same step index step together."""
    T = sampler.num_steps
    times = lambda index: index.double().div(T).float()  # (B,) t(j) = j / T
    prepared = model.prepare(z, StackContext(), t=times(i_a))
    anchor = model.compute_anchor(model.encode(z, prepared), prepared)  # (B, L, 2d)
    z = z.clone()
    for r in range(int(k.max()) if k.numel() else 0):
        active = r < k  # (B,) rows still rolling out
        step = i_a - r  # (B,) their reverse step j
        prepared = model.prepare(z, StackContext(), t=times(step))
        log_probs = model.predict(z, model.encode(z, prepared), anchor, prepared)  # (B, L, V)
        for j in torch.unique(step[active]).tolist():
            rows = active & (step == j)
            z[rows] = sampler.step(log_probs[rows], int(j), z[rows], generator).prev_sample
    i_s = i_a - k
    prepared = model.prepare(z, StackContext(), t=times(i_s))
    return z, anchor, prepared, model.encode(z, prepared)


@torch.no_grad()
def draw_rollout(
    model: AnchoredBackbone,
    x0: Tensor,
    *,
    sampler: EntropyBoundSampler | MaskedSampler,
    schedule: NoiseSchedule,
    mode: str = "on-policy",
    prompt: PromptCache | None = None,
    cache_ages: Sequence[int] = CACHE_AGES,
    cache_age_probs: Sequence[float] = CACHE_AGE_PROBS,
    self_conditioning_prob: float = 0.5,
    antithetic: bool = True,
    cache_age: Tensor | None = None,
    t_anchor: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> RolloutState:
    """Sample (t', k) per row and build the (anchor, current) canvas pair the post-training loss trains on.

    ``mode="on-policy"`` (the paper's, Eq. (anchor-sft-rollout)): corrupt ``x0`` to z_t', cache the
    anchor there and let the student make k reverse steps. ``mode="forward"`` (an ablation, no model
    steps): with t = max(t' - k / T, 0) the current canvas is ``z_t ~ q(. | x0)`` of Eq. (fwd) and the
    anchor's canvas is ``z_t'`` corrupted further from it, ``q(z_t' | z_t)`` with keep probability
    alpha_t' / alpha_t (the uniform-noise analogue of Eq. (fwd_t_t'), as in pretraining): the current
    canvas is synthesised from the clean target (teacher-forced) instead of sampled by the student.

    Args:
        model: the split backbone with its current fusion (the student).
        x0: (B, L) clean canvas ids.
        sampler: Algorithm 2 with T = ``sampler.num_steps``, used for the k transitions (a masked sampler
            with ``set_timesteps(T)`` done for a mask-prior backbone).
        schedule: alpha_t of the forward process.
        mode: one of :data:`ROLLOUT_MODES`.
        prompt: encoded context (block-diffusion backbones), shared by the anchor and current passes.
        cache_ages, cache_age_probs: the distribution of k (paper: {0, 1, 2}, (0.34, 0.33, 0.33)).
        self_conditioning_prob: probability that a row uses self-conditioning (paper: 0.5); it must
            be 0 for backbones without self-conditioning. Its rows get the frozen model's fresh
            prediction on z_t' as their first signal.
        antithetic: stratify t' across the batch.
        cache_age, t_anchor: fix k and/or t' per row (B,) instead of drawing them.
        generator: source of randomness.

    Returns:
        RolloutState at the rollout's end point.
    """
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout mode {mode!r} is unknown; valid: {', '.join(ROLLOUT_MODES)}")
    _check_rollout(model, sampler, self_conditioning_prob)
    T = sampler.num_steps
    B, device = x0.shape[0], x0.device
    k = (sample_cache_ages(B, cache_ages, cache_age_probs, generator, device) if cache_age is None
         else cache_age.to(device))
    if t_anchor is None:
        t_anchor = sample_t(B, eps=0.0, antithetic=antithetic, generator=generator, device=device)  # (B,)
    t_anchor = t_anchor.to(device)
    i_a, i_s = rollout_indices(t_anchor, k, T)
    if model.backbone.prior == "mask":
        return _masked_rollout(model, sampler, x0, schedule, mode, k, t_anchor, i_a, i_s, generator)
    if mode == "on-policy":
        z_anchor = uniform_corrupt(x0, schedule.alpha(t_anchor.double()).float(), model.vocab_size, generator)  # (B, L)
        context = _self_conditioning(model, sampler, z_anchor, prompt, k, i_a, self_conditioning_prob, generator)
        z_current, anchor, prepared, c_current = _roll_out(model, sampler, z_anchor, k, i_a, context, generator)
    else:
        t_current = torch.clamp(t_anchor.double() - k.double() / T, min=0.0)  # (B,)
        alpha_current = schedule.alpha(t_current)  # (B,)
        keep = (schedule.alpha(t_anchor.double()) / alpha_current.clamp_min(1e-12)).clamp(0.0, 1.0)  # (B,)
        z_current = uniform_corrupt(x0, alpha_current.float(), model.vocab_size, generator)  # (B, L)
        z_anchor = uniform_corrupt(z_current, keep.float(), model.vocab_size, generator)  # (B, L)
        context = _self_conditioning(model, sampler, z_anchor, prompt, k, i_a, self_conditioning_prob, generator)
        anchor_state = model.prepare(z_anchor, context.pass_context())
        anchor = model.compute_anchor(model.encode(z_anchor, anchor_state), anchor_state)  # (B, L, 2d)
        prepared = model.prepare(z_current, context.pass_context())
        c_current = model.encode(z_current, prepared)
    return RolloutState(x0=x0, z_anchor=z_anchor, z_current=z_current, anchor=anchor, c_current=c_current,
                        prepared=prepared, t_anchor=t_anchor, cache_age=k, i_a=i_a, i_s=i_s,
                        self_conditioning=context.sc_rows)


def _masked_rollout(
    model: AnchoredBackbone, sampler: MaskedSampler, x0: Tensor, schedule: NoiseSchedule, mode: str, k: Tensor,
    t_anchor: Tensor, i_a: Tensor, i_s: Tensor, generator: torch.Generator | None,
) -> RolloutState:
    """:func:`draw_rollout` for a mask-prior backbone (module docstring)."""
    mask_id = int(model.mask_token_id)
    alpha_anchor = schedule.alpha(t_anchor.double())  # (B,)
    if mode == "on-policy":
        z_anchor = mask_corrupt(x0, alpha_anchor.float(), mask_id, generator)  # (B, L)
        z_current, anchor, prepared, c_current = _masked_roll_out(model, sampler, z_anchor, k, i_a, generator)
    else:
        T = sampler.num_steps
        alpha_current = schedule.alpha(torch.clamp(t_anchor.double() - k.double() / T, min=0.0))  # (B,)
        z_current = mask_corrupt(x0, alpha_current.float(), mask_id, generator)  # (B, L)
        z_anchor = further_mask(z_current, alpha_current.float(), alpha_anchor.float(), mask_id, generator)
        anchor_state = model.prepare(z_anchor, StackContext(), t=i_a.double().div(T).float())
        anchor = model.compute_anchor(model.encode(z_anchor, anchor_state), anchor_state)  # (B, L, 2d)
        prepared = model.prepare(z_current, StackContext(), t=i_s.double().div(T).float())
        c_current = model.encode(z_current, prepared)
    return RolloutState(x0=x0, z_anchor=z_anchor, z_current=z_current, anchor=anchor, c_current=c_current,
                        prepared=prepared, t_anchor=t_anchor, cache_age=k, i_a=i_a, i_s=i_s,
                        self_conditioning=torch.zeros_like(k, dtype=torch.bool))


def on_policy_rollout(model: AnchoredBackbone, x0: Tensor, **options: Any) -> RolloutState:
    """:func:`draw_rollout` with ``mode="on-policy"``: the student's own k reverse steps from z_t'."""
    return draw_rollout(model, x0, mode="on-policy", **options)


def forward_rollout(model: AnchoredBackbone, x0: Tensor, **options: Any) -> RolloutState:
    """:func:`draw_rollout` with ``mode="forward"``: both canvases drawn from the forward process (an ablation)."""
    return draw_rollout(model, x0, mode="forward", **options)
