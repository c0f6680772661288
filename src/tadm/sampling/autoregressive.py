"""Left-to-right sampling for the autoregressive baseline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch
from torch import Tensor

from tadm.sampling.categorical import nucleus_filter, sample_categorical


def _prompt(prefix: Sequence[int] | Tensor | None, batch_size: int, bos_id: int, seq_len: int,
            device: torch.device | str) -> Tensor:
    """``bos_id`` followed by ``prefix`` in every row: (B, 1 + P) ids; a ValueError for a prompt that does not fit."""
    bos = torch.full((batch_size, 1), bos_id, dtype=torch.long, device=device)  # (B, 1)
    if prefix is None:
        return bos
    ids = torch.as_tensor(prefix, device=device)
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() not in (1, 2):
        raise ValueError(f"prefix must be integer token ids, (P,) or (B, P), got {ids.dtype} of shape "
                         f"{tuple(ids.shape)}")
    ids = ids.long().expand(batch_size, -1) if ids.dim() == 1 else ids.long()
    if ids.shape[0] != batch_size:
        raise ValueError(f"prefix has {ids.shape[0]} rows but batch_size is {batch_size}")
    if 1 + ids.shape[1] >= seq_len:
        raise ValueError(f"BOS and a prompt of {ids.shape[1]} tokens leave nothing to generate in seq_len={seq_len}")
    return torch.cat([bos, ids], dim=1)


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
    prefix: Sequence[int] | Tensor | None = None,
) -> Tensor:
    """Sample (B, seq_len) ids starting from ``bos_id``; ``next_token_logits`` maps (B, l) -> (B, l, V).

    ``prefix``: a prompt, (P,) ids for every row or (B, P), placed after ``bos_id`` and kept; the
    ``seq_len - 1 - P`` tokens after it are sampled.
    """
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_len}")
    tokens = _prompt(prefix, batch_size, bos_id, seq_len, device)  # (B, 1 + P)
    for _ in range(seq_len - tokens.shape[1]):
        logits = next_token_logits(tokens)[:, -1].double()  # (B, V)
        probs = nucleus_filter(torch.softmax(logits, dim=-1), top_p)
        tokens = torch.cat([tokens, sample_categorical(probs, generator).unsqueeze(1)], dim=1)
    return tokens
