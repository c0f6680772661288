"""Algorithm 1's inner loop, the one every caller runs: reverse steps with the anchor cache.

For each step i of ``steps`` (position n = 0, 1, ...)::

    c_i = S(z_i)                                  every evaluated step
    if policy says refresh:  h = A(c_i)           cached with the canvas and i
    out = D(Phi(c_i, h))                          log-probabilities or logits, as the sampler consumes
    z_{i-1} ~ sampler.step(out, i, z_i)

Callers differ only in what surrounds the loop (drawing the prior, a prompt KV cache, block
bookkeeping, corrupting a clean canvas) and in the state a backbone needs between passes
(self-conditioning input, the prompt cache). That state travels in an explicit :class:`LoopContext`:
``pass_context()`` is given to ``model.prepare(z, context, t)`` (networks without ``prepare`` take
the time t directly), ``after_step`` turns the sampler's output into the next canvas and updates the
state, ``finished`` stops the run early.

Callers: :func:`tadm.sampling.generate` (unconditional), :func:`tadm.posttrain.generate_blocks`
(block-wise with a prompt) and :func:`tadm.posttrain.on_policy_rollout` (k steps on one anchor).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tadm.protocol import check_denoiser
from tadm.sampling.anchor_cache import AnchorCache, LayerCallCounter
from tadm.sampling.refresh import RefreshPolicy

__all__ = ["LoopContext", "LoopResult", "check_mask_ids", "decodes_rows_only", "denoise", "network_pass", "pass_state"]


class LoopContext:
    """State a caller keeps between passes; this base keeps none (unconditional generation)."""

    def pass_context(self) -> Any:
        """The per-pass input handed to ``model.prepare`` (None: nothing beyond the canvas)."""
        return None

    def before_step(self, position: int, step_index: int | Tensor, z: Tensor) -> None:
        """Called before the network pass of each step."""

    def after_step(self, position: int, step_index: int | Tensor, z: Tensor, output: Any) -> Tensor:
        """The next canvas from the sampler's ``output`` for canvas ``z`` (B, L)."""
        return output.prev_sample

    def finished(self) -> bool:
        """True to stop the run after the current step."""
        return False


@dataclass
class LoopResult:
    """The canvas after the last step, the last network output, and the cache and counts."""

    z: Tensor
    output: Tensor | None  # network output (B, L, V) of the last step (None if the run stopped early,
    # before its last step, on the rows-only path)
    steps_run: int
    cache: AnchorCache
    layer_calls: LayerCallCounter
    last_state: Any = None  # the pass state of the last evaluated step
    refresh_positions: list[int] = field(default_factory=list)


def pass_state(model: Any, z: Tensor, t: Tensor | None, context: Any) -> Any:
    """The second argument of the model's stage calls for canvas ``z``.

    Models with ``prepare(z, context, t)`` (split backbones) get their per-pass state from it; for
    the others (TADM, MDLM, ADLM networks) it is the time t, or None, and a context is refused.
    """
    prepare = getattr(model, "prepare", None)
    if prepare is None:
        if context is not None:
            raise TypeError(f"{type(model).__name__} takes no per-pass context (prompt cache, self-conditioning)")
        return t
    return prepare(z, context, t)


def network_pass(
    model: Any,
    z: Tensor,
    *,
    refresh: bool,
    cache: AnchorCache,
    counter: LayerCallCounter,
    step_index: int | Tensor,
    t: Tensor | None = None,
    context: Any = None,
    consumes: str = "log_probs",
    hidden_only: bool = False,
) -> tuple[Any, Any]:
    """One evaluation of the split network on canvas z (B, L); returns (output (B, L, V), pass state).

    Refreshes the cached anchor first when ``refresh`` (the cache records the step index; -1 when
    rows are at different steps); ``consumes`` picks ``model.predict``
    (log-probabilities) or ``model.predict_logits`` (raw logits, for the entropy-bound sampler).
    With ``hidden_only`` the output is ``model.predict_hidden``'s (last hidden states, conditioning)
    pair, for ``model.output_log_probs`` on chosen rows (models with ``predicts_rows``).
    """
    split = model.layer_split
    state = pass_state(model, z, t, context)
    c = model.encode(z, state)  # (B, L, d)
    counter.add_encode(split)
    if refresh:
        cache.store(model.compute_anchor(c, state), z, step_index if isinstance(step_index, int) else -1)
        counter.add_anchor(split)
    if cache.hidden is None:
        first = step_index if isinstance(step_index, int) else "T"
        raise ValueError(f"the refresh policy did not compute an anchor at the first step of the run (i = {first}); "
                         f"a refresh schedule must list the first step, i = T")
    if consumes == "logits":
        output = model.predict_logits(z, c, cache.hidden, state)
    elif hidden_only:
        output = model.predict_hidden(z, c, cache.hidden, state)
    elif consumes == "log_probs":
        output = model.predict(z, c, cache.hidden, state)
    else:
        raise ValueError(f"a sampler consumes 'log_probs' or 'logits', got {consumes!r}")
    counter.add_predict(split)
    return output, state


def check_mask_ids(model: Any, sampler: Any) -> None:
    """A masked sampler must use the model's mask token (else it never sees a mask, or only masks).

    Raises ValueError naming both ids; models or samplers without a mask id pass.
    """
    sampler_mask, model_mask = getattr(sampler, "mask_id", None), getattr(model, "mask_token_id", None)
    if sampler_mask is not None and model_mask is not None and sampler_mask != model_mask:
        raise ValueError(f"the sampler's mask id {sampler_mask} differs from the model's mask_token_id {model_mask}; "
                         f"build the sampler for the model: get_sampler(name, model.mask_token_id)")


def decodes_rows_only(model: Any, sampler: Any, policy: RefreshPolicy) -> bool:
    """Whether the loop can compute x_theta on the decoded rows only (the fast path, same tokens).

    It needs a sampler that decides its moves before the network runs (``plan_moves``, the masked
    samplers) and a network that stops before its output layer (``predicts_rows``: ``predict_hidden``
    and ``output_log_probs``). A step that reuses the previous prediction (``skip_unchanged``)
    reuses its hidden states and runs the output layer on its own rows.
    """
    return (hasattr(sampler, "plan_moves") and getattr(model, "predicts_rows", False)
            and getattr(sampler, "consumes", "log_probs") == "log_probs")


@torch.no_grad()
def denoise(
    model: Any,
    sampler: Any,
    z: Tensor,
    steps: Iterable[int | Tensor],
    *,
    policy: RefreshPolicy,
    context: LoopContext | None = None,
    generator: torch.Generator | None = None,
    time_conditioned: bool = False,
    counter: LayerCallCounter | None = None,
    progress: bool = False,
    desc: str = "sampling",
    full_output: bool = False,
) -> LoopResult:
    """Run the reverse steps ``steps`` (e.g. ``range(T, 0, -1)``) from canvas z (B, L) with the anchor cache.

    Args:
        model: a :class:`~tadm.protocol.CacheableDenoiser`.
        sampler: its ``step(output, i, z, generator)`` draws the next canvas; ``set_timesteps`` must
            have been called. ``sampler.consumes`` ("log_probs" default, or "logits") picks the output.
        steps: reverse step indices in the order run; an index may be a (B,) tensor (rows at
            different steps, as in rollouts; then ``time_conditioned`` must be False).
        policy: when to refresh the anchor and when to reuse the previous prediction (reset here).
        context: per-pass state and hooks (default: none).
        time_conditioned: give t(i) = ``sampler.time(i)`` to the network.
        counter: add the layer calls to this counter (default: a new one).
        full_output: compute x_theta at every position at every step (the reference path). By
            default, where :func:`decodes_rows_only` allows, the sampler draws its moves first and
            the output head and log-softmax run on the decoded rows only (same tokens; the last
            step always has the full output, which ``LoopResult.output`` returns).
    """
    consumes = getattr(sampler, "consumes", "log_probs")
    check_denoiser(model, ("predict_logits",) if consumes == "logits" else ("predict",))
    check_mask_ids(model, sampler)
    context = context if context is not None else LoopContext()
    counter = counter if counter is not None else LayerCallCounter()
    policy.reset()
    cache = AnchorCache()
    output: Any = None  # the network output, or on the rows-only path its (hidden, cond) pair
    last_output: Tensor | None = None
    state: Any = None
    previous_canvas: Tensor | None = None
    refresh_positions: list[int] = []
    steps_run = 0
    steps = list(steps)
    rows_only = not full_output and decodes_rows_only(model, sampler, policy)
    for position, i in enumerate(tqdm(steps, desc=desc, disable=not progress, leave=False)):
        plan = policy.plan(position, i, z, cache, previous_canvas if output is not None else None)
        context.before_step(position, i, z)
        # the network draws no random numbers, so drawing the moves first keeps the generator's order
        moves = sampler.plan_moves(i, z, generator) if rows_only and position < len(steps) - 1 else None
        if plan.reuse:
            counter.skipped_steps += 1
        else:
            t = None
            if time_conditioned:
                t = torch.full((z.shape[0],), sampler.time(int(i)), device=z.device)
            output, state = network_pass(model, z, refresh=plan.refresh, cache=cache, counter=counter, step_index=i,
                                         t=t, context=context.pass_context(), consumes=consumes, hidden_only=rows_only)
            if plan.refresh:
                refresh_positions.append(position)
        previous_canvas = z
        if not rows_only:
            sampled = sampler.step(output, i, z, generator)
        elif moves is None:  # the last step: the full output, for the argmax of any mask left
            last_output = model.output_log_probs(*output, z)
            sampled = sampler.step(last_output, i, z, generator)
        else:
            sampled = sampler.step_moves(model.output_log_probs(*output, z, moves.rows), moves, i, z, generator)
        z = context.after_step(position, i, z, sampled)
        steps_run += 1
        if context.finished():
            break
    if rows_only:
        output = last_output
    return LoopResult(z=z, output=output, steps_run=steps_run, cache=cache, layer_calls=counter,
                      last_state=state, refresh_positions=refresh_positions)
