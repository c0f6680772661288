"""Refresh policies: when Algorithm 1's loop recomputes the anchor, and when it may skip the network.

A policy answers, before each reverse step, two questions:

* **refresh?** recompute the anchor ``h = A(c_i)`` on the current canvas, or keep the cached one;
* **reuse?** skip the network and reuse the previous prediction because the canvas did not change
  since the previous step (MDLM's caching, exact for networks without time conditioning).

Steps are seen both by their *position* ``n = 0, 1, ...`` in the run (``n = T - i`` for a run
``i = T .. 1``; ``n = T`` is the extra final pass of the released samplers at ``i = 0``) and by
their reverse step index ``i``. Policies:

* ``fixed`` (default): every K steps, ``n mod K == 0``, i.e. Algorithm 1's ``(T - i) mod K == 0``;
* ``schedule``: exactly at the listed step indices ``i`` (the first step of a run must be listed);
* ``adaptive`` (beyond the paper): when the share of canvas positions that changed since the canvas
  the cached anchor was computed on reaches ``tau``, never sooner than ``min_interval`` and never
  later than ``max_interval`` steps after the previous refresh. ``tau = 0`` refreshes every step
  (K = 1); ``tau > 1`` with ``max_interval = K`` is ``fixed`` K.

A policy keeps per-run state; the loop calls ``reset()`` at the start of every run.

**One currency.** Every command, config and API that takes K takes a refresh *spec*, parsed in one
place, :func:`parse_refresh`: ``4`` (fixed K), ``fixed:K=4``, ``adaptive:tau=0.3:max_interval=16``,
``schedule:steps=48/40/24`` (``:skip_unchanged=true`` on any), a mapping as YAML and result files hold
it (``{policy: adaptive, tau: 0.3}``, ``{policy: fixed, K: 4}``), or a ready policy;
:func:`parse_refresh_list` reads a comma list (``-K 1,2,adaptive:tau=0.3``). A policy owns its
``key`` (file names, result rows: ``4``, ``adaptive-max_interval16-tau0.3``; :func:`policy_from_key`
reads it back), its ``label()`` (tables, plots: ``K=4``) and its analytic ``refresh_count(T)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from tadm.sampling.anchor_cache import AnchorCache, check_refresh_interval
from tadm.sampling.base import check_number

__all__ = ["REFRESH_POLICIES", "AdaptiveRefresh", "FixedRefresh", "RefreshPolicy", "StepPlan", "ScheduleRefresh",
           "get_refresh_policy", "parse_refresh", "parse_refresh_list", "policy_from_key", "refresh_policy_from_config"]


@dataclass(frozen=True)
class StepPlan:
    """What the loop does at one step: recompute the anchor, and/or reuse the previous prediction."""

    refresh: bool
    reuse: bool = False


def _same_canvas(a: Tensor | None, b: Tensor) -> bool:
    return a is not None and a.shape == b.shape and bool(torch.equal(a, b))


class RefreshPolicy:
    """Base class: ``due`` says whether a refresh is due; ``plan`` adds the unchanged-canvas skip.

    Args:
        skip_unchanged: reuse the previous prediction when the canvas equals the previous step's and
            the anchor would not change (a refresh due on a canvas identical to the cached one is
            skipped too, since it would recompute the same anchor).
    """

    name: ClassVar[str] = ""
    parameters: ClassVar[tuple[str, ...]] = ()  # the constructor's parameters besides skip_unchanged, in order

    def __init__(self, skip_unchanged: bool = False) -> None:
        self.skip_unchanged = bool(skip_unchanged)
        self.reset()

    def reset(self) -> None:
        """Forget per-run state (called by the loop before each run)."""
        self.last_refresh_position: int | None = None

    def due(self, position: int, step_index: int | Tensor, z: Tensor, cache: AnchorCache) -> bool:
        raise NotImplementedError

    def plan(
        self,
        position: int,
        step_index: int | Tensor,
        z: Tensor,
        cache: AnchorCache,
        previous_canvas: Tensor | None = None,
    ) -> StepPlan:
        """Decide the step at ``position`` (step index ``step_index``) on canvas ``z`` (B, L)."""
        due = self.due(position, step_index, z, cache)
        if self.skip_unchanged:
            anchor_current = _same_canvas(cache.canvas, z)
            if _same_canvas(previous_canvas, z) and (not due or anchor_current):
                return StepPlan(refresh=False, reuse=True)
            due = due and not anchor_current
        if due:
            self.last_refresh_position = position
        return StepPlan(refresh=due)

    def config(self) -> dict[str, Any]:
        """Name and parameters, as written to results files."""
        config: dict[str, Any] = {"policy": self.name, "skip_unchanged": self.skip_unchanged}
        for name in self.parameters:
            value = getattr(self, name)
            config[name] = list(value) if isinstance(value, tuple) else value  # a schedule's steps as a list
        return config

    def label(self) -> str:
        """A short label for tables and plots, e.g. ``K=4`` or ``adaptive tau=0.1 (skip unchanged)``."""
        return self.describe() + (" (skip unchanged)" if self.skip_unchanged else "")

    def describe(self) -> str:
        """:meth:`label` without the skip_unchanged note."""
        return self.name

    def defaults(self) -> dict[str, Any]:
        """Parameter values left out of :attr:`key` (the constructor's defaults)."""
        return {"skip_unchanged": False}

    @property
    def key(self) -> str:
        """The policy in file names and result rows: ``"4"`` for fixed K, else its name and non-default parameters."""
        params = {k: v for k, v in self.config().items() if k != "policy" and self.defaults().get(k, object()) != v}
        parts = [self.name]
        for name in sorted(params):
            value = params[name]
            parts.append(name + ("_".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)))
        return "-".join(parts)

    @property
    def record(self) -> int | str:
        """The key as unit specs and result rows record it: an int K for a plain fixed interval, else :attr:`key`."""
        return int(self.key) if self.key.isdigit() else self.key

    @property
    def fixed_interval(self) -> int | None:
        """K of a fixed policy that always runs the network (Algorithm 1 exactly), else None."""
        return None

    def refresh_count(self, num_steps: int) -> int | None:
        """Anchor refreshes of a T-step run, or None when they depend on the sampled canvases."""
        return None

    def check_steps(self, num_steps: int) -> None:
        """Raise ValueError when the policy cannot drive a run of ``num_steps`` reverse steps (every policy can but
        a schedule that does not list i = T)."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "policy")
        return f"{type(self).__name__}({params})"


class FixedRefresh(RefreshPolicy):
    """Algorithm 1: refresh every K steps, at positions n = 0, K, 2K, ... (``(T - i) mod K == 0``)."""

    name = "fixed"
    parameters = ("interval",)

    def __init__(self, interval: int = 1, skip_unchanged: bool = False) -> None:
        self.interval = check_refresh_interval(interval)
        super().__init__(skip_unchanged)

    def due(self, position: int, step_index: int | Tensor, z: Tensor, cache: AnchorCache) -> bool:
        return position % self.interval == 0

    def describe(self) -> str:
        return f"K={self.interval}"

    @property
    def key(self) -> str:
        return str(self.interval) if not self.skip_unchanged else super().key

    @property
    def fixed_interval(self) -> int | None:
        return None if self.skip_unchanged else self.interval

    def refresh_count(self, num_steps: int) -> int | None:
        return None if self.skip_unchanged else -(-int(num_steps) // self.interval)


class ScheduleRefresh(RefreshPolicy):
    """Refresh exactly at the listed reverse step indices i (e.g. ``[128, 120, 100, 60]``).

    The list must include the run's first step i = T; steps above T are never reached, so one schedule serves
    runs of several T (``128/64/32/16`` at T = 32 refreshes at 32 and 16). Step 0 is the sampler's final pass
    over masks left after i = 1, run only by samplers that have one and only when masks are left; it is not
    counted by :meth:`refresh_count`."""

    name = "schedule"
    parameters = ("steps",)

    def __init__(self, steps: Iterable[int], skip_unchanged: bool = False) -> None:
        if isinstance(steps, int) and not isinstance(steps, bool):
            steps = (steps,)  # one step: ``schedule:steps=128``
        steps = tuple(steps) if not isinstance(steps, (str, bytes)) else ()
        if not steps or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
            raise ValueError(f"a refresh schedule is a non-empty list of step indices i >= 0, got {steps!r}")
        self.steps = tuple(sorted(set(steps), reverse=True))
        super().__init__(skip_unchanged)

    def due(self, position: int, step_index: int | Tensor, z: Tensor, cache: AnchorCache) -> bool:
        if isinstance(step_index, Tensor):
            raise TypeError("a refresh schedule needs one step index per step, not one per row")
        return step_index in self.steps

    def describe(self) -> str:
        return f"schedule({len(self.steps)})"

    def refresh_count(self, num_steps: int) -> int | None:
        self.check_steps(num_steps)
        return None if self.skip_unchanged else sum(1 for i in self.steps if 1 <= i <= num_steps)

    def check_steps(self, num_steps: int) -> None:
        if num_steps not in self.steps:
            raise ValueError(f"the refresh schedule must list the first step, i = T = {num_steps} (the anchor is "
                             f"computed there), got steps {'/'.join(map(str, self.steps))}")


class AdaptiveRefresh(RefreshPolicy):
    """Refresh when the canvas has drifted from the cached anchor's canvas by a share ``tau``.

    drift = share of the batch's canvas positions whose token differs from the canvas the cached
    anchor was computed on. A refresh happens at step n when the cache is empty, or when
    ``n - n_last >= min_interval`` and (drift >= tau or ``n - n_last >= max_interval``).
    Computing the drift reads one number from the device per step.

    Args:
        tau: drift threshold in [0, inf); 0 refreshes every step, > 1 only at ``max_interval``.
        min_interval: the fewest steps between refreshes (>= 1).
        max_interval: the most steps between refreshes (>= min_interval), or None for no bound.
    """

    name = "adaptive"
    parameters = ("tau", "min_interval", "max_interval")

    def __init__(
        self, tau: float, min_interval: int = 1, max_interval: int | None = None, skip_unchanged: bool = False
    ) -> None:
        self.tau = check_number("adaptive refresh policy", "tau (share of changed positions)", tau, low=0.0)
        self.min_interval = check_refresh_interval(min_interval)
        if max_interval is not None:
            check_refresh_interval(max_interval)
            if max_interval < min_interval:
                raise ValueError(f"adaptive max_interval {max_interval} is below min_interval {min_interval}")
        elif self.tau > 1.0:
            raise ValueError(f"adaptive refresh policy: tau {tau!r} > 1 never refreshes the anchor again (a share of "
                             "changed positions is at most 1); use tau in [0, 1], or set max_interval")
        self.max_interval = max_interval
        super().__init__(skip_unchanged)

    def due(self, position: int, step_index: int | Tensor, z: Tensor, cache: AnchorCache) -> bool:
        if cache.hidden is None or self.last_refresh_position is None:
            return True
        age = position - self.last_refresh_position
        if age < self.min_interval:
            return False
        if self.max_interval is not None and age >= self.max_interval:
            return True
        if self.tau == 0.0:
            return True
        if cache.canvas is None or cache.canvas.shape != z.shape:
            return True
        drift = (z != cache.canvas).float().mean()
        return bool(drift >= self.tau)

    def describe(self) -> str:
        bound = "" if self.max_interval is None else f",<={self.max_interval}"
        return f"adaptive tau={self.tau:g}{bound}"

    def defaults(self) -> dict[str, Any]:
        return {**super().defaults(), "min_interval": 1, "max_interval": None}


REFRESH_POLICIES: dict[str, type[RefreshPolicy]] = {
    cls.name: cls for cls in (FixedRefresh, ScheduleRefresh, AdaptiveRefresh)
}


def get_refresh_policy(name: str | RefreshPolicy = "fixed", **params: Any) -> RefreshPolicy:
    """Build the refresh policy called ``name`` with ``params`` (an instance is returned as is).

    ``get_refresh_policy("fixed", interval=4)``, ``get_refresh_policy("schedule", steps=[32, 24, 8])``,
    ``get_refresh_policy("adaptive", tau=0.1, max_interval=16)``.
    """
    if isinstance(name, RefreshPolicy):
        if params:
            raise ValueError(f"parameters {sorted(params)} given with a ready policy {name!r}")
        return name
    try:
        cls = REFRESH_POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown refresh policy {name!r}; valid: {', '.join(REFRESH_POLICIES)}") from None
    accepted = inspect.signature(cls).parameters
    required = [p for p, spec in accepted.items() if spec.default is inspect.Parameter.empty and p not in params]
    unknown = sorted(set(params) - set(accepted))
    if required or unknown:
        problem = " and ".join(([f"has no parameter {', '.join(map(repr, unknown))}"] if unknown else [])
                               + ([f"needs {', '.join(required)}"] if required else []))
        raise ValueError(f"refresh policy {name!r} {problem}; its parameters: {', '.join(accepted)} "
                         f"(valid forms: {SPEC_FORMS})")
    return cls(**params)


SPEC_FORMS = ("4, fixed:K=4, adaptive:tau=0.3[:max_interval=16], schedule:steps=48/40/24 (each may add "
              ":skip_unchanged=true), or a mapping {policy: adaptive, tau: 0.3}")
_ALIASES = {"K": "interval", "k": "interval"}


def _spec_value(text: str) -> Any:
    """A parameter value of a spec string: an int, a float, true/false, none, or a list ``48/40/24``."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if "/" in text:
        return [_spec_value(part) for part in text.split("/") if part.strip()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def _from_mapping(config: dict[str, Any]) -> RefreshPolicy:
    params = {_ALIASES.get(k, k): v for k, v in config.items() if k != "policy"}
    name = config.get("policy", "fixed" if "interval" in params else None)
    if name is None:
        raise ValueError(f"a refresh mapping needs a 'policy' key (or K), got {config!r}; valid forms: {SPEC_FORMS}")
    return get_refresh_policy(name, **params)


def parse_refresh(spec: Any) -> RefreshPolicy:
    """The refresh policy ``spec`` names: the one place K is parsed (module docstring). A ValueError names it."""
    if isinstance(spec, RefreshPolicy):
        return spec
    if isinstance(spec, dict):
        return _from_mapping(spec)
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise ValueError(f"refresh spec {spec!r} is not a refresh policy; valid forms: {SPEC_FORMS}")
    if isinstance(spec, int):
        return FixedRefresh(spec)
    text = spec.strip()
    if text.lstrip("-").isdigit():
        return FixedRefresh(int(text))
    name, _, rest = text.partition(":")
    params: dict[str, Any] = {}
    if name.strip().lstrip("-").isdigit():  # ``4:skip_unchanged=true``: the short form of K with parameters
        name, params["interval"] = "fixed", int(name)
    for item in (part for part in rest.split(":") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"refresh spec {spec!r}: {item!r} is not KEY=VALUE; valid forms: {SPEC_FORMS}")
        param = _ALIASES.get(key.strip(), key.strip())
        if param in params:
            raise ValueError(f"refresh spec {spec!r} gives {param!r} twice; valid forms: {SPEC_FORMS}")
        params[param] = _spec_value(value)
    if name not in REFRESH_POLICIES:
        raise ValueError(f"refresh spec {spec!r}: unknown policy {name!r}; valid forms: {SPEC_FORMS}")
    return get_refresh_policy(name, **params)


def parse_refresh_list(specs: Any) -> list[RefreshPolicy]:
    """Policies from a comma list (``"1,2,adaptive:tau=0.3"``), one spec, or a sequence of specs; no key twice."""
    if isinstance(specs, str):
        items: list[Any] = [part for part in specs.split(",")]
        if len(items) > 1 and not all(part.strip() for part in items):
            raise ValueError(f"refresh list {specs!r} has an empty item; valid forms: {SPEC_FORMS}")
    elif isinstance(specs, (list, tuple)):
        items = list(specs)
    else:
        items = [specs]
    if not items:
        raise ValueError(f"no refresh policy given; valid forms: {SPEC_FORMS}")
    policies = [parse_refresh(item) for item in items]
    keys = [p.key for p in policies]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the same refresh policy is listed twice: {', '.join(keys)}")
    return policies


def policy_from_key(key: Any) -> RefreshPolicy:
    """The policy a :attr:`RefreshPolicy.key` (or a result row's ``refresh`` value) stands for."""
    if isinstance(key, int) or str(key).lstrip("-").isdigit():
        return FixedRefresh(int(key))
    name, *parts = str(key).split("-")
    params: dict[str, Any] = {}
    for part in parts:
        split = next((n for n in range(len(part), 0, -1) if part[:n] in _KEY_PARAMETERS), None)
        if split is None:
            raise ValueError(f"refresh key {key!r}: cannot read {part!r}")
        value = part[split:]
        params[part[:split]] = ([_spec_value(v) for v in value.split("_")] if part[:split] == "steps"
                                else _spec_value(value))
    return get_refresh_policy(name, **params)


_KEY_PARAMETERS = {"skip_unchanged", *(name for cls in REFRESH_POLICIES.values() for name in cls.parameters)}


refresh_policy_from_config = parse_refresh  # the name results files and the README have used for the mapping form
