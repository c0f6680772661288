"""The contract between networks and the sampling loop (imported by both, importing neither).

Samplers and the anchor-cache loop (paper Algorithm 1) never import a concrete network: they
drive any object with the members below. A network of ``L_S`` shared, ``L_A`` anchor and ``L_D``
denoiser Transformer layers is evaluated as

    state = prepare(z_t, context, t)        # per-pass state: the time t, or a prompt cache and masks
    c_t = encode(z_t, state)                # shared network S, every step
    h   = compute_anchor(c_t, state)        # anchor network A, only at refresh steps
    out = predict(z_t, c_t, h, state)       # fusion Phi + denoiser D (+ output head), every step

``layer_split`` tells the layer counter how many Transformer layers each stage runs, and
``time_conditioned`` whether the network reads the diffusion time (then the loop passes t(i)).
Networks whose prediction is raw logits for a logits sampler (the entropy-bound sampler) have
``predict_logits``; networks that can compute x_theta on chosen rows only (``predicts_rows``) have
``predict_hidden`` and ``output_log_probs``. :func:`check_network` checks a network once, with a
clear error; the loop then calls the members directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["CacheableDenoiser", "LayerSplit", "RowPredictor", "check_network"]


@dataclass(frozen=True)
class LayerSplit:
    """Numbers of Transformer layers run by the shared, anchor and denoiser stages."""

    shared: int
    anchor: int
    denoiser: int

    @property
    def total(self) -> int:
        return self.shared + self.anchor + self.denoiser


@runtime_checkable
class CacheableDenoiser(Protocol):
    """A diffusion LM split into shared / anchor / (fusion +) denoiser stages (module docstring)."""

    layer_split: LayerSplit
    vocab_size: int  # output vocabulary size V, including the mask token if any
    mask_token_id: int | None
    time_conditioned: bool  # reads the diffusion time t
    predicts_rows: bool  # has predict_hidden + output_log_probs (x_theta on chosen rows only)

    def prepare(self, z_t: Tensor, context: Any = None, t: Tensor | None = None) -> Any:
        """The per-pass state handed to the stages: the time t (B,), or a backbone's prompt cache and masks."""
        ...

    def encode(self, z_t: Tensor, state: Any = None) -> Tensor:
        """Shared network S: token ids (B, L) -> current-state representation c_t (B, L, d)."""
        ...

    def compute_anchor(self, c: Tensor, state: Any = None) -> Tensor:
        """Anchor network A: c_{t'} (B, L, d) -> cacheable anchor h_{t'} (B, L, d_a)."""
        ...

    def predict(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, state: Any = None) -> Tensor:
        """Fusion + denoiser: (z_t, c_t, cached h_{t'}) -> log-probabilities (B, L, V) of x_theta."""
        ...


class RowPredictor(CacheableDenoiser, Protocol):
    """A network that stops before its output layer, so that x_theta can be computed on chosen rows."""

    def predict_hidden(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, state: Any = None) -> tuple[Tensor, Tensor]:
        """Everything but the output layer: (last hidden states (B, L, D), conditioning)."""
        ...

    def output_log_probs(self, hidden: Tensor, cond: Tensor, z_t: Tensor, rows: Tensor | None = None) -> Tensor:
        """The output layer on all positions (B, L, V) or on ``rows`` (n, 2) only (n, V)."""
        ...


def check_network(model: object, prediction: str = "predict") -> None:
    """Raise one TypeError naming every member ``model`` lacks of the loop's contract (module docstring).

    ``prediction`` is the member the sampler needs: ``"predict"`` (log-probabilities) or
    ``"predict_logits"`` (raw logits). Row prediction is checked when ``predicts_rows`` is true.
    """
    needed = ["prepare", "encode", "compute_anchor", prediction]
    if getattr(model, "predicts_rows", False):
        needed += ["predict_hidden", "output_log_probs"]
    missing = [name for name in needed if not callable(getattr(model, name, None))]
    missing += [name for name in ("vocab_size", "mask_token_id", "time_conditioned", "predicts_rows")
                if not hasattr(model, name)]
    if not isinstance(getattr(model, "layer_split", None), LayerSplit):
        missing.append("layer_split")
    if missing:
        raise TypeError(f"model must be a CacheableDenoiser (a tadm model, or a backbone split by "
                        f"tadm.posttrain.AnchoredBackbone); {type(model).__name__} lacks {', '.join(missing)}")
