"""Block-wise generation over a prompt: Algorithm 2 inside Algorithm 1, one canvas at a time.

For each canvas of ``L`` tokens (paper: 256): the context (prompt, then every finished canvas) is
in the backbone's KV cache, written by its causal encoder; the canvas starts as uniform noise and
is denoised for ``T`` steps (paper: 48) by the entropy-bound sampler (Algorithm 2, with
self-conditioning from the previous step's temperature-scaled logits). Within the canvas the anchor
is refreshed when ``(T - i) mod K == 0`` (Algorithm 1): at other steps only S, the fusion and D run,
on the cached ``[H0, C0]``. The greedy canvas of the last step is appended to the sequence and
encoded into the cache. End-of-sequence handling (tokens after EOS become padding; rows finished
earlier get padding) and the optional adaptive stopping follow ``transformers``' ``generate``.

With ``K = 1`` the anchor is fresh at every step and the fusion is the identity, so the output is the
base model's: for the same seed and settings it equals ``DiffusionGemmaForBlockDiffusion.generate``
token for token (tested). Transformer-layer calls of the denoising passes are counted with
:class:`~tadm.sampling.anchor_cache.LayerCallCounter`; encoder calls (one pass over the prompt and
one per finished canvas) are reported apart.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tadm.posttrain.backbone import PromptCache, StackContext
from tadm.posttrain.model import AnchoredBackbone
from tadm.sampling.anchor_cache import LayerCallCounter, check_refresh_interval
from tadm.sampling.entropy_bound import EntropyBoundOutput, EntropyBoundSampler, StableConfidentStopping
from tadm.sampling.loop import LoopContext, denoise
from tadm.sampling.refresh import FixedRefresh, RefreshPolicy, get_refresh_policy

__all__ = ["BlockGenerationOutput", "generate_blocks"]


@dataclass
class BlockGenerationOutput:
    """Prompt plus generated canvases, and what they cost."""

    sequences: Tensor  # (B, P + num_blocks * L): the prompt followed by every generated canvas
    prompt_length: int
    layer_calls: LayerCallCounter  # denoising passes, summed over canvases
    encoder_layer_calls: int  # causal encoder: the prompt and every appended canvas
    refresh_steps: list[list[int]] = field(default_factory=list)  # per canvas, the steps i that refreshed
    decoder_forward_passes: Tensor | None = None  # (B,) denoising passes each row took part in
    seconds: float = 0.0

    @property
    def new_tokens(self) -> Tensor:
        """The generated part of ``sequences`` (B, num_blocks * L)."""
        return self.sequences[:, self.prompt_length :]


def _eos_tensor(eos_token_id: int | Sequence[int] | None, device: torch.device) -> Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, device=device)


def _finalize_canvas(
    sequences: Tensor,
    finished: Tensor,
    canvas_length: int,
    max_length: int,
    eos: Tensor | None,
    pad_token_id: int | None,
) -> tuple[Tensor, Tensor]:
    """Mark rows that reached ``max_length`` or emitted EOS in the new canvas; pad after EOS (in place)."""
    B = sequences.shape[0]
    done_now = torch.full((B,), sequences.shape[1] >= max_length, dtype=torch.bool, device=sequences.device)
    if eos is not None:
        done_now |= torch.isin(sequences[:, -canvas_length:], eos).any(dim=-1)
    previously = finished
    finished = previously | done_now
    if pad_token_id is not None and bool(finished.any()):
        sequences[previously, -canvas_length:] = pad_token_id
        if eos is not None and bool(done_now.any()):
            new = sequences[:, -canvas_length:]  # a view: edits land in ``sequences``
            is_eos = torch.isin(new, eos)
            count = is_eos.cumsum(dim=-1)
            after_eos = (count > 0) & ~((count == 1) & is_eos)  # everything after the first EOS
            new[after_eos] = pad_token_id
    return sequences, finished


class _CanvasContext(LoopContext):
    """Per-canvas loop state: the prompt cache, self-conditioning logits, greedy canvas, stopping."""

    def __init__(
        self,
        prompt: PromptCache,
        z: Tensor,
        *,
        self_conditioning: bool,
        stopping: StableConfidentStopping | None,
        finished: Tensor,
        passes: Tensor,
        embed_dtype: torch.dtype,
    ) -> None:
        self.prompt, self.self_conditioning, self.stopping = prompt, self_conditioning, stopping
        self.finished_rows, self.passes, self.embed_dtype = finished, passes, embed_dtype
        self.greedy = z  # (B, L): the canvas appended after the last step
        self.sc_logits: Tensor | None = None  # (B, L, V) previous step's temperature-scaled logits
        self.done = torch.zeros(z.shape[0], dtype=torch.bool, device=z.device)  # rows stopped early
        if stopping is not None:
            stopping.reset()

    def pass_context(self) -> StackContext:
        return StackContext(prompt=self.prompt, self_conditioning_logits=self.sc_logits if self.self_conditioning else None)

    def before_step(self, position: int, step_index: int | Tensor, z: Tensor) -> None:
        self.passes += (~(self.done | self.finished_rows)).to(self.passes.dtype)

    def after_step(self, position: int, step_index: int | Tensor, z: Tensor, output: EntropyBoundOutput) -> Tensor:
        new_greedy, new_z, scaled = output.argmax, output.prev_sample, output.scaled_logits
        if self.stopping is not None:
            done = self.done
            if bool(done.any()):  # rows that stopped keep their state
                new_greedy = torch.where(done[:, None], self.greedy, new_greedy)
                new_z = torch.where(done[:, None], z, new_z)
                if self.sc_logits is not None:
                    scaled = torch.where(done[:, None, None], self.sc_logits, scaled)
            self.done = done | self.stopping(new_greedy, scaled)
        self.sc_logits = scaled.to(self.embed_dtype)
        if self.sc_logits is not output.scaled_logits:
            # The loop keeps ``output`` alive until the next step returns, and nothing reads it again: let it hold
            # the (bf16) copy kept here instead of a second, float32 (B, L, V) one through the next network pass.
            output.scaled_logits = self.sc_logits
        self.greedy = new_greedy
        return new_z

    def finished(self) -> bool:
        return self.stopping is not None and bool(self.done.all())


def _block_policy(policy: RefreshPolicy | str | None, refresh_interval: int) -> RefreshPolicy:
    check_refresh_interval(refresh_interval)
    if policy is None:
        return FixedRefresh(refresh_interval)
    if refresh_interval != 1:
        raise ValueError("give either a refresh policy or refresh_interval, not both")
    return get_refresh_policy(policy)


def encodes_prompts(backbone: Any) -> bool:
    """Whether ``backbone`` can encode a prompt (``prefill``/``append``), as :func:`generate_blocks` needs."""
    return hasattr(backbone, "prefill") and hasattr(backbone, "append")


def _check_block_inputs(model: AnchoredBackbone, prompt_ids: Tensor, max_new_tokens: int) -> tuple[Any, Tensor]:
    """The model's backbone and the prompt ids as int64, after checking that the backbone can encode a prompt,
    that the prompt is a (B, P) tensor of integer ids (any integer dtype, as the base's ``generate`` takes) and
    that the budget is valid."""
    backbone = model.backbone
    if not encodes_prompts(backbone):
        raise TypeError(f"{type(backbone).__name__} has no prompt encoder (prefill/append); use tadm.sampling.generate")
    if (not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2 or prompt_ids.dtype == torch.bool
            or prompt_ids.is_floating_point() or prompt_ids.is_complex()):
        got = (f"{prompt_ids.dtype} of shape {tuple(prompt_ids.shape)}" if isinstance(prompt_ids, Tensor)
               else type(prompt_ids).__name__)
        raise ValueError(f"prompt_ids must be a (B, P) tensor of integer token ids, got {got}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return backbone, prompt_ids.long()


@torch.no_grad()
def generate_blocks(
    model: AnchoredBackbone,
    prompt_ids: Tensor,
    *,
    sampler: EntropyBoundSampler,
    refresh_interval: int = 1,
    policy: RefreshPolicy | str | None = None,
    max_new_tokens: int = 256,
    canvas_length: int | None = None,
    attention_mask: Tensor | None = None,
    self_conditioning: bool = True,
    stopping: StableConfidentStopping | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
    stop: Callable[[Tensor], Tensor] | None = None,
) -> BlockGenerationOutput:
    """Generate ``ceil(max_new_tokens / L)`` canvases after ``prompt_ids`` with anchor caching.

    Args:
        model: a split backbone whose adapter has ``prefill``/``append`` (DiffusionGemma). Its
            ``fusion_mode`` picks paired fusion or the naive-reuse baseline.
        prompt_ids: (B, P) token ids of any integer dtype (used as int64), left-padded when rows differ in length.
        sampler: Algorithm 2; its ``num_steps`` is T.
        refresh_interval: K >= 1 (1 = fresh anchor every step).
        policy: a refresh policy instead of ``refresh_interval`` (reset for every canvas).
        max_new_tokens: generation budget; whole canvases are generated.
        canvas_length: L (default: the backbone's configured canvas length).
        attention_mask: (B, P), True/1 at real prompt tokens.
        self_conditioning: feed the previous step's scaled logits back (paper: on).
        stopping: adaptive stopping (paper: off, i.e. None).
        eos_token_id, pad_token_id: end-of-sequence ids and the padding written after them.
        generator: source of randomness (None: torch's global generator, like ``generate``).
        stop: called after each canvas but the last with the tokens generated so far (B, n);
            returns (B,) bool, True for rows that are done (e.g. a stop string appeared). Like EOS
            rows, they get only padding afterwards, and generation ends when every row is done.

    Returns:
        BlockGenerationOutput.
    """
    policy = _block_policy(policy, refresh_interval)
    backbone, prompt_ids = _check_block_inputs(model, prompt_ids, max_new_tokens)
    L = int(canvas_length if canvas_length is not None else getattr(backbone, "canvas_length"))
    B, P = prompt_ids.shape
    device, encoder_layers = prompt_ids.device, model.layer_split.total
    embed_dtype = getattr(backbone, "dtype", torch.float32)
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # rows that reached EOS or the budget
    passes = torch.zeros(B, dtype=torch.int32, device=device)
    eos, max_length, num_blocks = _eos_tensor(eos_token_id, device), P + max_new_tokens, math.ceil(max_new_tokens / L)
    start = time.perf_counter()
    prompt = backbone.prefill(prompt_ids, attention_mask)
    out = BlockGenerationOutput(sequences=prompt_ids.clone(), prompt_length=P, layer_calls=LayerCallCounter(),
                                encoder_layer_calls=encoder_layers, decoder_forward_passes=passes)
    for block in range(num_blocks):
        z = sampler.initial_canvas(B, L, generator, device)  # (B, L)
        canvas = _CanvasContext(prompt, z, self_conditioning=self_conditioning, stopping=stopping,
                                finished=finished, passes=passes, embed_dtype=embed_dtype)
        run = denoise(model, sampler, z, range(sampler.num_steps, 0, -1), policy=policy, context=canvas,
                      generator=generator, counter=out.layer_calls, progress=progress,
                      desc=f"canvas {block + 1}/{num_blocks}")
        out.refresh_steps.append(list(run.cache.history))
        out.sequences, finished = _finalize_canvas(torch.cat([out.sequences, canvas.greedy], dim=-1), finished, L,
                                                   max_length, eos, pad_token_id)
        if block < num_blocks - 1 and stop is not None:
            finished = finished | stop(out.sequences[:, P:]).to(device=device, dtype=torch.bool)
        if bool(finished.all()) or block == num_blocks - 1:
            break
        prompt = backbone.append(prompt, out.sequences[:, -L:])
        out.encoder_layer_calls += encoder_layers
    out.seconds = time.perf_counter() - start
    return out
