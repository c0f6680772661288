"""What block-wise generation needs from a base model's tokenizer: prompts as a left-padded batch, the stop id.

Used by ``tadm posttrain sample`` and by task evaluation: chat prompts go through the tokenizer's chat
template (thinking off, as in the paper's no-think evaluation), raw prompts through the plain encoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from tadm.posttrain.data import check_token_ids, left_pad, user_turn_ids

__all__ = ["encode_prompts", "end_of_sequence_id"]


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str], *, chat: bool = True, vocab_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """Token ids (B, P) of ``prompts``, left-padded with the pad id (0 without one), and their mask (B, P).

    ``chat``: wrap each prompt as one user turn of the tokenizer's chat template with the generation
    prompt added; otherwise encode the text as is (with the tokenizer's special tokens).
    ``vocab_size``: the base's; a prompt id or the pad id (written after a reply's end) outside
    ``0..vocab_size - 1`` is a one-line ValueError naming the tokenizer.
    """
    if not prompts:
        raise ValueError("no prompts to encode")
    rows = [user_turn_ids(tokenizer, text) if chat else tokenizer(text, add_special_tokens=True)["input_ids"]
            for text in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if vocab_size is not None:
        check_token_ids(tokenizer, max([pad, *(i for row in rows for i in row)]), vocab_size)
    return left_pad(rows, pad)


def end_of_sequence_id(backbone: Any, tokenizer: Any) -> int | list[int] | None:
    """The id(s) that end a response: the base model's generation config, else the tokenizer's EOS."""
    generation_config = getattr(getattr(backbone, "model", None), "generation_config", None)
    return getattr(generation_config, "eos_token_id", None) or tokenizer.eos_token_id
