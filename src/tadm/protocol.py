"""The contract between networks and the sampling loop (imported by both, importing neither).

Samplers and the anchor-cache loop (paper Algorithm 1) never import a concrete network: they
drive any object with the four methods below. A network of ``L_S`` shared, ``L_A`` anchor and
``L_D`` denoiser Transformer layers is evaluated as

    c_t = encode(z_t)                       # shared network S, every step
    h   = compute_anchor(c_t)               # anchor network A, only at refresh steps
    log_probs = predict(z_t, c_t, h)        # fusion Phi + denoiser D (+ output head), every step

and ``layer_split`` tells the layer counter how many Transformer layers each stage runs.

A network that needs per-pass state besides the canvas (a prompt KV cache, self-conditioning
input, masks) also has ``prepare(z_t, context, t) -> state``; the loop then passes that state where
the others take the time ``t`` (see :func:`tadm.sampling.loop.pass_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor


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
    """A diffusion LM split into shared / anchor / (fusion +) denoiser stages.

    ``t`` is the diffusion time of the canvas, shape (B,), used only by networks with time
    conditioning; others ignore it.
    """

    layer_split: LayerSplit
    vocab_size: int          # output vocabulary size V, including the mask token if any
    mask_token_id: int | None

    def encode(self, z_t: Tensor, t: Tensor | None = None) -> Tensor:
        """Shared network S: token ids (B, L) -> current-state representation c_t (B, L, d)."""
        ...

    def compute_anchor(self, c: Tensor, t: Tensor | None = None) -> Tensor:
        """Anchor network A: c_{t'} (B, L, d) -> cacheable anchor h_{t'} (B, L, d_a)."""
        ...

    def predict(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, t: Tensor | None = None) -> Tensor:
        """Fusion + denoiser: (z_t, c_t, cached h_{t'}) -> log-probabilities (B, L, V) of x_theta."""
        ...


def check_denoiser(model: object, needs: tuple[str, ...] = ("predict",)) -> None:
    """Raise a one-line TypeError unless ``model`` has the stages the loop calls (and ``needs``).

    The loop calls ``encode``, ``compute_anchor``, one of ``needs`` (``predict`` for log-probabilities,
    ``predict_logits`` for raw logits) and reads ``layer_split``.
    """
    required = ("encode", "compute_anchor", *needs)
    missing = [name for name in required if not callable(getattr(model, name, None))]
    if not isinstance(getattr(model, "layer_split", None), LayerSplit):
        missing.append("layer_split")
    if missing:
        raise TypeError(f"model must be a CacheableDenoiser (a tadm model, or a backbone split by "
                        f"tadm.posttrain.AnchoredBackbone); {type(model).__name__} lacks {', '.join(missing)}")
