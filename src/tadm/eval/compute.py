"""Analytic Transformer-layer compute of anchor-cache inference: Eq. (anchor-cache-compute), Table 2."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tadm.sampling.anchor_cache import LayerCallCounter, check_refresh_interval
from tadm.sampling.base import check_num_steps
from tadm.protocol import LayerSplit
from tadm.sampling.refresh import FixedRefresh, RefreshPolicy, ScheduleRefresh


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
    check_refresh_interval(refresh_interval)
    return num_steps * (split.shared + split.denoiser) + math.ceil(num_steps / refresh_interval) * split.anchor


def policy_layer_calls(
    split: LayerSplit, num_steps: int, policy: RefreshPolicy, counted: LayerCallCounter | None = None
) -> int:
    """Transformer-layer evaluations of one generation of T steps under a refresh policy.

    ``fixed`` K: Eq. (anchor-cache-compute); ``schedule``: T (L_S + L_D) + |{refresh steps in 1..T}| L_A.
    ``adaptive`` refreshes depend on the sampled canvases, so its compute is the counted one: pass the
    run's ``counted`` layer calls. Policies that skip unchanged canvases are counted too.
    """
    if isinstance(policy, FixedRefresh) and not policy.skip_unchanged:
        return layer_calls(split, num_steps, policy.interval)
    if isinstance(policy, ScheduleRefresh) and not policy.skip_unchanged:
        _check_split(split)
        check_num_steps(num_steps)
        refreshes = sum(1 for i in policy.steps if 1 <= i <= num_steps)
        return num_steps * (split.shared + split.denoiser) + refreshes * split.anchor
    if counted is None:
        raise ValueError(f"the compute of {policy!r} depends on the sampled canvases; pass the counted layer calls")
    return counted.total


@dataclass(frozen=True)
class ComputeRow:
    """One cell of a compute table: layer calls and their ratio to a baseline's."""

    name: str
    num_steps: int
    refresh_interval: int
    layer_calls: int
    baseline_layer_calls: int

    @property
    def relative(self) -> float:
        return self.layer_calls / self.baseline_layer_calls

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "steps": self.num_steps,
            "refresh": self.refresh_interval,
            "layer_calls": self.layer_calls,
            "baseline_layer_calls": self.baseline_layer_calls,
            "relative_to_baseline": self.relative,
        }


def compute_row(
    name: str, split: LayerSplit, num_steps: int, refresh_interval: int, baseline_layers: int | None = None
) -> ComputeRow:
    """Layer calls of ``split`` at (T, K), normalised to an uncached ``baseline_layers``-layer model.

    The paper normalises to MDLM (12 layers, no cache); by default the baseline is the same split
    run without cache (K = 1), i.e. T (L_S + L_A + L_D).
    """
    baseline = split.total if baseline_layers is None else baseline_layers
    if isinstance(baseline, bool) or not isinstance(baseline, int) or baseline < 1:
        raise ValueError(f"baseline layers must be an integer >= 1, got {baseline_layers!r}")
    return ComputeRow(
        name=name,
        num_steps=num_steps,
        refresh_interval=refresh_interval,
        layer_calls=layer_calls(split, num_steps, refresh_interval),
        baseline_layer_calls=num_steps * baseline,
    )
