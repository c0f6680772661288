"""Sample entropy: the unigram entropy of each sample's token ids, averaged over samples (paper Tables 2 and 5).

For one sample x of length L with c_v occurrences of id v, H(x) = -sum_v (c_v / L) log(c_v / L)
in nats. Degenerate, repetitive samples score low (H = 0 for one repeated token); the paper's
data reference is 5.44 for 1,024 GPT-2 tokens of OpenWebText. All L positions count, as in the
reference code (end-of-text tokens included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["mean_entropy", "sample_entropy", "sample_entropies"]


def sample_entropy(tokens: Tensor | Sequence[int]) -> float:
    """Unigram entropy (nats) of one sample's ids, shape (L,)."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("cannot take the entropy of an empty sample")
    _, counts = torch.unique(ids, return_counts=True)
    p = counts.double() / ids.numel()
    # sum p log p <= 0; abs() so that one repeated id gives 0.0, not -0.0 (printed as "-0.000")
    return abs(float((p * p.log()).sum()))


def sample_entropies(samples: Tensor | Sequence[Sequence[int]]) -> list[float]:
    """Entropy of every sample: a (N, L) tensor or a list of N id sequences (lengths may differ)."""
    rows = list(samples.unbind(0)) if isinstance(samples, Tensor) and samples.dim() == 2 else list(samples)
    if isinstance(samples, Tensor) and samples.dim() != 2:
        raise ValueError(f"samples must have shape (N, L), got {tuple(samples.shape)}")
    if len(rows) == 0:
        raise ValueError("the sample set is empty: entropy needs at least one sample")
    return [sample_entropy(r) for r in rows]


def mean_entropy(samples: Tensor | Sequence[Sequence[int]]) -> float:
    """Per-sample unigram entropy (nats), averaged over the N samples."""
    values = sample_entropies(samples)
    return sum(values) / len(values)
