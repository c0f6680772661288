"""Paired comparisons counted over their independent units: distinct prompts, or training seeds.

Repeats are not independent evidence. A held-out set whose 200 items hold 19 distinct prompts, run
with three sampling seeds, gives 600 outcomes per method but only 19 units for a test: items that
share a prompt, and the sampling seeds of one trained model, are averaged into one value per
prompt before anything is tested. Across trained models the unit is the training seed (one effect
per model). Everything here is plain arithmetic over those units:

* :func:`prompt_differences`: per distinct prompt, the mean correctness of method A minus that of
  method B, over every item with that prompt and every sampling seed (the paired design: both
  methods saw the same prompts with the same seeds);
* :func:`paired_summary`: over units ``d_1..d_n``, the mean difference with its two-sided 95 %
  Student-t interval ``mean +- t_{0.975, n-1} * sd / sqrt(n)``, the two-sided paired t-test of a
  zero mean (``t = mean / (sd / sqrt(n))``, n - 1 degrees of freedom), the count of units where A is
  ahead, behind or tied, and the two-sided exact sign test over the untied units;
* :func:`sign_test`: ``min(1, 2 * P(X <= min(wins, losses)))`` for ``X ~ Binomial(wins + losses, 1/2)``;
* :func:`recovered_share`: the share of the naive-reuse loss a method wins back,
  ``(method - naive) / (reference - naive)``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

__all__ = ["PairedSummary", "mean_interval", "paired_summary", "prompt_differences", "recovered_share", "sign_test"]


def _stats() -> ModuleType:
    """``scipy.stats``, imported on first use."""
    # deferred: importing scipy.stats takes about 0.6 s, which every `tadm` command would pay at start-up (the CLI
    # imports this module through the study and task tables), while only the paired comparisons use it
    from scipy import stats

    return stats


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test of ``wins`` against ``losses`` (ties left out); 1.0 with no untied unit."""
    n = int(wins) + int(losses)
    if n == 0:
        return 1.0
    return float(_stats().binomtest(int(wins), n, 0.5, alternative="two-sided").pvalue)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t interval of the mean over ``values``; NaN bounds for fewer than two."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_interval needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = _stats().t.ppf(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class PairedSummary:
    """A paired comparison A - B over ``units`` independent units (prompts or training seeds)."""

    units: int
    mean: float  # mean difference A - B over the units
    low: float  # 95 % Student-t interval of that mean (NaN for one unit)
    high: float
    ahead: int  # units where A - B > 0
    behind: int  # units where A - B < 0
    tied: int
    sign_p: float  # two-sided exact sign test of ahead vs behind
    t_p: float  # two-sided paired t-test of a zero mean difference (NaN for one unit or no spread)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_summary(differences: Iterable[float], confidence: float = 0.95) -> PairedSummary:
    """:class:`PairedSummary` of per-unit differences A - B (one number per independent unit)."""
    d = [float(x) for x in differences]
    if not d:
        raise ValueError("paired_summary needs at least one unit")
    bad = next((n for n, x in enumerate(d) if not math.isfinite(x)), None)
    if bad is not None:
        raise ValueError(f"paired_summary: the difference of unit {bad} is {d[bad]}; leave out units without a value")
    mean, low, high = mean_interval(d, confidence)
    ahead, behind = sum(x > 0 for x in d), sum(x < 0 for x in d)
    spread = len(d) > 1 and statistics.stdev(d) > 0
    t_p = float(_stats().ttest_1samp(d, 0.0).pvalue) if spread else math.nan
    return PairedSummary(len(d), mean, low, high, ahead, behind, len(d) - ahead - behind,
                         sign_test(ahead, behind), t_p)


def _per_prompt(runs: Iterable[Sequence[tuple[Hashable, bool]]]) -> dict[Hashable, float]:
    """Mean correctness per prompt over every (prompt, correct) item of every run."""
    total: dict[Hashable, list[float]] = defaultdict(list)
    for run in runs:
        for prompt, correct in run:
            total[prompt].append(float(bool(correct)))
    return {prompt: statistics.fmean(v) for prompt, v in total.items()}


def prompt_differences(a_runs: Iterable[Sequence[tuple[Hashable, bool]]],
                       b_runs: Iterable[Sequence[tuple[Hashable, bool]]]) -> dict[Hashable, float]:
    """Per distinct prompt, A's mean correctness minus B's (means over items and runs, e.g. sampling seeds).

    Each run is a sequence of ``(prompt, correct)`` items; run i of A and run i of B are the same
    sampling seed. Both methods must have seen the same prompts with the same seeds: as many runs
    each, and run i of both holding the same prompts as often. Anything else is an error, not a
    silent drop or a mean over unequal seeds.
    """
    a_runs, b_runs = list(a_runs), list(b_runs)
    if len(a_runs) != len(b_runs):
        raise ValueError(f"prompt_differences: method A has {len(a_runs)} runs (sampling seeds) and method B "
                         f"{len(b_runs)}; pass the runs of the same seeds for both, in the same order")
    for i, (run_a, run_b) in enumerate(zip(a_runs, b_runs)):
        seen_a, seen_b = Counter(p for p, _ in run_a), Counter(p for p, _ in run_b)
        if seen_a != seen_b:
            only = sorted(map(str, (seen_a - seen_b) | (seen_b - seen_a)))[:3]
            raise ValueError(f"the two methods were not run on the same prompts in run {i} (e.g. {only}): "
                             "pass runs of the same seed on the same items for both")
    a, b = _per_prompt(a_runs), _per_prompt(b_runs)
    return {prompt: a[prompt] - b[prompt] for prompt in a}


def recovered_share(reference: float, naive: float, method: float) -> float:
    """``(method - naive) / (reference - naive)``: the share of the naive-reuse loss ``method`` wins back.

    NaN when naive reuse lost nothing (``reference <= naive``): there is no loss to recover.
    """
    gap = reference - naive
    return (method - naive) / gap if gap > 0 else math.nan
