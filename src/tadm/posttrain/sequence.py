"""Generation after a prompt for models whose canvas is the whole sequence (LLaDA, Dream): Algorithm 1 over [prompt, masks].

LLaDA and Dream have no KV cache and no separate encoder: every pass attends over the prompt and the
generated positions alike. The canvas is therefore the prompt followed by ``gen_length`` mask tokens,
a left-padded batch carries its padding in ``StackContext.attention_mask`` (the generated positions
are never padding), and the sampler only ever changes masked positions. For i = T..1 the anchor is
refreshed when ``(T - i) mod K == 0`` (Algorithm 1); between refreshes only the shared layers, the
fusion and the denoiser layers run. With K = 1 the fusion is the identity and, for the same seed and
settings, the tokens are those of the model's own generation function (LLaDA's ``generate`` with the
``"llada"`` sampler, Dream's ``diffusion_generate`` with the ``"dream-*"`` samplers; tested).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tadm.posttrain.backbone import StackContext
from tadm.posttrain.model import AnchoredBackbone
from tadm.sampling.anchor_cache import LayerCallCounter, check_refresh_interval
from tadm.sampling.base import check_integer
from tadm.sampling.loop import LoopContext, denoise
from tadm.sampling.refresh import FixedRefresh, parse_refresh
from tadm.sampling.registry import build_sampler

__all__ = ["SequenceGenerationOutput", "generate_sequence"]


@dataclass
class SequenceGenerationOutput:
    """The prompt with its generated continuation, and what it cost."""

    sequences: Tensor  # (B, P + G)
    prompt_length: int
    layer_calls: LayerCallCounter
    refresh_steps: list[int] = field(default_factory=list)  # the steps i that refreshed the anchor
    seconds: float = 0.0

    @property
    def new_tokens(self) -> Tensor:
        """The generated part of ``sequences`` (B, G)."""
        return self.sequences[:, self.prompt_length:]


class _PaddedSequence(LoopContext):
    """Every pass reads the same padding mask (or none)."""

    def __init__(self, attention_mask: Tensor | None) -> None:
        self.context = StackContext(attention_mask=attention_mask)

    def pass_context(self) -> StackContext:
        return self.context


def _check_prompt(prompt_ids: Tensor, attention_mask: Tensor | None, mask_id: int | None) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.dtype != torch.long:
        raise ValueError(f"prompt ids must be a (B, P) LongTensor, got {prompt_ids.dtype} of shape "
                         f"{tuple(prompt_ids.shape)}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(prompt_ids.shape):
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match the prompt ids "
                         f"{tuple(prompt_ids.shape)}")
    if mask_id is None:
        raise ValueError("generation after a prompt needs a model with a mask token (a masked diffusion LM)")


@torch.no_grad()
def generate_sequence(
    model: AnchoredBackbone,
    sampler: Any,
    prompt_ids: Tensor,
    *,
    gen_length: int,
    num_steps: int,
    attention_mask: Tensor | None = None,
    refresh_interval: int = 1,
    policy: Any = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> SequenceGenerationOutput:
    """Generate ``gen_length`` tokens after ``prompt_ids`` (B, P) in ``num_steps`` steps with anchor caching.

    Args:
        model: a split backbone whose passes read the whole sequence (LLaDA, Dream).
        sampler: a sampler whose steps change masked positions only, or a registry name built for the
            model with its default options (``"llada"``, ``"dream-entropy"``, ...).
        attention_mask: (B, P) 1 at real prompt tokens, 0 at left padding; None for no padding.
        refresh_interval: K (>= 1); ``policy`` instead gives any refresh policy (:mod:`tadm.sampling.refresh`).
        generator: the source of every random draw (the public implementations' global seed).
    """
    check_integer("gen_length", gen_length)
    _check_prompt(prompt_ids, attention_mask, model.mask_token_id)
    if isinstance(sampler, str):
        sampler = build_sampler(sampler, model)
    if policy is None:
        policy = FixedRefresh(check_refresh_interval(refresh_interval))
    elif refresh_interval != 1:
        raise ValueError("give either a refresh policy or refresh_interval, not both")
    else:
        policy = parse_refresh(policy)
    sampler.set_timesteps(num_steps)
    B, P = prompt_ids.shape
    masks = torch.full((B, gen_length), model.mask_token_id, dtype=torch.long, device=prompt_ids.device)
    z = torch.cat([prompt_ids, masks], dim=1)  # (B, P + G)
    padding = None
    if attention_mask is not None:
        padding = torch.cat([attention_mask.to(prompt_ids.device),
                             torch.ones((B, gen_length), dtype=attention_mask.dtype, device=prompt_ids.device)], dim=1)
    training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        run = denoise(model, sampler, z, range(num_steps, 0, -1), policy=policy, context=_PaddedSequence(padding),
                      generator=generator, progress=progress)
    finally:
        model.train(training)
    return SequenceGenerationOutput(sequences=run.z, prompt_length=P, layer_calls=run.layer_calls,
                                    refresh_steps=list(run.cache.history), seconds=time.perf_counter() - start)
