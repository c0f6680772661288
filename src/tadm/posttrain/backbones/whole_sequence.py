"""What the whole-sequence backbones (LLaDA, Dream) share: a frozen user-loaded model, its mask id, no loading of code.

Such a backbone wraps a model the user has loaded (tadm never runs code shipped with a checkpoint), keeps it
frozen and in eval mode, and reads its mask id from the argument, else the model's config, else the released
tokenizer's. A pass reads the whole sequence, so the prompt is part of the canvas; the output
parameterisation is SUBS (Eq. (mdlm-posterior-unk)), with no time input and no self-conditioning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["WholeSequenceBackbone"]


class WholeSequenceBackbone(nn.Module):
    """Base of :class:`~tadm.posttrain.backbones.llada.LLaDABackbone` and
    :class:`~tadm.posttrain.backbones.dream.DreamBackbone`.

    A subclass names its ``family`` (for messages) and ``default_mask_token_id``, calls :meth:`_adopt` once it has
    checked the model's layout, and :meth:`_mask_token_id` once it has set ``vocab_size``.
    """

    family: str = ""
    default_mask_token_id: int = 0
    prior = "mask"
    supports_self_conditioning = False
    time_conditioned = False
    prompt_in_canvas = True  # a pass reads the whole sequence: the prompt is part of the canvas

    def _adopt(self, model: nn.Module) -> None:
        """Keep ``model`` frozen and in eval mode as this backbone's ``model``."""
        model.requires_grad_(False)
        model.eval()
        self.model = model

    def _mask_token_id(self, explicit: int | None, config: Any) -> int:
        """The mask id: ``explicit``, else ``config.mask_token_id``, else the family's; checked against the vocabulary."""
        mask = explicit if explicit is not None else getattr(config, "mask_token_id", None)
        mask = self.default_mask_token_id if mask is None else mask
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < self.vocab_size:
            raise ValueError(f"mask_token_id must be an id in 0..{self.vocab_size - 1}, got {mask!r}")
        return mask

    def _padding_mask(self, batch_size: int, length: int, context: Any) -> Any:
        """``context.attention_mask`` (B, L) or None, after refusing what a whole-sequence pass cannot read: a
        separate prompt (the prompt belongs in the canvas) and self-conditioning logits."""
        if context is not None and context.prompt is not None:
            raise ValueError(f"a {self.family} pass reads the whole sequence: put the prompt in the canvas (prompt "
                             f"tokens followed by masks) and its padding in StackContext(attention_mask=...)")
        if context is not None and context.self_conditioning_logits is not None:
            raise ValueError(f"{self.family} has no self-conditioning input; pass self_conditioning_logits=None")
        mask = None if context is None else context.attention_mask
        if mask is not None and tuple(mask.shape) != (batch_size, length):
            raise ValueError(f"attention_mask {tuple(mask.shape)} must be (B, L) = ({batch_size}, {length})")
        return mask

    @classmethod
    def from_pretrained(cls, path: str | Path, **_: Any) -> WholeSequenceBackbone:
        """Refused: the family's modeling code ships with the checkpoint and tadm never runs such code itself."""
        raise ValueError(f"tadm does not run code shipped with a checkpoint: load {cls.family} yourself, e.g. "
                         f"AutoModel.from_pretrained({str(path)!r}, trust_remote_code=True), and pass the model to "
                         f"tadm.posttrain.wrap_backbone")

    def train(self, mode: bool = True) -> WholeSequenceBackbone:
        """The frozen backbone always stays in eval mode."""
        return super().train(False)
