"""Baselines built from the same DiT blocks: MDLM, ADLM and an autoregressive Transformer.

MDLM and ADLM satisfy :class:`tadm.protocol.CacheableDenoiser`, so the anchor-cache loop
drives them exactly like TADM:

* MDLM has no anchor network: ``compute_anchor`` returns its input and ``predict`` runs the full
  stack on the current state, so caching cannot change its output.
* ADLM (section "Anchored Diffusion Language Models") maps the anchor network's token
  distribution ``y_theta_A(z_t)`` through a linear projection into the denoiser; a cached
  projection is reused as-is ("naive reuse": no fusion with the current state).

Parameter counts of the small presets (d = 768, V = 50258, cond_dim = 128, MLP ratio 4), which
match MDLM's DiT and the paper's Table (main-results):

* DiT block: adaLN 128*4608 + 4608 = 594,432; two LN weights 1,536; qkv 768*2304 = 1,769,472;
  attention out 589,824; MLP 768*3072 + 3072 + 3072*768 + 768 = 4,722,432 -> 7,677,696.
* Token embedding 50258*768 = 38,598,144. Time embedder 256*128 + 128 + 128*128 + 128 = 49,408.
* Output layer: LN 768 + adaLN 128*1536 + 1536 + Linear 768*50258 + 50258 -> 38,847,314
  (also the size of TADM's training-only anchor LM head, "38.85M").
* MDLM, 12 blocks: 38,598,144 + 49,408 + 12 * 7,677,696 + 38,847,314 = 169,627,218 (~170M).
* TADM, 18 blocks + gated fusion (3 LNs 4,608; W_g 1536*768 + 768; W_1 1536*3072 + 3072;
  W_2 3072*768 + 768 -> 8,266,752): 38,598,144 + 49,408 + 18 * 7,677,696 + 8,266,752
  + 38,847,314 = 223,960,146 (~224M) without the anchor LM head.
* ADLM, 18 blocks + anchor output layer + projection Linear(V, d) 50258*768 + 768 = 38,598,912:
  38,598,144 + 49,408 + 18 * 7,677,696 + 2 * 38,847,314 + 38,598,912 = 293,139,620 (~293M).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn

from tadm.nn.dit import (DiTStack, FinalLayer, TimestepEmbedder, remove_mask_log_probs, stack_kwargs, time_condition,
                         token_embedding)
from tadm.nn.hub import TINY_SIZES, HubMixin, size_preset
from tadm.nn.base import DiTSizes, MaskedDiffusionNetwork, MaskedDiffusionSizes, check_token_ids
from tadm.protocol import LayerSplit


# -------------------------------------------------------------------------------------------- MDLM
@dataclass
class MDLMConfig(MaskedDiffusionSizes):
    """Sizes of an MDLM DiT. Defaults are MDLM's small model (170M parameters)."""

    num_layers: int = 12

    layer_fields: ClassVar[tuple[str, ...]] = ("num_layers",)


class MDLM(MaskedDiffusionNetwork, HubMixin, model_type="mdlm"):
    """Masked diffusion LM (MDLM): embedding -> DiT blocks -> output layer, SUBS-parameterised."""

    config_class = MDLMConfig

    def __init__(self, config: MDLMConfig | None = None) -> None:
        config = MDLMConfig() if config is None else config
        super().__init__(config, LayerSplit(shared=0, anchor=0, denoiser=config.num_layers))
        self.blocks = self._stack(config.num_layers)
        self.head = self._output_layer()

    def compute_anchor(self, c: Tensor, t: Tensor | None = None) -> Tensor:
        """No anchor network: returns ``c`` unchanged (zero layers)."""
        return c

    def predict_hidden(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, t: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Full stack on the current embeddings ``c_t`` (``anchor`` is ignored) -> (hidden (B, L, D), cond)."""
        cond = self._cond(t, c_t)  # (B, cond_dim)
        return self.blocks(c_t, cond), cond

    def forward(self, z_t: Tensor, t: Tensor | None = None) -> Tensor:
        """z_t (B, L) -> SUBS log-probabilities (B, L, V)."""
        c = self.encode(z_t, t)
        return self.predict(z_t, c, c, t)


# -------------------------------------------------------------------------------------------- ADLM
@dataclass
class ADLMConfig(MaskedDiffusionSizes):
    """Sizes of an ADLM. Defaults are the small model compared in the paper (293M parameters)."""

    anchor_layers: int = 12
    denoiser_layers: int = 6

    layer_fields: ClassVar[tuple[str, ...]] = ("anchor_layers", "denoiser_layers")


class ADLM(MaskedDiffusionNetwork, HubMixin, model_type="adlm"):
    """Anchored diffusion LM: ``x_theta(z_t) = x_theta_D(y_theta_A(z_t))``.

    The anchor stack and its output layer give anchor log-probabilities (mask token removed); their
    softmax ``y_theta_A`` is projected by ``Linear(V, d)`` into the denoiser stack and output layer.
    """

    config_class = ADLMConfig

    def __init__(self, config: ADLMConfig | None = None) -> None:
        config = ADLMConfig() if config is None else config
        super().__init__(config, LayerSplit(shared=0, anchor=config.anchor_layers, denoiser=config.denoiser_layers))
        self.anchor = self._stack(config.anchor_layers)
        self.anchor_head = self._output_layer()
        self.anchor_proj = nn.Linear(config.vocab_size, config.hidden_size)
        self.denoiser = self._stack(config.denoiser_layers)
        self.head = self._output_layer()

    def anchor_log_probs(self, c: Tensor, t: Tensor | None = None) -> Tensor:
        """Anchor network on embeddings c (B, L, D) -> log y_theta_A (B, L, V), mask token at NEG_INF."""
        cond = self._cond(t, c)  # (B, cond_dim)
        logits = self.anchor_head(self.anchor(c, cond), cond)  # (B, L, V)
        return remove_mask_log_probs(logits, self.config.resolved_mask_token_id)

    def project_anchor(self, anchor_log_probs: Tensor) -> Tensor:
        """Anchor distribution (B, L, V) as log-probs -> denoiser input (B, L, D)."""
        probs = anchor_log_probs.exp().to(self.anchor_proj.weight.dtype)  # (B, L, V)
        return self.anchor_proj(probs)

    def compute_anchor(self, c: Tensor, t: Tensor | None = None) -> Tensor:
        """The cacheable anchor: projected anchor distribution (B, L, D)."""
        return self.project_anchor(self.anchor_log_probs(c, t))

    def predict_hidden(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, t: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Denoiser on the (possibly cached) projected anchor; ``c_t`` is unused (naive reuse) -> (hidden, cond)."""
        cond = self._cond(t, anchor)  # (B, cond_dim)
        return self.denoiser(anchor, cond), cond

    def forward(self, z_t: Tensor, t: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """z_t (B, L) -> (SUBS log-probabilities (B, L, V), anchor log-probabilities (B, L, V))."""
        c = self.encode(z_t, t)  # (B, L, D)
        anchor_lp = self.anchor_log_probs(c, t)  # (B, L, V)
        return self.predict(z_t, c, self.project_anchor(anchor_lp), t), anchor_lp


# ---------------------------------------------------------------------------------------------- AR
@dataclass
class ARConfig(DiTSizes):
    """Sizes of the autoregressive baseline: causal DiT blocks without time conditioning or mask token."""

    vocab_size: int = 50257  # GPT-2
    num_layers: int = 12

    layer_fields: ClassVar[tuple[str, ...]] = ("num_layers",)


class ARTransformer(nn.Module, HubMixin, model_type="ar"):
    """Left-to-right Transformer from causal DiT blocks (conditioning vector fixed, as in MDLM's AR)."""

    config_class = ARConfig
    mask_token_id: int | None = None  # autoregressive: no mask token

    def __init__(self, config: ARConfig | None = None) -> None:
        super().__init__()
        config = ARConfig() if config is None else config
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed = token_embedding(config.vocab_size, config.hidden_size)
        self.time_embed = TimestepEmbedder(config.cond_dim)
        self.blocks = DiTStack(config.num_layers, **stack_kwargs(config), causal=True)
        self.head = FinalLayer(config.hidden_size, config.vocab_size, config.cond_dim)

    @property
    def max_seq_len(self) -> int:
        return int(self.config.max_seq_len)

    def forward(self, x: Tensor) -> Tensor:
        """Token ids (B, L) -> float32 next-token logits (B, L, V); position i sees tokens <= i."""
        check_token_ids("ARTransformer", x, self.config.max_seq_len)
        h = self.embed(x)  # (B, L, D)
        cond = time_condition(self.time_embed, None, x.shape[0], x.device, enabled=False)  # (B, cond_dim)
        return self.head(self.blocks(h, cond), cond).float()  # (B, L, V)


# ---------------------------------------------------------------------------------------- builders
mdlm_small = size_preset("mdlm-small", MDLM, "MDLM small: d = 768, 12 heads, 12 layers (170M parameters).")
mdlm_tiny = size_preset("mdlm-tiny", MDLM, "Test-sized MDLM: vocab 65, d = 32, 2 heads, 3 layers.",
                        **TINY_SIZES, num_layers=3)
adlm_small = size_preset("adlm-small", ADLM,
                         "ADLM small: d = 768, 12 heads, 12 anchor + 6 denoiser layers (293M parameters).")
adlm_tiny = size_preset("adlm-tiny", ADLM, "Test-sized ADLM: vocab 65, d = 32, 2 heads, 2 anchor + 1 denoiser layers.",
                        **TINY_SIZES, anchor_layers=2, denoiser_layers=1)
ar_small = size_preset("ar-small", ARTransformer,
                       "AR small: d = 768, 12 heads, 12 causal layers, GPT-2 vocabulary (50257).")
ar_tiny = size_preset("ar-tiny", ARTransformer,
                      "Test-sized AR model: vocab 64 (no mask token), d = 32, 2 heads, 3 causal layers.",
                      **{**TINY_SIZES, "vocab_size": 64}, num_layers=3)
