"""LLaDA's sampler: x0 predictions committed by confidence, in semi-autoregressive blocks.

The canvas holds the whole sequence: a prompt, then ``G`` generated positions that start as masks
(the generation region is the run of trailing positions masked in every row at the first step). The
region is cut into blocks of ``block_length`` tokens, decoded left to right with ``T / (G /
block_length)`` steps each. At the start of a block its masked positions are divided evenly over
its steps (LLaDA's linear schedule: ``m // s`` per step, the first ``m mod s`` steps one more). At
every step, for the network's raw logits ``l`` (B, L, V):

1. a prediction ``x0 = argmax exp(l) / E^tau`` with ``E ~ Exp(1)`` drawn in float64 as
   ``-log U`` (Gumbel-max at temperature ``tau``; ``x0 = argmax l`` at ``tau = 0``);
2. a confidence: ``softmax(l)`` at ``x0`` (``"low_confidence"``) or a uniform draw (``"random"``);
   positions after the current block, and positions not masked, get ``-inf``;
3. in each row the step's quota of most confident positions takes ``x0``.

Per-row step indices (post-training rollouts start every row at its own step i): a (B,) tensor
``step_index`` runs the masked positions of each row as one block, committing ``ceil(m / i)`` of
its ``m`` masks at step i. That is LLaDA's linear schedule read from the current state: from the
start of a block the quotas ``m // s`` (+1 for the first ``m mod s`` steps) are exactly ``ceil(m_n
/ (s - n))`` for the ``m_n`` masks left at step n, so with one block (``block_length=None``) and the
same i in every row the two paths commit the same tokens (tested; unless a prediction is the mask id
itself, which a trained model never makes).

Compatibility with ``generate`` of the public LLaDA code (checked in the tests against its tokens):
the random stream is consumed exactly as there (one float64 uniform per logit at ``tau > 0``, then
for ``"random"`` one float32 uniform per position), so with ``classifier-free guidance`` off the same
seed gives the same tokens. Guidance needs a second network pass per step and is not offered here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tadm.sampling.base import (ConfiguredSampler, SamplerOutput, check_integer, check_num_steps, check_number,
                                check_step_index, check_step_rows)

__all__ = ["LLaDASampler", "LLaDASamplerConfig", "REMASKING", "gumbel_perturbed", "transfer_quota"]

REMASKING = ("low_confidence", "random")


@dataclass(frozen=True)
class LLaDASamplerConfig:
    """Settings of :class:`LLaDASampler` (LLaDA's ``generate`` defaults; validated on construction).

    block_length: tokens per semi-autoregressive block; None makes the whole generation region one
        block. The region must hold a whole number of blocks and T a whole number of steps per block.
    remasking: "low_confidence" (commit the most probable predictions) or "random".
    temperature: tau of the Gumbel-max draw, a finite number >= 0 (0: the argmax).
    """

    block_length: int | None = None
    remasking: str = "low_confidence"
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.block_length is not None:
            check_integer("LLaDA sampler: block_length", self.block_length)
        if self.remasking not in REMASKING:
            raise ValueError(f"LLaDA sampler: unknown remasking {self.remasking!r}; valid: {', '.join(REMASKING)}")
        check_number("LLaDA sampler", "temperature", self.temperature, low=0.0)


def _uniform(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator | None,
             device: torch.device) -> Tensor:
    """Uniforms drawn on the generator's device (a CPU generator can seed CUDA work), moved to ``device``."""
    where = generator.device if generator is not None else device
    return torch.rand(shape, dtype=dtype, generator=generator, device=where).to(device)


def gumbel_perturbed(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """``exp(l) / E^tau`` with ``E = -log U``, U uniform in float64 (B, L, V); ``l`` itself at ``tau = 0``.

    ``argmax`` of it is a draw from ``softmax(l / tau)``: ``log`` of it is ``l - tau log E``, and
    ``-log E`` is Gumbel noise. Float64 keeps the Gumbel tail, as in the public LLaDA code.
    """
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = _uniform(tuple(logits.shape), torch.float64, generator, logits.device)
    return logits.exp() / (-torch.log(noise)) ** temperature


def transfer_quota(block_masks: Tensor, steps: int) -> Tensor:
    """Tokens committed per step of a block: (B, block) masks -> (B, steps) counts summing to each row's masks.

    LLaDA's schedule is linear, so the expected number per step is constant: ``m // steps`` each, and
    the first ``m mod steps`` steps one more.
    """
    masked = block_masks.sum(dim=1, keepdim=True)  # (B, 1)
    base, remainder = masked // steps, masked % steps
    extra = torch.arange(steps, device=block_masks.device)[None] < remainder  # (B, steps)
    return base + extra.long()


class LLaDASampler(ConfiguredSampler):
    """LLaDA's low-confidence (or random) remasking with semi-autoregressive blocks (module docstring).

    ``set_timesteps(T)`` then ``step(logits, i, z)`` for i = T..1; T counts the steps of all blocks
    together, as LLaDA's ``steps`` does. The loop hands it the raw logits (``consumes = "logits"``).

    Args:
        mask_id: the model's mask token id.
        block_length, remasking, temperature: see :class:`LLaDASamplerConfig`.
    """

    consumes = "logits"
    per_row_steps = True  # step() takes a (B,) tensor of step indices

    def __init__(self, mask_id: int, block_length: int | None = None, remasking: str = "low_confidence",
                 temperature: float = 0.0) -> None:
        check_integer("mask_id", mask_id, minimum=0)
        self.config = LLaDASamplerConfig(block_length, remasking, temperature)
        self.mask_id = mask_id
        self.num_steps = 0
        self._blocks: tuple[int, int, int] | None = None  # (region start, block length, steps per block)
        self._quota: Tensor | None = None  # (B, steps per block) of the current block

    def set_timesteps(self, num_steps: int) -> None:
        """Use T = ``num_steps`` steps over all blocks; the generation region is read at the first step."""
        self.num_steps = check_num_steps(num_steps)
        self._blocks = None
        self._quota = None

    def time(self, step_index: int) -> float:
        """t(i) = i / T (the sampler itself is time-free; for time-conditioned networks only)."""
        return step_index / self.num_steps

    def initial_canvas(self, batch_size: int, seq_len: int, generator: torch.Generator | None,
                       device: torch.device) -> Tensor:
        """All mask tokens (B, L): the whole canvas is generated."""
        return torch.full((batch_size, seq_len), self.mask_id, dtype=torch.long, device=device)

    def _layout(self, z: Tensor) -> tuple[int, int, int]:
        """(start, block length, steps per block) from the trailing positions masked in every row of z (B, L)."""
        masked = (z == self.mask_id).all(dim=0)  # (L,)
        kept = (~masked).nonzero()
        start = int(kept[-1]) + 1 if kept.numel() else 0
        region = z.shape[1] - start
        if region == 0:
            raise ValueError("the canvas ends in no masked positions: LLaDA generates the trailing masks after the prompt")
        block = self.config.block_length if self.config.block_length is not None else region
        if region % block:
            raise ValueError(f"the generation region of {region} masked positions is not a multiple of "
                             f"block_length={block}")
        blocks = region // block
        if self.num_steps % blocks:
            raise ValueError(f"T = {self.num_steps} steps do not divide evenly over {blocks} blocks of {block} "
                             f"tokens; use a multiple of {blocks}")
        return start, block, self.num_steps // blocks

    def step(self, logits: Tensor, step_index: int, z_t: Tensor,
             generator: torch.Generator | None = None) -> SamplerOutput:
        """One step: commit the current block's quota of most confident predictions (module docstring).

        Args:
            logits: raw network logits (B, L, V) over the whole canvas.
            step_index: i in T..1 (one index for every row).
            z_t: the canvas (B, L).
        """
        if isinstance(step_index, Tensor):
            return self._step_rows(logits, step_index, z_t, generator)
        check_step_index(step_index, self.num_steps)
        if logits.dim() != 3 or logits.shape[:2] != z_t.shape:
            raise ValueError(f"logits {tuple(logits.shape)} must be (B, L, V) for a canvas of shape {tuple(z_t.shape)}")
        position = self.num_steps - step_index
        if position == 0 or self._blocks is None:
            if position != 0:
                raise ValueError(f"the LLaDA sampler starts at step i = T = {self.num_steps}, got {step_index}")
            self._blocks = self._layout(z_t)
        start, block, per_block = self._blocks
        number, j = divmod(position, per_block)
        block_start = start + number * block
        block_end = block_start + block
        if j == 0:
            self._quota = transfer_quota(z_t[:, block_start:block_end] == self.mask_id, per_block)
        assert self._quota is not None
        mask_index = z_t == self.mask_id  # (B, L)
        x0, x0_p = self._proposal(logits, generator)
        x0_p[:, block_end:] = -torch.inf
        x0 = torch.where(mask_index, x0, z_t)
        confidence = torch.where(mask_index, x0_p, -torch.inf)  # (B, L)
        transfer = torch.zeros_like(mask_index)
        for row in range(confidence.shape[0]):
            _, chosen = torch.topk(confidence[row], k=int(self._quota[row, j]))
            transfer[row, chosen] = True
        return SamplerOutput(prev_sample=torch.where(transfer, x0, z_t))

    def _proposal(self, logits: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """A token for every position of logits (B, L, V) (Gumbel-max at the temperature) and its confidence (B, L):
        its probability (``low_confidence``) or a uniform draw (``random``), as ``generate`` computes them."""
        x0 = torch.argmax(gumbel_perturbed(logits, self.config.temperature, generator), dim=-1)  # (B, L)
        if self.config.remasking == "low_confidence":
            p = F.softmax(logits, dim=-1)  # (B, L, V)
            return x0, torch.gather(p, dim=-1, index=x0.unsqueeze(-1)).squeeze(-1)
        return x0, _uniform(tuple(x0.shape), torch.float32, generator, x0.device)

    def _step_rows(self, logits: Tensor, step_index: Tensor, z_t: Tensor,
                   generator: torch.Generator | None) -> SamplerOutput:
        """One step with a step index per row (B,): each row's masks as one block, ``ceil(m / i)`` committed."""
        if self.config.block_length is not None:
            raise ValueError("per-row step indices run each row's masked positions as one block; build the LLaDA "
                             f"sampler with block_length=None (got {self.config.block_length})")
        check_step_rows(step_index, self.num_steps, z_t.shape[0])
        if logits.dim() != 3 or logits.shape[:2] != z_t.shape:
            raise ValueError(f"logits {tuple(logits.shape)} must be (B, L, V) for a canvas of shape {tuple(z_t.shape)}")
        mask_index = z_t == self.mask_id  # (B, L)
        steps_left = step_index.to(z_t.device).long()  # (B,)
        quota = (mask_index.sum(dim=1) + steps_left - 1) // steps_left  # (B,) ceil(m / i)
        x0, x0_p = self._proposal(logits, generator)
        x0 = torch.where(mask_index, x0, z_t)
        confidence = torch.where(mask_index, x0_p, -torch.inf)  # (B, L)
        transfer = torch.zeros_like(mask_index)
        for row in range(confidence.shape[0]):
            _, chosen = torch.topk(confidence[row], k=int(quota[row]))
            transfer[row, chosen] = True
        return SamplerOutput(prev_sample=torch.where(transfer, x0, z_t))
