"""The generation loop: paper Algorithm 1 (anchor-cache inference) around any sampler."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tadm.sampling.anchor_cache import AnchorCache, LayerCallCounter, check_refresh_interval, is_refresh_step
from tadm.sampling.base import Sampler
from tadm.sampling.protocol import CacheableDenoiser


@dataclass
class GenerationOutput:
    """Generated token ids (B, L), the layer calls they cost, the refresh steps and wall time."""

    tokens: Tensor
    layer_calls: LayerCallCounter
    num_steps: int
    refresh_interval: int
    refresh_steps: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _model_device(model: object) -> torch.device:
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        for p in parameters():
            return p.device
    return torch.device("cpu")


def _same_canvas(a: Tensor | None, b: Tensor) -> bool:
    return a is not None and a.shape == b.shape and bool(torch.equal(a, b))


@torch.no_grad()
def generate(
    model: CacheableDenoiser,
    sampler: Sampler,
    *,
    batch_size: int,
    seq_len: int,
    num_steps: int,
    refresh_interval: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    skip_unchanged: bool = False,
    time_conditioned: bool = False,
    progress: bool = False,
    max_seq_len: int | None = None,
) -> GenerationOutput:
    """Sample ``batch_size`` sequences of ``seq_len`` tokens with anchor caching (Algorithm 1).

    For i = T..1: c_i = S(z_i); if (T - i) mod K == 0 the anchor is refreshed, h = A(c_i);
    log x_theta = D(Phi(c_i, h)); z_{i-1} ~ sampler(z_i, x_theta, i). With K = 1 this is the
    uncached model. Baselines plug in through the same protocol (MDLM: no anchor layers; ADLM:
    the anchor is reused as-is, i.e. naive reuse).

    Args:
        model: any ``CacheableDenoiser`` (TADM, MDLM, ADLM, a post-trained backbone, ...).
        sampler: a sampler from ``tadm.sampling`` (``set_timesteps`` is called here).
        num_steps: T, reverse steps (>= 1).
        refresh_interval: K, reverse steps between anchor refreshes (>= 1).
        skip_unchanged: MDLM's caching: when the canvas did not change since the previous step and
            the anchor is unchanged, reuse the previous log-probabilities instead of calling the
            network (exact for networks without time conditioning; refused otherwise). A refresh due
            on a canvas identical to the cached one is skipped too, since it would recompute the
            same anchor.
        time_conditioned: pass t(i) to the network (only for time-conditioned networks).
        max_seq_len: if given, ``seq_len`` larger than this raises a clear error.
    """
    check_refresh_interval(refresh_interval)
    sampler.set_timesteps(num_steps)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"sequence length must be an integer >= 1, got {seq_len!r}")
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds the model's maximum of {max_seq_len}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be an integer >= 1, got {batch_size!r}")
    if skip_unchanged and time_conditioned:
        raise ValueError("skip_unchanged is only exact for networks without time conditioning")
    device = torch.device(device) if device is not None else _model_device(model)

    split = model.layer_split
    counter = LayerCallCounter()
    cache = AnchorCache()
    z = sampler.initial_canvas(batch_size, seq_len, generator, device)  # (B, L)
    prev_canvas: Tensor | None = None
    prev_log_probs: Tensor | None = None

    start = time.perf_counter()
    steps = range(num_steps, 0, -1)
    for i in tqdm(steps, desc="sampling", disable=not progress, leave=False):
        t = torch.full((batch_size,), sampler.time(i), device=device) if time_conditioned else None
        refresh = is_refresh_step(i, num_steps, refresh_interval)
        unchanged = skip_unchanged and _same_canvas(prev_canvas, z)
        if unchanged and (not refresh or _same_canvas(cache.canvas, z)) and prev_log_probs is not None:
            log_probs = prev_log_probs
            counter.skipped_steps += 1
        else:
            c = model.encode(z, t)  # (B, L, D)
            counter.add_encode(split)
            if refresh and not (skip_unchanged and _same_canvas(cache.canvas, z)):
                cache.store(model.compute_anchor(c, t), z, i)
                counter.add_anchor(split)
            if cache.hidden is None:  # only reachable if the first step were not a refresh step
                raise RuntimeError("anchor cache is empty at the first reverse step")
            log_probs = model.predict(z, c, cache.hidden, t)  # (B, L, V)
            counter.add_predict(split)
        prev_canvas, prev_log_probs = z, log_probs
        z = sampler.step(log_probs, i, z, generator).prev_sample

    mask_id = getattr(model, "mask_token_id", None)
    if mask_id is not None and prev_log_probs is not None and bool((z == mask_id).any()):
        if getattr(sampler, "final_denoise", False):
            # The released samplers' last call: one more prediction on the final canvas (step 0 of
            # Algorithm 1, refreshing the anchor if (T - 0) mod K == 0), argmax at the masks.
            t = torch.full((batch_size,), sampler.time(0), device=device) if time_conditioned else None
            c = model.encode(z, t)  # (B, L, D)
            counter.add_encode(split)
            if is_refresh_step(0, num_steps, refresh_interval):
                cache.store(model.compute_anchor(c, t), z, 0)
                counter.add_anchor(split)
            prev_log_probs = model.predict(z, c, cache.hidden, t)  # (B, L, V)
            counter.add_predict(split)
        # Otherwise masks left by a schedule with alpha_0 slightly below 1 take the argmax of the last prediction.
        z = torch.where(z == mask_id, prev_log_probs.argmax(-1), z)
    return GenerationOutput(
        tokens=z,
        layer_calls=counter,
        num_steps=num_steps,
        refresh_interval=refresh_interval,
        refresh_steps=list(cache.history),
        seconds=time.perf_counter() - start,
    )
