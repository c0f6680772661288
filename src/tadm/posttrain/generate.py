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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tadm.posttrain.backbone import StackContext
from tadm.posttrain.model import AnchoredBackbone
from tadm.sampling.anchor_cache import AnchorCache, LayerCallCounter, check_refresh_interval, is_refresh_step
from tadm.sampling.entropy_bound import EntropyBoundSampler, StableConfidentStopping

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


@torch.no_grad()
def generate_blocks(
    model: AnchoredBackbone,
    prompt_ids: Tensor,
    *,
    sampler: EntropyBoundSampler,
    refresh_interval: int = 1,
    max_new_tokens: int = 256,
    canvas_length: int | None = None,
    attention_mask: Tensor | None = None,
    self_conditioning: bool = True,
    stopping: StableConfidentStopping | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> BlockGenerationOutput:
    """Generate ``ceil(max_new_tokens / L)`` canvases after ``prompt_ids`` with anchor caching.

    Args:
        model: a split backbone whose adapter has ``prefill``/``append`` (DiffusionGemma). Its
            ``fusion_mode`` picks paired fusion or the naive-reuse baseline.
        prompt_ids: (B, P) token ids, left-padded when rows differ in length.
        sampler: Algorithm 2; its ``num_steps`` is T.
        refresh_interval: K >= 1 (1 = fresh anchor every step).
        max_new_tokens: generation budget; whole canvases are generated.
        canvas_length: L (default: the backbone's configured canvas length).
        attention_mask: (B, P), True/1 at real prompt tokens.
        self_conditioning: feed the previous step's scaled logits back (paper: on).
        stopping: adaptive stopping (paper: off, i.e. None).
        eos_token_id, pad_token_id: end-of-sequence ids and the padding written after them.
        generator: source of randomness (None: torch's global generator, like ``generate``).

    Returns:
        BlockGenerationOutput.
    """
    check_refresh_interval(refresh_interval)
    backbone = model.backbone
    if not (hasattr(backbone, "prefill") and hasattr(backbone, "append")):
        raise TypeError(f"{type(backbone).__name__} has no prompt encoder (prefill/append); use tadm.sampling.generate")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    L = int(canvas_length if canvas_length is not None else getattr(backbone, "canvas_length"))
    T = sampler.num_steps
    device = prompt_ids.device
    B, P = prompt_ids.shape
    split = model.layer_split
    embed_dtype = getattr(backbone, "dtype", torch.float32)

    counter = LayerCallCounter()
    encoder_calls = 0
    refreshes: list[list[int]] = []
    passes = torch.zeros(B, dtype=torch.int32, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    eos = _eos_tensor(eos_token_id, device)
    max_length = P + max_new_tokens
    num_blocks = math.ceil(max_new_tokens / L)
    sequences = prompt_ids.clone()

    start = time.perf_counter()
    prompt = backbone.prefill(prompt_ids, attention_mask)
    encoder_calls += split.total
    for block in range(num_blocks):
        cache = AnchorCache()
        z = sampler.initial_canvas(B, L, generator, device)  # (B, L)
        greedy = z
        sc_logits: Tensor | None = None
        done_denoising = torch.zeros(B, dtype=torch.bool, device=device)
        if stopping is not None:
            stopping.reset()
        steps = range(T, 0, -1)
        for i in tqdm(steps, desc=f"canvas {block + 1}/{num_blocks}", disable=not progress, leave=False):
            passes += (~(done_denoising | finished)).to(passes.dtype)
            context = StackContext(prompt=prompt, self_conditioning_logits=sc_logits if self_conditioning else None)
            prepared = model.prepare(z, context)
            c = model.encode(z, prepared=prepared)  # (B, L, d)
            counter.add_encode(split)
            if is_refresh_step(i, T, refresh_interval):
                cache.store(model.compute_anchor(c, prepared=prepared), z, i)
                counter.add_anchor(split)
            assert cache.hidden is not None  # step T always refreshes
            logits = model.predict_logits(z, c, cache.hidden, prepared=prepared)  # (B, L, V)
            counter.add_predict(split)
            out = sampler.step(logits, i, z, generator)
            new_greedy, new_z, scaled = out.argmax, out.prev_sample, out.scaled_logits
            if stopping is not None:
                if bool(done_denoising.any()):  # rows that stopped keep their state
                    new_greedy = torch.where(done_denoising[:, None], greedy, new_greedy)
                    new_z = torch.where(done_denoising[:, None], z, new_z)
                    if sc_logits is not None:
                        scaled = torch.where(done_denoising[:, None, None], sc_logits, scaled)
                done_denoising |= stopping(new_greedy, scaled)
            sc_logits = scaled.to(embed_dtype)
            z, greedy = new_z, new_greedy
            if stopping is not None and bool(done_denoising.all()):
                break
        refreshes.append(list(cache.history))
        sequences = torch.cat([sequences, greedy], dim=-1)
        sequences, finished = _finalize_canvas(sequences, finished, L, max_length, eos, pad_token_id)
        if bool(finished.all()) or block == num_blocks - 1:
            break
        prompt = backbone.append(prompt, sequences[:, -L:])
        encoder_calls += split.total
    return BlockGenerationOutput(
        sequences=sequences,
        prompt_length=P,
        layer_calls=counter,
        encoder_layer_calls=encoder_calls,
        refresh_steps=refreshes,
        decoder_forward_passes=passes,
        seconds=time.perf_counter() - start,
    )
