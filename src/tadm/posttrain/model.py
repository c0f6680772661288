"""A frozen backbone split into shared / anchor / denoiser layers plus the paired-attention fusion.

Section "Model Decomposition" and appendix "TADM:Post-train": with layer boundaries
``0 <= s < a <= N``

    S: embedding (+ self-conditioning) and layers [0, s)        -> C,  every step
    A: layers [s, a)                                             -> H0, at anchor refreshes only
    Phi: paired-attention fusion of (C, C0, H0)                  -> H~, Eq. (stale-anchor-fusion-app)
    D: layers [a, N), final norm and output head                 -> logits, every step

The paper's DiffusionGemma split is s = 2, a = 22 of N = 30 layers. The cached anchor keeps the
shallow state C0 computed at the refresh beside the deep state H0: ``compute_anchor`` returns them
packed as ``[H0, C0]`` along the feature axis (d_a = 2d), so the generic anchor-cache loop
(:func:`tadm.sampling.generate`) caches both. :class:`AnchoredBackbone` satisfies
:class:`tadm.protocol.CacheableDenoiser`. Only the fusion has trainable parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from tadm.nn.fusion import PairedAttentionFusion
from tadm.posttrain.backbone import LayerStackBackbone, StackContext
from tadm.protocol import LayerSplit

__all__ = ["FUSION_MODES", "AnchoredBackbone", "FusionSpec", "SplitSpec"]

FUSION_MODES = ("paired", "naive")
"""Fusion modes: "paired" is the paired-attention fusion; "naive" lets the denoiser read the stale H0 directly."""


@dataclass(frozen=True)
class SplitSpec:
    """Layer counts of the shared, anchor and denoiser stages (paper default for 30 layers: 2 / 20 / 8).

    ``denoiser_layers`` None means "all remaining layers".
    """

    shared_layers: int = 2
    anchor_layers: int = 20
    denoiser_layers: int | None = None

    def resolve(self, num_layers: int) -> LayerSplit:
        """The split of a ``num_layers``-layer stack; raises ValueError naming the bad count."""
        for name in ("shared_layers", "anchor_layers", "denoiser_layers"):
            value = getattr(self, name)
            if value is None and name == "denoiser_layers":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"split {name} must be an integer >= 0, got {value!r}")
        if self.anchor_layers < 1:
            raise ValueError(
                f"split anchor_layers must be >= 1: an empty anchor network has nothing to cache "
                f"(got shared={self.shared_layers}, anchor={self.anchor_layers} of {num_layers} layers)"
            )
        used = self.shared_layers + self.anchor_layers
        if used > num_layers:
            raise ValueError(
                f"split shared_layers + anchor_layers = {self.shared_layers} + {self.anchor_layers} = {used} "
                f"exceeds the backbone's {num_layers} layers (valid layer indices 0..{num_layers - 1})"
            )
        denoiser = num_layers - used if self.denoiser_layers is None else self.denoiser_layers
        if used + denoiser != num_layers:
            raise ValueError(
                f"split {self.shared_layers} + {self.anchor_layers} + {denoiser} = {used + denoiser} layers does not "
                f"cover the backbone's {num_layers} layers; set denoiser_layers={num_layers - used} or leave it unset"
            )
        return LayerSplit(shared=self.shared_layers, anchor=self.anchor_layers, denoiser=denoiser)


@dataclass(frozen=True)
class FusionSpec:
    """Size of the paired-attention fusion (paper: rank 256, 4 heads, gate bias -3, eps 1e-6)."""

    rank: int = 256
    num_heads: int = 4
    eps: float = 1e-6
    gate_bias: float = -3.0

    def build(self, hidden_size: int) -> PairedAttentionFusion:
        return PairedAttentionFusion(hidden_size, self.rank, self.num_heads, self.eps, self.gate_bias)


class AnchoredBackbone(nn.Module):
    """A frozen layer-stack backbone split for anchor caching, with a trainable paired-attention fusion.

    Implements :class:`tadm.protocol.CacheableDenoiser`. The per-pass inputs besides the
    canvas (prompt KV cache, self-conditioning logits) come from a :class:`StackContext`: the
    stage methods take ``prepared = model.prepare(z, context, t)`` (Algorithm 1's loop passes the
    caller's context explicitly); without it they prepare a pass with an empty context.

    Args:
        backbone: a :class:`~tadm.posttrain.backbone.LayerStackBackbone` (its weights are frozen here).
        split: a :class:`SplitSpec` or :class:`LayerSplit`, validated against the backbone's layer count.
        fusion: a :class:`FusionSpec`, a ready :class:`PairedAttentionFusion`, or None for the default spec.
        fusion_mode: "paired" or "naive" (naive reuse: D reads the stale H0; the paper's baseline).
    """

    def __init__(
        self,
        backbone: LayerStackBackbone,
        split: SplitSpec | LayerSplit = SplitSpec(),
        fusion: FusionSpec | PairedAttentionFusion | None = None,
        fusion_mode: str = "paired",
    ) -> None:
        super().__init__()
        if not isinstance(backbone, LayerStackBackbone):
            raise TypeError(f"{type(backbone).__name__} does not implement tadm.posttrain.backbone.LayerStackBackbone")
        spec = SplitSpec(split.shared, split.anchor, split.denoiser) if isinstance(split, LayerSplit) else split
        self.layer_split: LayerSplit = spec.resolve(backbone.num_layers)
        backbone.requires_grad_(False)
        self.backbone = backbone
        fusion = FusionSpec() if fusion is None else fusion
        if isinstance(fusion, FusionSpec):
            self.fusion_spec = fusion
            fusion = fusion.build(backbone.hidden_size)
        else:  # a ready module: its sizes and initial gate bias (the trained one is in its weights)
            self.fusion_spec = FusionSpec(rank=fusion.rank, num_heads=fusion.num_heads, eps=fusion.eps,
                                          gate_bias=getattr(fusion, "gate_bias", FusionSpec.gate_bias))
        if fusion.hidden_size != backbone.hidden_size:
            raise ValueError(
                f"fusion hidden_size {fusion.hidden_size} != backbone hidden_size {backbone.hidden_size}"
            )
        self.fusion = fusion
        self.fusion_mode = fusion_mode
        self.vocab_size: int = backbone.vocab_size
        self.mask_token_id: int | None = backbone.mask_token_id

    # ---------------------------------------------------------------- configuration
    @property
    def fusion_mode(self) -> str:
        return self._fusion_mode

    @fusion_mode.setter
    def fusion_mode(self, mode: str) -> None:
        if mode not in FUSION_MODES:
            raise ValueError(f"unknown fusion mode {mode!r}; valid: {', '.join(FUSION_MODES)}")
        self._fusion_mode = mode

    @property
    def shared_end(self) -> int:
        """s: the first anchor layer."""
        return self.layer_split.shared

    @property
    def anchor_end(self) -> int:
        """a: the first denoiser layer."""
        return self.layer_split.shared + self.layer_split.anchor

    @property
    def num_layers(self) -> int:
        return self.layer_split.total

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    def adapter_params(self) -> dict[str, nn.Parameter]:
        """The trainable parameters: the fusion's, by name."""
        return self.fusion.adapter_params()

    def train(self, mode: bool = True) -> AnchoredBackbone:
        """Train mode reaches the fusion only; the frozen backbone stays in eval mode."""
        self.training = mode
        self.fusion.train(mode)
        self.backbone.train(False)
        return self

    predicts_rows = False  # its samplers consume the full logits

    @property
    def time_conditioned(self) -> bool:
        return self.backbone.time_conditioned

    # ---------------------------------------------------------------- per-pass state
    def prepare(self, z: Tensor, context: StackContext | None = None, t: Tensor | None = None) -> Any:
        """Per-pass state for a canvas z (B, L): the backbone's masks and tables for ``context`` at time t.

        The state a backbone needs between passes (prompt KV cache, self-conditioning input) comes
        only from ``context``; nothing is kept on the model.
        """
        context = StackContext() if context is None else context
        return self.backbone.prepare(z.shape[0], z.shape[1], z.device, context.with_time(t))

    # ---------------------------------------------------------------- the stages (CacheableDenoiser)
    def encode(self, z_t: Tensor, prepared: Any = None) -> Tensor:
        """S: token ids (B, L) -> current shallow state C (B, L, d); ``prepared`` from :meth:`prepare`."""
        prepared = self.prepare(z_t) if prepared is None else prepared
        h = self.backbone.embed(z_t, prepared)  # (B, L, d)
        return self.backbone.run_layers(h, 0, self.shared_end, prepared)

    def compute_anchor(self, c: Tensor, prepared: Any = None) -> Tensor:
        """A: shallow state C0 (B, L, d) -> cacheable anchor ``[H0, C0]`` (B, L, 2d)."""
        prepared = self.prepare(c[..., 0]) if prepared is None else prepared
        h0 = self.backbone.run_layers(c, self.shared_end, self.anchor_end, prepared)  # (B, L, d)
        return torch.cat([h0, c.to(h0.dtype)], dim=-1)  # (B, L, 2d)

    def unpack_anchor(self, anchor: Tensor) -> tuple[Tensor, Tensor]:
        """``[H0, C0]`` (B, L, 2d) -> (H0, C0), each (B, L, d)."""
        d = self.hidden_size
        if anchor.shape[-1] != 2 * d:
            raise ValueError(f"a cached anchor has {2 * d} features ([H0, C0]); got shape {tuple(anchor.shape)}")
        return anchor[..., :d], anchor[..., d:]

    def fuse(self, c: Tensor, anchor: Tensor, *, fusion: Callable[..., Tensor] | None = None) -> Tensor:
        """Phi: H~ = H0 + g * s_H * (M W_up), Eq. (stale-anchor-fusion-app); (B, L, d).

        A fresh anchor (C equal to C0) returns H0 unchanged, as the fusion does exactly; naive mode
        always returns H0. ``fusion`` overrides the module called (e.g. a DDP wrapper of it); with an
        override the fusion is always evaluated, so that every parameter takes part in backward.
        """
        h0, c0 = self.unpack_anchor(anchor)
        if self.fusion_mode == "naive":
            return h0
        if fusion is None:
            if c.shape == c0.shape and torch.equal(c, c0.to(c.dtype)):
                return h0
            fusion = self.fusion
        return fusion(c, c0.to(c.dtype), h0)

    def denoise_logits(self, h: Tensor, prepared: Any) -> Tensor:
        """D: layers [a, N), final norm and head on a (fused) anchor (B, L, d) -> float32 logits (B, L, V)."""
        h = self.backbone.run_layers(h, self.anchor_end, self.num_layers, prepared)  # (B, L, d)
        return self.backbone.logits(h, prepared)

    def predict_logits(
        self,
        z_t: Tensor,
        c_t: Tensor,
        anchor: Tensor,
        prepared: Any = None,
        *,
        fusion: Callable[..., Tensor] | None = None,
    ) -> Tensor:
        """Fusion + denoiser: raw logits (B, L, V) of x_theta(z_t, z_t'), Eq. (DenoiserOp)."""
        prepared = self.prepare(z_t) if prepared is None else prepared
        return self.denoise_logits(self.fuse(c_t, anchor, fusion=fusion), prepared)

    def predict(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, prepared: Any = None) -> Tensor:
        """Fusion + denoiser: log-probabilities (B, L, V) in the backbone's output parameterisation."""
        return self.backbone.log_probs(self.predict_logits(z_t, c_t, anchor, prepared), z_t)

    def fresh_logits(self, c: Tensor, prepared: Any) -> Tensor:
        """The unsplit backbone's logits from a shallow state C: D(A(C)) with no fusion (B, L, V)."""
        return self.denoise_logits(self.backbone.run_layers(c, self.shared_end, self.anchor_end, prepared), prepared)

    def forward(self, z_t: Tensor, context: StackContext | None = None) -> Tensor:
        """Fresh-anchor logits (B, L, V) of the whole split model for a canvas (B, L)."""
        prepared = self.prepare(z_t, context)
        c = self.encode(z_t, prepared=prepared)
        return self.predict_logits(z_t, c, self.compute_anchor(c, prepared=prepared), prepared=prepared)
