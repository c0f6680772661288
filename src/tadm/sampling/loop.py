"""Algorithm 1's inner loop, the one every caller runs: reverse steps with the anchor cache.

For each step i of ``steps`` (position n = 0, 1, ...)::

    c_i = S(z_i)                                  every evaluated step
    if policy says refresh:  h = A(c_i)           cached with the canvas and i
    out = D(Phi(c_i, h))                          log-probabilities or logits, as the sampler consumes
    z_{i-1} ~ sampler.step(out, i, z_i)

Callers differ only in what surrounds the loop (drawing the prior, a prompt KV cache, block
bookkeeping, corrupting a clean canvas) and in the state a backbone needs between passes
(self-conditioning input, the prompt cache). That state travels in an explicit :class:`LoopContext`:
``pass_context()`` is given to ``model.prepare(z, context, t)``, ``after_step`` turns the sampler's output into the next canvas and updates the
state, ``finished`` stops the run early.

Callers: :func:`tadm.sampling.generate` (unconditional, or after a prompt kept in the canvas) and
:func:`tadm.posttrain.on_policy_rollout` (k steps on one anchor). A DiffusionGemma generates with its own
``generate``, the cache inside the model (:mod:`tadm.posttrain.layer_cache`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tadm.protocol import check_network
from tadm.sampling.anchor_cache import AnchorCache, LayerCallCounter
from tadm.sampling.refresh import RefreshPolicy

__all__ = ["LoopContext", "LoopPlan", "LoopResult", "check_contract", "denoise", "network_pass"]


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
    rows are at different steps); ``consumes`` picks ``model.predict`` (log-probabilities) or
    ``model.predict_logits`` (raw logits, for the entropy-bound sampler). With ``hidden_only`` the
    output is ``model.predict_hidden``'s (last hidden states, conditioning) pair, for
    ``model.output_log_probs`` on chosen rows.
    """
    state = model.prepare(z, context, t)
    c = model.encode(z, state)  # (B, L, d)
    if refresh:
        cache.store(model.compute_anchor(c, state), z, step_index if isinstance(step_index, int) else -1)
    if cache.hidden is None:
        first = step_index if isinstance(step_index, int) else "T"
        raise ValueError(f"the refresh policy did not compute an anchor at the first step of the run (i = {first}); "
                         f"a refresh schedule must list the first step, i = T")
    if consumes == "logits":
        output = model.predict_logits(z, c, cache.hidden, state)
    elif hidden_only:
        output = model.predict_hidden(z, c, cache.hidden, state)
    else:
        output = model.predict(z, c, cache.hidden, state)
    counter.add_pass(model.layer_split, refreshed=refresh)
    return output, state


_SAMPLER_METHODS = ("set_timesteps", "time", "initial_canvas", "step", "unfinished", "finish")


@dataclass(frozen=True)
class LoopPlan:
    """What a (network, sampler) pair supports, read once per run by :func:`check_contract`."""

    consumes: str  # "log_probs" or "logits"
    rows_only: bool  # the sampler draws its moves first and x_theta is computed on the decoded rows only
    time_conditioned: bool


def check_contract(model: Any, sampler: Any, policy: RefreshPolicy, *, full_output: bool = False) -> LoopPlan:
    """Check the network (:func:`tadm.protocol.check_network`) and the sampler once; a clear error otherwise.

    The rows-only path needs a sampler that decides its moves before the network runs (``plan_moves``,
    the masked samplers) and a network that stops before its output layer (``predicts_rows``).
    """
    missing = [name for name in _SAMPLER_METHODS if not callable(getattr(sampler, name, None))]
    missing += [name for name in ("consumes", "final_denoise") if not hasattr(sampler, name)]
    if missing:
        raise TypeError(f"sampler {type(sampler).__name__} lacks {', '.join(missing)} of the sampler contract "
                        f"(tadm.sampling.base.Sampler; ConfiguredSampler has the defaults)")
    consumes = sampler.consumes
    if consumes not in ("log_probs", "logits"):
        raise ValueError(f"a sampler consumes 'log_probs' or 'logits', got {consumes!r}")
    check_network(model, "predict_logits" if consumes == "logits" else "predict")
    sampler_mask, model_mask = getattr(sampler, "mask_id", None), model.mask_token_id
    if sampler_mask is not None and model_mask is not None and sampler_mask != model_mask:
        raise ValueError(f"the sampler's mask id {sampler_mask} differs from the model's mask_token_id {model_mask}; "
                         f"build the sampler for the model: build_sampler(name, model)")
    rows_only = (not full_output and callable(getattr(sampler, "plan_moves", None)) and bool(model.predicts_rows)
                 and consumes == "log_probs")
    return LoopPlan(consumes=consumes, rows_only=rows_only, time_conditioned=bool(model.time_conditioned))


def _time(plan: LoopPlan, sampler: Any, step_index: int | Tensor, z: Tensor) -> Tensor | None:
    if not plan.time_conditioned:
        return None
    if isinstance(step_index, Tensor):
        raise ValueError("a time-conditioned network needs one step index per step, not one per row")
    return torch.full((z.shape[0],), sampler.time(int(step_index)), device=z.device)


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
    counter: LayerCallCounter | None = None,
    progress: bool = False,
    desc: str = "sampling",
    full_output: bool = False,
) -> LoopResult:
    """Run the reverse steps ``steps`` (e.g. ``range(T, 0, -1)``) from canvas z (B, L) with the anchor cache.

    Args:
        model: a :class:`~tadm.protocol.CacheableDenoiser` (checked once, with the sampler).
        sampler: a :class:`~tadm.sampling.base.Sampler`; ``set_timesteps`` must have been called.
        steps: reverse step indices in the order run; an index may be a (B,) tensor (rows at
            different steps, as in rollouts; not for time-conditioned networks).
        policy: when to refresh the anchor and when to reuse the previous prediction (reset here).
        context: per-pass state and hooks (default: none).
        counter: add the layer calls to this counter (default: a new one).
        full_output: compute x_theta at every position at every step (the reference path). By
            default, where the contract allows, the sampler draws its moves first and the output
            head and log-softmax run on the decoded rows only (same tokens; the last step always has
            the full output, which ``LoopResult.output`` returns).

    A run that reaches step i = 1 ends with the sampler's final step: with ``final_denoise`` and an
    unfinished canvas, one more network pass at i = 0 (refreshing the anchor if the policy says so,
    its layers counted), then ``sampler.finish(z, last output)`` (masks left take the argmax).
    """
    plan = check_contract(model, sampler, policy, full_output=full_output)
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
    if steps and isinstance(steps[0], int):
        policy.check_steps(steps[0])
    for position, i in enumerate(tqdm(steps, desc=desc, disable=not progress, leave=False)):
        step_plan = policy.plan(position, i, z, cache, previous_canvas if output is not None else None)
        context.before_step(position, i, z)
        # the network draws no random numbers, so drawing the moves first keeps the generator's order
        moves = sampler.plan_moves(i, z, generator) if plan.rows_only and position < len(steps) - 1 else None
        if step_plan.reuse:
            counter.skipped_steps += 1
        else:
            output, state = network_pass(model, z, refresh=step_plan.refresh, cache=cache, counter=counter,
                                         step_index=i, t=_time(plan, sampler, i, z), context=context.pass_context(),
                                         consumes=plan.consumes, hidden_only=plan.rows_only)
            if step_plan.refresh:
                refresh_positions.append(position)
        previous_canvas = z
        if not plan.rows_only:
            sampled = sampler.step(output, i, z, generator)
        elif moves is None:  # the last step: the full output, for the final step
            last_output = model.output_log_probs(*output, z)
            sampled = sampler.step(last_output, i, z, generator)
        else:
            sampled = sampler.step_moves(model.output_log_probs(*output, z, moves.rows), moves, i, z, generator)
        z = context.after_step(position, i, z, sampled)
        steps_run += 1
        if context.finished():
            break
    if plan.rows_only:
        output = last_output
    result = LoopResult(z=z, output=output, steps_run=steps_run, cache=cache, layer_calls=counter,
                        last_state=state, refresh_positions=refresh_positions)
    if steps_run == len(steps) and steps and isinstance(steps[-1], int) and steps[-1] == 1:
        _final_step(model, sampler, plan, policy, result, context, position=len(steps))
    return result


def _final_step(model: Any, sampler: Any, plan: LoopPlan, policy: RefreshPolicy, run: LoopResult,
                context: LoopContext, position: int) -> None:
    """The sampler's final step after i = 1 (see :func:`denoise`), in place on ``run``."""
    if run.output is None or not sampler.unfinished(run.z):
        return
    if sampler.final_denoise:
        z = run.z
        refresh = policy.due(position, 0, z, run.cache)
        output, run.last_state = network_pass(model, z, refresh=refresh, cache=run.cache, counter=run.layer_calls,
                                              step_index=0, t=_time(plan, sampler, 0, z),
                                              context=context.pass_context(), consumes=plan.consumes)
        run.output = output
    run.z = sampler.finish(run.z, run.output)
