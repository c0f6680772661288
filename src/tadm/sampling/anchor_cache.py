"""Anchor-cache state for Algorithm 1 and the exact count of Transformer-layer calls it causes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import Tensor

from tadm.protocol import LayerSplit
from tadm.sampling.base import check_integer


def check_refresh_interval(refresh_interval: int) -> int:
    """Validate an anchor refresh interval K (an integer >= 1; K = 1 refreshes every step)."""
    return check_integer("anchor refresh interval K", refresh_interval)


def is_refresh_step(step_index: int, num_steps: int, refresh_interval: int) -> bool:
    """Algorithm 1: the anchor is recomputed at reverse step i when (T - i) mod K == 0."""
    return (num_steps - step_index) % refresh_interval == 0


@dataclass
class LayerCallCounter:
    """Transformer-layer evaluations made during one generation, per stage.

    ``shared`` and ``denoiser`` grow by their layer counts at every evaluated step, ``anchor`` at
    every anchor refresh (paper Table 2 / Eq. anchor-cache-compute). Embedding, output head and
    fusion are not Transformer layers and are not counted, as in the paper.
    """

    shared: int = 0
    anchor: int = 0
    denoiser: int = 0
    anchor_refreshes: int = 0
    denoiser_calls: int = 0
    skipped_steps: int = 0

    @property
    def total(self) -> int:
        return self.shared + self.anchor + self.denoiser

    def add_pass(self, split: LayerSplit, refreshed: bool) -> None:
        """One network pass: the shared and denoiser layers, and the anchor layers when it refreshed the anchor."""
        self.shared += split.shared
        self.denoiser += split.denoiser
        self.denoiser_calls += 1
        if refreshed:
            self.anchor += split.anchor
            self.anchor_refreshes += 1

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass
class AnchorCache:
    """The cached anchor h_{t'} with the canvas and step it was computed from.

    Kept apart from the network (like a KV cache) so one model can serve many generations.
    """

    hidden: Tensor | None = None
    canvas: Tensor | None = None
    step_index: int | None = None
    version: int = 0  # bumps on every refresh, so callers can tell whether the cache changed
    history: list[int] = field(default_factory=list)

    def store(self, hidden: Tensor, canvas: Tensor, step_index: int) -> None:
        self.hidden, self.canvas, self.step_index = hidden, canvas, step_index
        self.version += 1
        self.history.append(step_index)

    def reset(self) -> None:
        self.hidden = self.canvas = self.step_index = None
        self.version = 0
        self.history.clear()
