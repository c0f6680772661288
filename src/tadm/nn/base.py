"""What every tadm network shares: its size fields, validated once, and the masked-diffusion front end.

:class:`DiTSizes` holds what every network built from DiT blocks has (vocabulary, width, heads,
conditioning size, MLP ratio, dropout, context length); :class:`MaskedDiffusionSizes` adds the mask
token and time conditioning of the diffusion models. Each model's config (``TADMConfig``,
``MDLMConfig``, ``ADLMConfig``, ``ARConfig``) subclasses one of them, adds its layer counts and names
them in ``layer_fields`` so that they are validated like the rest. :class:`MaskedDiffusionNetwork`
is the front end of TADM, MDLM and ADLM: the token embedding S, the time embedding and the
attributes the sampling loop reads (``vocab_size``, ``mask_token_id``, ``layer_split``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from tadm.nn.dit import (DiTStack, FinalLayer, TimestepEmbedder, check_time_input, masked_log_probs, stack_kwargs,
                         subs_log_probs, time_condition, token_embedding)
from tadm.protocol import LayerSplit

__all__ = ["DiTSizes", "MaskedDiffusionNetwork", "MaskedDiffusionSizes", "check_token_ids"]


def check_int(owner: str, name: str, value: object, minimum: int = 1) -> None:
    """Raise ValueError naming ``owner.name`` unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


def check_bool(owner: str, name: str, value: object) -> None:
    """Raise ValueError naming ``owner.name`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be a bool, got {value!r}")


@dataclass
class DiTSizes:
    """Sizes of a network of DiT blocks (defaults: the paper's d = 768, 12 heads, L = 1024)."""

    vocab_size: int = 50258  # GPT-2's 50257 tokens + the mask token
    hidden_size: int = 768
    num_heads: int = 12
    cond_dim: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.1
    max_seq_len: int = 1024

    layer_fields: ClassVar[tuple[str, ...]] = ()  # the subclass's layer counts, validated as ints >= 1

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "vocab_size", self.vocab_size, minimum=2)
        for name in ("hidden_size", "num_heads", "cond_dim", "mlp_ratio", "max_seq_len", *self.layer_fields):
            check_int(owner, name, getattr(self, name))
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"{owner}.hidden_size ({self.hidden_size}) must be divisible by {owner}.num_heads "
                             f"({self.num_heads})")
        if (self.hidden_size // self.num_heads) % 2 != 0:  # rotary embeddings rotate pairs
            raise ValueError(f"{owner}.hidden_size / {owner}.num_heads = {self.hidden_size // self.num_heads} must be "
                             "even for rotary embeddings")
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"{owner}.dropout must be a float in [0, 1), got {dropout!r}")


@dataclass
class MaskedDiffusionSizes(DiTSizes):
    """:class:`DiTSizes` plus the mask token and time conditioning of a masked diffusion LM."""

    mask_token_id: int | None = None  # None: vocab_size - 1
    time_conditioning: bool = False
    time_input: str = "t"  # what the time embedder reads: t, or "sigma-loglinear" (released MDLM checkpoints)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner, mask_id = type(self).__name__, self.mask_token_id
        if mask_id is not None and (isinstance(mask_id, bool) or not isinstance(mask_id, int)
                                    or not 0 <= mask_id < self.vocab_size):
            raise ValueError(f"{owner}.mask_token_id must be None or an int in [0, vocab_size={self.vocab_size}), "
                             f"got {mask_id!r}")
        check_bool(owner, "time_conditioning", self.time_conditioning)
        check_time_input(owner, self.time_input)

    @property
    def resolved_mask_token_id(self) -> int:
        """The mask token id, ``vocab_size - 1`` unless set explicitly."""
        return self.vocab_size - 1 if self.mask_token_id is None else self.mask_token_id


def check_token_ids(owner: str, z: Tensor, max_seq_len: int) -> None:
    """Token ids must have shape (B, L) with L <= ``max_seq_len``."""
    if z.dim() != 2:
        raise ValueError(f"{owner}: token ids must have shape (B, L), got {tuple(z.shape)}")
    if z.shape[1] > max_seq_len:
        raise ValueError(f"{owner}: sequence length {z.shape[1]} exceeds max_seq_len={max_seq_len}")


class MaskedDiffusionNetwork(nn.Module):
    """The shared front end of a masked diffusion LM: the embedding S and the time conditioning.

    Subclasses call ``super().__init__(config, layer_split)`` and build their stacks; ``encode`` is
    the shared network S of the :class:`~tadm.protocol.CacheableDenoiser` protocol.
    """

    config: MaskedDiffusionSizes
    head: FinalLayer  # built by the subclass
    # ``predict_hidden`` + ``output_log_probs(..., rows)``: x_theta on given positions only
    predicts_rows: ClassVar[bool] = True

    def __init__(self, config: MaskedDiffusionSizes, layer_split: LayerSplit) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.mask_token_id: int | None = config.resolved_mask_token_id
        self.layer_split = layer_split
        self.embed = token_embedding(config.vocab_size, config.hidden_size)
        self.time_embed = TimestepEmbedder(config.cond_dim, time_input=config.time_input)

    @property
    def max_seq_len(self) -> int:
        return int(self.config.max_seq_len)

    @property
    def time_conditioned(self) -> bool:
        """Whether the network reads the diffusion time (``config.time_conditioning``)."""
        return bool(self.config.time_conditioning)

    def prepare(self, z_t: Tensor, context: Any = None, t: Tensor | None = None) -> Tensor | None:
        """The per-pass state of a plain network is the time t (B,) itself; it takes no other context."""
        if context is not None:
            raise TypeError(f"{type(self).__name__} takes no per-pass context (prompt cache, self-conditioning)")
        return t

    def compile_stacks(self, **options: Any) -> MaskedDiffusionNetwork:
        """Compile the fixed-shape parts of a reverse step with ``torch.compile``, in place.

        The DiT stacks (anchor, denoiser, or MDLM's one stack) and the fusion see (B, L, D) at every
        step, so they compile once per batch shape; the output head, which runs on a varying number
        of decoded rows, stays eager. Weights and state-dict keys are unchanged. ``options`` go to
        :meth:`torch.nn.Module.compile`, e.g. ``mode="reduce-overhead"`` (CUDA graphs on a GPU) or
        ``backend=...``; ``dynamic=False`` unless given. Returns the model.
        """
        options.setdefault("dynamic", False)
        for name in ("anchor", "fusion", "denoiser", "blocks"):
            module = getattr(self, name, None)
            if isinstance(module, nn.Module):
                module.compile(**options)
        return self

    def _stack(self, num_layers: int) -> DiTStack:
        """``num_layers`` DiT blocks of this network's width, heads, conditioning size, MLP ratio and dropout."""
        return DiTStack(num_layers, **stack_kwargs(self.config))

    def _output_layer(self) -> FinalLayer:
        """A DiT output layer from the hidden size to the vocabulary."""
        return FinalLayer(self.config.hidden_size, self.config.vocab_size, self.config.cond_dim)

    def predict_hidden(self, z_t: Tensor, c_t: Tensor, anchor: Tensor, t: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Everything of a prediction but the output layer: (last hidden states (B, L, D), conditioning (B, cond_dim))."""
        raise NotImplementedError

    def predict(
        self, z_t: Tensor, c_t: Tensor, anchor: Tensor, t: Tensor | None = None, rows: Tensor | None = None
    ) -> Tensor:
        """x_theta from the current c_t (B, L, D) and the (cached) anchor: (B, L, V) SUBS log-probabilities,
        or (n, V) at the masked positions ``rows`` only (``predict_hidden`` then ``output_log_probs``)."""
        hidden, cond = self.predict_hidden(z_t, c_t, anchor, t)
        return self.output_log_probs(hidden, cond, z_t, rows)

    def output_log_probs(self, hidden: Tensor, cond: Tensor, z_t: Tensor, rows: Tensor | None = None) -> Tensor:
        """The output layer and SUBS on the last hidden states (B, L, D) -> (B, L, V) log-probabilities.

        With ``rows`` (n, 2), (batch, position) pairs of masked positions of ``z_t``, only those rows
        are computed: (n, V), equal to the full output's rows. A sampler needs x_theta only where a
        token is decoded this step (SUBS carries unmasked tokens over), usually about L / T rows.
        """
        mask_id = self.config.resolved_mask_token_id
        if rows is None:
            return subs_log_probs(self.head(hidden, cond), z_t, mask_id)
        return masked_log_probs(self.head(hidden, cond, rows), mask_id)

    def _cond(self, t: Tensor | None, ref: Tensor) -> Tensor:
        """The conditioning vector (B, cond_dim): embedded time, or a fixed vector without time conditioning."""
        return time_condition(self.time_embed, t, ref.shape[0], ref.device, self.config.time_conditioning)

    def encode(self, z_t: Tensor, t: Tensor | None = None) -> Tensor:
        """S: token ids (B, L) -> current-state representation c_t (B, L, D). ``t`` is unused."""
        check_token_ids(type(self).__name__, z_t, self.config.max_seq_len)
        return self.embed(z_t)  # (B, L, D)
