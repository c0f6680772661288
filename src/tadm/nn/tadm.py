"""The time-anchored diffusion LM of TADM:Pretraining: shared S, anchor A, fusion Phi, denoiser D.

Section "Model Decomposition" and appendix "TADM:Pretrain":

* S: the token embedding, run on the current state ``z_t`` (and on the stale state ``z_t'``);
* A: ``anchor_layers`` DiT blocks producing the cacheable anchor ``h_t'``;
* Phi: :class:`~tadm.nn.fusion.GatedResidualFusion` of ``c_t = S(z_t)`` with ``h_t'``;
* D: ``denoiser_layers`` DiT blocks and a DiT output layer, SUBS-parameterised.

An optional anchor LM head (a second output layer on ``h``) is used only in training, for the
anchor loss with gamma > 0 (Eq. (anchor-loss)); it is not part of the inference graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from tadm.nn.base import MaskedDiffusionNetwork, MaskedDiffusionSizes, check_bool
from tadm.nn.dit import remove_mask_log_probs
from tadm.nn.fusion import GatedResidualFusion
from tadm.nn.hub import TINY_SIZES, HubMixin, size_preset
from tadm.protocol import LayerSplit


@dataclass
class TADMConfig(MaskedDiffusionSizes):
    """Sizes of a TADM network (shared fields: :class:`~tadm.nn.sizes.MaskedDiffusionSizes`).

    Defaults are the paper's small model (224M inference parameters).
    """

    anchor_layers: int = 12
    denoiser_layers: int = 6
    anchor_lm_head: bool = True  # training-only head for the anchor loss (gamma > 0)

    layer_fields: ClassVar[tuple[str, ...]] = ("anchor_layers", "denoiser_layers")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(type(self).__name__, "anchor_lm_head", self.anchor_lm_head)


@dataclass
class TADMOutput:
    """What :meth:`TADM.forward` returns."""

    log_probs: Tensor  # (B, L, V) SUBS log-probabilities of x_theta(z_t, z_t')
    anchor_log_probs: Tensor | None  # (B, L, V) anchor LM head log-probabilities, or None without the head
    anchor_hidden: Tensor  # (B, L, D) the anchor h_t' = A(S(z_t'))


class TADM(MaskedDiffusionNetwork, HubMixin, model_type="tadm"):
    """Time-anchored diffusion LM; satisfies :class:`tadm.protocol.CacheableDenoiser`.

    Fresh prediction: ``x_theta(z_t) = D(Phi(S(z_t), A(S(z_t))))``; with a cached anchor from
    ``z_t'``: ``x_theta(z_t, z_t') = D(Phi(S(z_t), A(S(z_t'))))``, Eq. (DenoiserOp).
    """

    config_class = TADMConfig

    def __init__(self, config: TADMConfig | None = None) -> None:
        config = TADMConfig() if config is None else config
        super().__init__(config, LayerSplit(shared=0, anchor=config.anchor_layers, denoiser=config.denoiser_layers))
        self.anchor = self._stack(config.anchor_layers)
        self.fusion = GatedResidualFusion(config.hidden_size)
        self.denoiser = self._stack(config.denoiser_layers)
        self.head = self._output_layer()
        self.anchor_head = self._output_layer() if config.anchor_lm_head else None

    def compute_anchor(self, c: Tensor, t: Tensor | None = None) -> Tensor:
        """A: representation c_t' (B, L, D) -> cacheable anchor h_t' (B, L, D) (no final norm)."""
        return self.anchor(c, self._cond(t, c))

    def fuse(self, c: Tensor, h: Tensor) -> Tensor:
        """Phi: current c_t (B, L, D) and cached h_t' (B, L, D) -> fused h~_{t|t'} (B, L, D)."""
        return self.fusion(c, h)

    def denoise_hidden(self, h_tilde: Tensor, t: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """D's blocks on the fused anchor (B, L, D) -> (hidden (B, L, D), cond (B, cond_dim)), before the head."""
        cond = self._cond(t, h_tilde)  # (B, cond_dim)
        return self.denoiser(h_tilde, cond), cond

    def denoise(self, h_tilde: Tensor, z_t: Tensor, t: Tensor | None = None, rows: Tensor | None = None) -> Tensor:
        """D: fused anchor (B, L, D) -> SUBS log-probabilities (B, L, V) of x_theta given z_t (B, L);
        (n, V) at the masked positions ``rows`` (n, 2) only when given (see ``output_log_probs``)."""
        return self.output_log_probs(*self.denoise_hidden(h_tilde, t), z_t, rows)

    def predict_hidden(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, t: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Fusion + denoiser blocks: ``denoise_hidden(fuse(c_t, anchor), t)``."""
        return self.denoise_hidden(self.fuse(c_t, anchor), t)

    def anchor_log_probs(self, h: Tensor, t: Tensor | None = None) -> Tensor:
        """Training-only anchor LM head: h (B, L, D) -> (B, L, V) log-probabilities; the mask token gets NEG_INF."""
        if self.anchor_head is None:
            raise RuntimeError("this TADM was built with anchor_lm_head=False and has no anchor LM head")
        logits = self.anchor_head(h, self._cond(t, h))  # (B, L, V)
        return remove_mask_log_probs(logits, self.config.resolved_mask_token_id)

    def forward(
        self,
        z_t: Tensor,
        z_anchor: Tensor | None = None,
        t: Tensor | None = None,
        t_anchor: Tensor | None = None,
    ) -> TADMOutput:
        """Prediction for ``z_t`` (B, L) with the anchor computed from ``z_anchor`` (B, L).

        ``z_anchor`` None means a fresh anchor from ``z_t`` (S runs once). ``t_anchor`` defaults to
        ``t``; both matter only with time conditioning. Anchor log-probabilities are returned when
        the config has the anchor LM head.
        """
        c_t = self.encode(z_t, t)  # (B, L, D)
        if t_anchor is None:
            t_anchor = t
        if z_anchor is None:
            c_anchor = c_t
        else:
            if z_anchor.shape != z_t.shape:
                raise ValueError(f"z_anchor shape {tuple(z_anchor.shape)} differs from z_t shape {tuple(z_t.shape)}")
            c_anchor = self.encode(z_anchor, t_anchor)  # (B, L, D)
        h = self.compute_anchor(c_anchor, t_anchor)  # (B, L, D)
        log_probs = self.predict(z_t, c_t, h, t)  # (B, L, V)
        anchor_lp = self.anchor_log_probs(h, t_anchor) if self.anchor_head is not None else None
        return TADMOutput(log_probs=log_probs, anchor_log_probs=anchor_lp, anchor_hidden=h)

    def inference_parameters(self) -> int:
        """Unique parameters of the inference graph (S, A, Phi, D), i.e. without the anchor LM head."""
        return sum(p.numel() for name, p in self.named_parameters() if not name.startswith("anchor_head."))


class NaiveReuse(nn.Module):
    """A TADM whose fusion is bypassed when the anchor is cached: naive reuse of the refresh step's input to D.

    At a refresh the cache stores the denoiser input of that step, ``Phi(c_t', h_t')`` with
    ``c_t' = S(z_t')``, and every later step feeds it to D unchanged (``predict`` ignores ``c_t``):
    the current canvas reaches the prediction only through SUBS carry-over of its unmasked tokens,
    as in ADLM's naive reuse of a cached anchor. With a fresh anchor (K = 1, or cache age 0) this is
    the wrapped model exactly, so the gap to the fused model at age k > 0 is what the fusion with
    the current state recovers. Satisfies :class:`tadm.protocol.CacheableDenoiser`; the
    parameters are those of the wrapped model.
    """

    def __init__(self, model: TADM) -> None:
        super().__init__()
        if not isinstance(model, TADM):
            raise TypeError(f"NaiveReuse wraps a TADM, got {type(model).__name__}")
        self.model = model
        self.config = model.config
        self.vocab_size = model.vocab_size
        self.mask_token_id = model.mask_token_id
        self.layer_split = model.layer_split

    @property
    def time_conditioned(self) -> bool:
        return self.model.time_conditioned

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    def prepare(self, z_t: Tensor, context: Any = None, t: Tensor | None = None) -> Tensor | None:
        return self.model.prepare(z_t, context, t)

    def encode(self, z_t: Tensor, t: Tensor | None = None) -> Tensor:
        """S: token ids (B, L) -> c_t (B, L, D)."""
        return self.model.encode(z_t, t)

    def compute_anchor(self, c: Tensor, t: Tensor | None = None) -> Tensor:
        """A then Phi on the refresh step's own state: the denoiser input Phi(c_t', A(c_t')) (B, L, D)."""
        return self.model.fuse(c, self.model.compute_anchor(c, t))

    predicts_rows = True

    def compile_stacks(self, **options: Any) -> NaiveReuse:
        """Compile the wrapped model's stacks and fusion (see ``MaskedDiffusionNetwork.compile_stacks``)."""
        self.model.compile_stacks(**options)
        return self

    def predict_hidden(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, t: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """D's blocks on the cached denoiser input (``c_t`` unused) -> (hidden, cond)."""
        return self.model.denoise_hidden(anchor, t)

    def output_log_probs(self, hidden: Tensor, cond: Tensor, z_t: Tensor, rows: Tensor | None = None) -> Tensor:
        """The wrapped model's output layer and SUBS (see ``MaskedDiffusionNetwork.output_log_probs``)."""
        return self.model.output_log_probs(hidden, cond, z_t, rows)

    def predict(
        self, z_t: Tensor, c_t: Tensor, anchor: Tensor, t: Tensor | None = None, rows: Tensor | None = None
    ) -> Tensor:
        """D on the cached denoiser input (``c_t`` unused) -> (B, L, V) SUBS log-probabilities given z_t."""
        return self.model.denoise(anchor, z_t, t, rows)


tadm_small = size_preset(
    "tadm-small", TADM, "The paper's TADM: d = 768, 12 heads, 12 anchor + 6 denoiser layers (224M inference parameters)."
)
tadm_tiny = size_preset("tadm-tiny", TADM, "A test-sized TADM: vocab 65, d = 32, 2 heads, 2 anchor + 1 denoiser layers.",
                        **TINY_SIZES, anchor_layers=2, denoiser_layers=1)
