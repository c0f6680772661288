"""The generation loop: paper Algorithm 1 (anchor-cache inference) around any sampler, optionally after a prompt."""

from __future__ import annotations

import numbers
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tadm.protocol import CacheableDenoiser, check_network
from tadm.sampling.anchor_cache import LayerCallCounter, check_refresh_interval
from tadm.sampling.base import Sampler, check_integer
from tadm.sampling.loop import LoopContext, check_contract, denoise
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
    prefix_lengths: list[int] = field(default_factory=list)  # per row, the prompt tokens kept at its start

    def new_tokens(self, row: int) -> Tensor:
        """The tokens of ``row`` after its prompt (all of them without one): (L - P,)."""
        return self.tokens[row, self.prefix_lengths[row] if self.prefix_lengths else 0:]


Prefix = Sequence[int] | Sequence[Sequence[int]] | Tensor
"""A prompt: one list of ids (or a (P,) tensor) for every row, or one per row (a list of lists, rows may differ in
length, or a (B, P) tensor)."""


class _KeptPrefix(LoopContext):
    """Loop state that writes the prompt back over the sampler's canvas after every reverse step, so that no step
    (a remasking one included) changes it."""

    def __init__(self, kept: Tensor, values: Tensor) -> None:
        self.kept, self.values = kept, values  # (B, L) bool, (B, L) ids

    def after_step(self, position: int, step_index: int | Tensor, z: Tensor, output: Any) -> Tensor:
        return torch.where(self.kept, self.values, output.prev_sample)


def _prefix_rows(prefix: Prefix, batch_size: int) -> list[list[int]]:
    """``prefix`` as one list of ids per row; a ValueError naming what is wrong with its shape or values."""
    if isinstance(prefix, Tensor):
        if prefix.is_floating_point() or prefix.is_complex() or prefix.dtype == torch.bool or prefix.dim() not in (1, 2):
            raise ValueError(f"prefix must hold integer token ids, (P,) or (B, P), got a {prefix.dtype} tensor of "
                             f"shape {tuple(prefix.shape)}")
        prefix = prefix.tolist()
    if isinstance(prefix, (str, bytes)) or not isinstance(prefix, Sequence):
        raise ValueError(f"prefix must be token ids (a list of ints, one list per row, or a tensor), got "
                         f"{type(prefix).__name__}; encode text with the model's tokenizer first")
    per_row = bool(prefix) and all(isinstance(row, (Sequence, Tensor)) and not isinstance(row, str) for row in prefix)
    rows = [row.tolist() if isinstance(row, Tensor) else list(row) for row in prefix] if per_row else [list(prefix)]
    if per_row and len(rows) != batch_size:
        raise ValueError(f"prefix has {len(rows)} rows but batch_size is {batch_size}; give one prompt per row, "
                         "or one prompt for all rows")
    rows = [[_token_id(token) for token in row] for row in rows]
    return rows if per_row else rows * batch_size


def _token_id(token: Any) -> int:
    if isinstance(token, bool) or not isinstance(token, numbers.Integral):
        raise ValueError(f"prefix must hold integer token ids, got {token!r}")
    return int(token)


def _prefix_context(model: Any, rows: list[list[int]], z: Tensor) -> _KeptPrefix:
    """The loop context that keeps ``rows`` at the start of canvas ``z`` (B, L), after checking that every prompt
    leaves room to generate and holds ids of the model's vocabulary other than its mask."""
    length, vocab, mask_id = z.shape[1], int(model.vocab_size), model.mask_token_id
    longest = max(len(row) for row in rows)
    if longest >= length:
        raise ValueError(f"a prompt of {longest} tokens leaves nothing to generate in seq_len={length}; give a "
                         f"seq_len larger than the prompt (at most the model's maximum)")
    bad = [token for row in rows for token in row if not 0 <= token < vocab or token == mask_id]
    if bad:
        raise ValueError(f"prefix token id {bad[0]} is not a token of the model (ids 0..{vocab - 1}"
                         f"{f', the mask {mask_id} excluded' if mask_id is not None else ''}); encode the prompt "
                         "with the model's own tokenizer")
    kept = torch.zeros_like(z, dtype=torch.bool)
    values = torch.zeros_like(z)
    for n, row in enumerate(rows):
        values[n, :len(row)] = torch.tensor(row, dtype=z.dtype)
        kept[n, :len(row)] = True
    return _KeptPrefix(kept, values)


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
    prefix: Prefix | None = None,
) -> GenerationOutput:
    """Sample ``batch_size`` sequences of ``seq_len`` tokens with anchor caching (Algorithm 1).

    For i = T..1: c_i = S(z_i); if (T - i) mod K == 0 the anchor is refreshed, h = A(c_i);
    log x_theta = D(Phi(c_i, h)); z_{i-1} ~ sampler(z_i, x_theta, i). With K = 1 this is the
    uncached model. Baselines plug in through the same protocol (MDLM: no anchor layers; ADLM:
    the anchor is reused as-is, i.e. naive reuse). A module left in training mode samples in eval mode (no
    dropout) and is put back in training mode afterwards.

    With a ``prefix`` (a prompt), its tokens are written at the start of the canvas and written back after every
    reverse step (prefix infilling): no step changes them, at any K, and the network sees them at every
    step; the positions after them are generated. ``seq_len`` counts the prompt. A prompt for the start of a
    document begins with the tokenizer's BOS id, as every document does in training.

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
        prefix: token ids kept at the start of every row (:data:`Prefix`: one prompt for all rows, or one per
            row, rows of different lengths allowed); shorter than ``seq_len``, ids of the model's vocabulary
            other than its mask.
    """
    if isinstance(sampler, str):
        check_network(model)  # before the registry reads the model's mask id or vocabulary
        sampler = build_sampler(sampler, model)
    policy = _resolve_policy(policy, refresh_interval, skip_unchanged)
    check_contract(model, sampler, policy, full_output=full_output)  # the network's and the sampler's, once
    sampler.set_timesteps(num_steps)
    _check_generation(model, batch_size, seq_len, max_seq_len, policy, time_conditioned)
    device = torch.device(device) if device is not None else _model_device(model)
    rows = _prefix_rows(prefix, batch_size) if prefix is not None else None

    z = sampler.initial_canvas(batch_size, seq_len, generator, device)  # (B, L)
    context = _prefix_context(model, rows, z) if rows is not None else None
    if context is not None:
        z = torch.where(context.kept, context.values, z)
    start = time.perf_counter()
    with _eval_mode(model):
        run = denoise(model, sampler, z, range(num_steps, 0, -1), policy=policy, context=context,
                      generator=generator, progress=progress, full_output=full_output)
    return GenerationOutput(
        tokens=run.z,
        layer_calls=run.layer_calls,
        num_steps=num_steps,
        refresh_interval=policy.fixed_interval,
        refresh_steps=list(run.cache.history),
        seconds=time.perf_counter() - start,
        policy=policy.label(),
        prefix_lengths=[len(row) for row in rows] if rows is not None else [],
    )
