"""Analytic Transformer-layer compute of anchor-cache inference: Eq. (anchor-cache-compute), Table 2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tadm.sampling.anchor_cache import LayerCallCounter, check_refresh_interval
from tadm.sampling.base import check_num_steps
from tadm.nn import TADM
from tadm.protocol import LayerSplit
from tadm.sampling.refresh import parse_refresh


def _check_split(split: LayerSplit) -> None:
    for name in ("shared", "anchor", "denoiser"):
        value = getattr(split, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"number of {name} layers must be an integer >= 0, got {value!r}")
    if split.total == 0:
        raise ValueError("a layer split needs at least one Transformer layer")


def layer_calls(split: LayerSplit, num_steps: int, refresh_interval: int = 1) -> int:
    """Transformer-layer evaluations of one generation: C = T (L_S + L_D) + ceil(T / K) L_A.

    Eq. (anchor-cache-compute): shared and denoiser layers run every reverse step, the anchor
    layers at each of the ceil(T / K) refreshes of Algorithm 1 (steps with (T - i) mod K == 0).
    """
    _check_split(split)
    check_num_steps(num_steps)
    return policy_layer_calls(split, num_steps, check_refresh_interval(refresh_interval))


def policy_layer_calls(
    split: LayerSplit, num_steps: int, policy: Any, counted: LayerCallCounter | None = None
) -> int:
    """Transformer-layer evaluations of one generation of T steps under a refresh policy (any refresh spec).

    T (L_S + L_D) + R L_A with R the policy's analytic refresh count (``fixed`` K: ceil(T / K), Eq.
    (anchor-cache-compute); ``schedule``: its steps in 1..T). Where R depends on the sampled canvases
    (``adaptive``, or skipping unchanged canvases) the compute is the counted one: pass ``counted``.
    """
    policy = parse_refresh(policy)
    _check_split(split)
    check_num_steps(num_steps)
    refreshes = policy.refresh_count(num_steps)
    if refreshes is None:
        if counted is None:
            raise ValueError(f"the compute of the refresh policy {policy.label()!r} depends on the sampled canvases; "
                             "only a counted generation gives it")
        return counted.total
    return num_steps * (split.shared + split.denoiser) + refreshes * split.anchor


@dataclass(frozen=True)
class ComputeRow:
    """One cell of a compute table: layer calls and their ratio to a baseline's."""

    name: str
    num_steps: int
    refresh: int | str  # the refresh policy's key (K for a fixed policy)
    layer_calls: int
    baseline_layer_calls: int

    @property
    def relative(self) -> float:
        return self.layer_calls / self.baseline_layer_calls

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "steps": self.num_steps,
            "refresh": self.refresh,
            "layer_calls": self.layer_calls,
            "baseline_layer_calls": self.baseline_layer_calls,
            "relative_to_baseline": self.relative,
        }


def compute_row(
    name: str, split: LayerSplit, num_steps: int, refresh: Any = 1, baseline_layers: int | None = None
) -> ComputeRow:
    """Layer calls of ``split`` at T under a refresh policy (any refresh spec; K for Algorithm 1), normalised to
    an uncached ``baseline_layers``-layer model.

    The paper normalises to MDLM (12 layers, no cache); by default the baseline is the same split
    run without cache (K = 1), i.e. T (L_S + L_A + L_D). A policy whose refreshes depend on the
    sampled canvases has no analytic compute: ValueError.
    """
    _check_split(split)
    baseline = split.total if baseline_layers is None else baseline_layers
    if isinstance(baseline, bool) or not isinstance(baseline, int) or baseline < 1:
        raise ValueError(f"baseline layers must be an integer >= 1, got {baseline_layers!r}")
    policy = parse_refresh(refresh)
    return ComputeRow(name=name, num_steps=num_steps, refresh=policy.record,
                      layer_calls=policy_layer_calls(split, num_steps, policy),
                      baseline_layer_calls=num_steps * baseline)


@dataclass(frozen=True)
class GenerationFlops:
    """Matmul FLOPs (2 x multiply-adds) of one generation, by part; see :func:`generation_flops`."""

    layers: int  # Transformer blocks: projections, MLP and attention scores / values
    fusion: int  # the gated fusion Phi, once per evaluated step (TADM only)
    head: int  # the output layer on the rows it was computed for

    @property
    def total(self) -> int:
        return self.layers + self.fusion + self.head


def generation_flops(
    model: Any,
    *,
    batch_size: int,
    seq_len: int,
    num_steps: int,
    refresh_interval: int = 1,
    head_rows: int | None = None,
) -> GenerationFlops:
    """Matmul FLOPs of one generation of a TADM or MDLM network with the anchor cache.

    Per token, a DiT block costs (4 + 2 r) d^2 multiply-adds for its projections and MLP (r: MLP
    ratio) and 2 L d for attention; the gated fusion 14 d^2 (Linear 2d->d, 2d->4d, 4d->d); the output
    layer d V per row. Blocks run ``layer_calls`` times (Eq. (anchor-cache-compute)); the fusion at
    every step of a model that has one; the output layer on ``head_rows`` rows in all (default:
    every position of every step, B L T; with x_theta on decoded rows only, pass the rows computed).
    Element-wise work (norms, softmax, sampling) is not counted, nor ADLM's anchor output layer
    and projection.
    """
    config = model.config
    d, r, vocab = config.hidden_size, config.mlp_ratio, config.vocab_size
    tokens = batch_size * seq_len
    block = tokens * ((4 + 2 * r) * d * d + 2 * seq_len * d)
    fusion = tokens * 14 * d * d if isinstance(model, TADM) else 0
    rows = tokens * num_steps if head_rows is None else head_rows
    return GenerationFlops(
        layers=2 * block * layer_calls(model.layer_split, num_steps, refresh_interval),
        fusion=2 * fusion * num_steps,
        head=2 * rows * d * vocab,
    )
