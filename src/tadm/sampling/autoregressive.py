"""Left-to-right sampling for the autoregressive baseline."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from tadm.sampling.categorical import nucleus_filter, sample_categorical


@torch.no_grad()
def generate_autoregressive(
    next_token_logits: Callable[[Tensor], Tensor],
    *,
    batch_size: int,
    seq_len: int,
    bos_id: int,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Sample (B, seq_len) ids starting from ``bos_id``; ``next_token_logits`` maps (B, l) -> (B, l, V)."""
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_len}")
    tokens = torch.full((batch_size, 1), bos_id, dtype=torch.long, device=device)  # (B, 1)
    for _ in range(seq_len - 1):
        logits = next_token_logits(tokens)[:, -1].double()  # (B, V)
        probs = nucleus_filter(torch.softmax(logits, dim=-1), top_p)
        tokens = torch.cat([tokens, sample_categorical(probs, generator).unsqueeze(1)], dim=1)
    return tokens
