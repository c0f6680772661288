"""The shape of a dense bidirectional Transformer stack (LLaDA, Dream), read off a ``config.json``.

Parameter counts follow from it analytically: token embedding V d; per layer the query and output
projections (d x H h each), key and value projections (d x H_kv h each, with biases where the
architecture has them), the SwiGLU MLP (3 d F) and two RMSNorm weights (2 d); the final norm (d); an
untied output layer (V d).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DenseStackShape"]


@dataclass(frozen=True)
class DenseStackShape:
    """Layers, width, heads, head size, SwiGLU width, vocabulary and biases of a dense stack."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    qkv_bias: bool = False
    out_bias: bool = False
    tied_head: bool = False

    def layer_parameters(self) -> int:
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0) + (d if self.out_bias else 0)
        mlp = 3 * d * self.ffn + ((2 * self.ffn + d) if self.out_bias else 0)
        return attention + mlp + 2 * d

    def parameters(self) -> int:
        """All parameters of the model: embedding, layers, final norm and the head unless tied."""
        head = 0 if self.tied_head else self.vocab * self.hidden + (self.vocab if self.out_bias else 0)
        return self.vocab * self.hidden + self.layers * self.layer_parameters() + self.hidden + head
