"""The generation loop: paper Algorithm 1 (anchor-cache inference) around any sampler."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tadm.protocol import CacheableDenoiser, check_network
from tadm.sampling.anchor_cache import LayerCallCounter, check_refresh_interval
from tadm.sampling.base import Sampler, check_integer
from tadm.sampling.loop import check_contract, denoise
from tadm.sampling.refresh import FixedRefresh, RefreshPolicy, parse_refresh
from tadm.sampling.registry import build_sampler


@dataclass
class GenerationOutput:
    """Generated token ids (B, L), the layer calls they cost, the refresh steps and wall time."""

    tokens: Tensor
    layer_calls: LayerCallCounter
    num_steps: int
    refresh_interval: int | None  # K of a fixed policy, None for other policies
    refresh_steps: list[int] = field(default_factory=list)
    seconds: float = 0.0
    policy: str = ""  # the refresh policy's label, e.g. "K=4"


def _model_device(model: object) -> torch.device:
    """Where a module's parameters live; CPU for a network that is no torch module (the protocol allows it)."""
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


@contextmanager
def _eval_mode(model: object) -> Iterator[None]:
    """A torch module runs in eval mode (dropout off: a seed gives one sample); its own mode is restored after."""
    training = isinstance(model, torch.nn.Module) and model.training
    if training:
        model.eval()
    try:
        yield
    finally:
        if training:
            model.train()


def _resolve_policy(policy: Any, refresh_interval: int, skip_unchanged: bool) -> RefreshPolicy:
    check_refresh_interval(refresh_interval)
    if policy is None:
        return FixedRefresh(refresh_interval, skip_unchanged=skip_unchanged)
    if refresh_interval != 1 or skip_unchanged:
        raise ValueError("give either a refresh policy or refresh_interval/skip_unchanged, not both")
    return parse_refresh(policy)


def _check_generation(model: Any, batch_size: int, seq_len: int, max_seq_len: int | None, policy: RefreshPolicy,
                      time_conditioned: bool | None) -> None:
    check_integer("sequence length", seq_len)
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds the model's maximum of {max_seq_len}")
    check_integer("batch size", batch_size)
    if time_conditioned is not None and bool(time_conditioned) != bool(model.time_conditioned):
        raise ValueError(f"time_conditioned={time_conditioned} contradicts the model (time_conditioned="
                         f"{model.time_conditioned}); leave it out: the loop reads it from the model")
    if policy.skip_unchanged and model.time_conditioned:
        raise ValueError("skip_unchanged is only exact for networks without time conditioning")


@torch.no_grad()
def generate(
    model: CacheableDenoiser,
    sampler: Sampler | str,
    *,
    batch_size: int,
    seq_len: int,
    num_steps: int,
    refresh_interval: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    skip_unchanged: bool = False,
    time_conditioned: bool | None = None,
    progress: bool = False,
    max_seq_len: int | None = None,
    policy: Any = None,
    full_output: bool = False,
) -> GenerationOutput:
    """Sample ``batch_size`` sequences of ``seq_len`` tokens with anchor caching (Algorithm 1).

    For i = T..1: c_i = S(z_i); if (T - i) mod K == 0 the anchor is refreshed, h = A(c_i);
    log x_theta = D(Phi(c_i, h)); z_{i-1} ~ sampler(z_i, x_theta, i). With K = 1 this is the
    uncached model. Baselines plug in through the same protocol (MDLM: no anchor layers; ADLM:
    the anchor is reused as-is, i.e. naive reuse). A module left in training mode samples in eval mode (no
    dropout) and is put back in training mode afterwards.

    Args:
        model: any ``CacheableDenoiser`` (TADM, MDLM, ADLM, a post-trained backbone, ...).
        sampler: a sampler from ``tadm.sampling`` (``set_timesteps`` is called here), or a registry name
            (``"mdlm"``, ...) built for the model with its default options (:func:`~tadm.sampling.build_sampler`).
        num_steps: T, reverse steps (>= 1).
        refresh_interval: K, reverse steps between anchor refreshes (>= 1).
        skip_unchanged: MDLM's caching, reuse the previous output while the canvas is unchanged
            (:class:`~tadm.sampling.refresh.RefreshPolicy`); refused for time-conditioned networks (not exact there).
        time_conditioned: read from the model (``model.time_conditioned``); if given, it must agree.
        max_seq_len: if given, ``seq_len`` larger than this raises a clear error.
        policy: a refresh policy (:mod:`tadm.sampling.refresh`) instead of ``refresh_interval`` and
            ``skip_unchanged`` (which make ``FixedRefresh(K, skip_unchanged)``).
        full_output: x_theta at every position of every step (the reference path; see
            :func:`~tadm.sampling.loop.denoise`).
    """
    if isinstance(sampler, str):
        check_network(model)  # before the registry reads the model's mask id or vocabulary
        sampler = build_sampler(sampler, model)
    policy = _resolve_policy(policy, refresh_interval, skip_unchanged)
    check_contract(model, sampler, policy, full_output=full_output)  # the network's and the sampler's, once
    sampler.set_timesteps(num_steps)
    _check_generation(model, batch_size, seq_len, max_seq_len, policy, time_conditioned)
    device = torch.device(device) if device is not None else _model_device(model)

    z = sampler.initial_canvas(batch_size, seq_len, generator, device)  # (B, L)
    start = time.perf_counter()
    with _eval_mode(model):
        run = denoise(model, sampler, z, range(num_steps, 0, -1), policy=policy, generator=generator,
                      progress=progress, full_output=full_output)
    return GenerationOutput(
        tokens=run.z,
        layer_calls=run.layer_calls,
        num_steps=num_steps,
        refresh_interval=policy.fixed_interval,
        refresh_steps=list(run.cache.history),
        seconds=time.perf_counter() - start,
        policy=policy.label(),
    )
