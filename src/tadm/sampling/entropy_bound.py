"""DiffusionGemma's entropy-bound sampler (paper Algorithm 2) and its optional adaptive stopping.

A uniform-state sampler that never calls a network: it receives the denoiser's raw logits for the
canvas ``z_n`` at reverse step ``n`` (``n = T, ..., 1``) and returns ``z_{n-1}``:

1. temperature ``tau_n = tau_min + (tau_max - tau_min) n / T`` and ``p_n = softmax(L_n / tau_n)``;
2. a candidate canvas ``x~_n ~ Cat(p_n)`` and the greedy canvas ``x^_n = argmax p_n``;
3. per-position entropies ``H_l`` sorted ascending (``pi``); position ``pi_m`` is accepted when
   ``C_m - M_m <= eta`` with ``C_m`` the cumulative and ``M_m`` the running-max entropy (the sum of
   the accepted entropies but the largest, an upper bound on their joint mutual information);
4. accepted positions take ``x~_n``, all others are re-noised uniformly over the vocabulary.

After the last step (``n = 1``) the output is the greedy canvas ``x^_1``. The temperature-scaled
logits ``L_n / tau_n`` are returned too: the next decoder call turns them into the
self-conditioning signal ``s = p_n E``.

Compatibility with ``transformers``' ``DiffusionGemmaForBlockDiffusion.generate`` (checked in the
tests): with ``categorical="multinomial"`` the random stream is consumed exactly like the released
sampler (one ``randint`` canvas, then per step one ``multinomial`` draw and one ``randint``
re-noising canvas, also at ``n = 1`` where both are discarded), the temperature is computed in
float32 from an int32 step tensor as there, and entropies use ``torch.distributions.Categorical``,
so the same seed gives the same tokens. ``categorical="gumbel"`` draws ``x~_n`` with the float64
Gumbel-max of :func:`tadm.sampling.categorical.sample_categorical` instead (same distribution,
different stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tadm.sampling.base import ConfiguredSampler, check_integer, check_num_steps, check_number, check_step_index
from tadm.sampling.categorical import sample_categorical

__all__ = ["CATEGORICAL_DRAWS", "EntropyBoundOutput", "EntropyBoundSampler", "EntropyBoundSamplerConfig",
           "entropy_bound_accept", "token_entropy"]

CATEGORICAL_DRAWS = ("multinomial", "gumbel")


def _randint(high: int, shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Uniform ids in [0, high), drawn on the generator's device (a CPU generator can seed CUDA work)."""
    where = generator.device if generator is not None else device
    return torch.randint(0, high, shape, generator=generator, device=where).to(device)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of softmax(logits) per position: (B, L, V) -> (B, L).

    Bit-identical to ``torch.distributions.Categorical(logits=logits).entropy()``, which the released
    DiffusionGemma sampler uses, so that sorting and acceptance see the same values: the same
    operations in the same order (normalise by logsumexp, softmax of the normalised logits, clamp at
    the dtype's minimum, ``-sum(logits * probs)``), with the clamp and product done in place, so
    that two (B, L, V) temporaries are made instead of four. With gradients required it is
    ``Categorical``'s own computation (the in-place product would overwrite what backward needs).
    """
    if logits.requires_grad and torch.is_grad_enabled():
        return torch.distributions.Categorical(logits=logits, validate_args=False).entropy()
    normalized = logits - logits.logsumexp(dim=-1, keepdim=True)  # (B, L, V)
    probs = torch.softmax(normalized, dim=-1)  # (B, L, V)
    p_log_p = normalized.clamp_(min=torch.finfo(normalized.dtype).min).mul_(probs)  # (B, L, V)
    del probs
    return -p_log_p.sum(-1)


def entropy_bound_accept(entropy: Tensor, entropy_bound: float) -> Tensor:
    """Positions accepted by the entropy bound (Algorithm 2): (B, L) entropies -> (B, L) bool.

    Sorting ascending gives ``pi``; ``C_m = sum_{r <= m} H_{pi_r}`` and, the order being ascending,
    ``M_m = H_{pi_m}``; ``pi_m`` is accepted iff ``C_m - M_m <= eta``. The lowest-entropy position is
    therefore always accepted (``C_1 - M_1 = 0``).
    """
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)  # (B, L)
    cumulative = torch.cumsum(sorted_entropy, dim=-1)  # (B, L)
    accepted_sorted = cumulative - sorted_entropy <= entropy_bound  # (B, L)
    return torch.scatter(torch.zeros_like(accepted_sorted), -1, order, accepted_sorted)


@dataclass
class EntropyBoundOutput:
    """One step of Algorithm 2 (``prev_sample`` is what every tadm sampler step returns).

    prev_sample: the next canvas z_{n-1} (B, L); at n = 1 the greedy canvas.
    argmax: the greedy canvas x^_n (B, L).
    scaled_logits: L_n / tau_n (B, L, V), float32; the next step's self-conditioning logits.
    accepted: positions that took the sampled token (B, L) bool.
    entropy: per-position entropy of p_n (B, L).
    x0_probs: p_n = softmax(L_n / tau_n) (B, L, V), float32, computed when read (bit-identical to the
        probabilities the step drew from); not kept, so that a step's output holds one (B, L, V) tensor.
    """

    prev_sample: Tensor
    argmax: Tensor
    scaled_logits: Tensor
    accepted: Tensor
    entropy: Tensor

    @property
    def x0_probs(self) -> Tensor:
        return torch.softmax(self.scaled_logits, dim=-1, dtype=torch.float32)  # (B, L, V)


@dataclass(frozen=True)
class EntropyBoundSamplerConfig:
    """Settings of :class:`EntropyBoundSampler` (paper defaults; validated on construction).

    entropy_bound: eta > 0, finite (paper: 0.1).
    temperature_max, temperature_min: tau at n = T and as n -> 0, 0 <= min <= max and max > 0 (paper:
        0.8, 0.4). Steps run at n >= 1, so tau_n >= tau_min + (tau_max - tau_min) / T is positive even
        with tau_min = 0, which DiffusionGemma's generation config (``t_min``) accepts too.
    num_steps: T, the step budget (paper: 48).
    categorical: "multinomial" (the released sampler's draws) or "gumbel" (float64 Gumbel-max).
    """

    entropy_bound: float = 0.1
    temperature_max: float = 0.8
    temperature_min: float = 0.4
    num_steps: int = 48
    categorical: str = "multinomial"

    def __post_init__(self) -> None:
        owner = "entropy-bound sampler"
        for name in ("entropy_bound", "temperature_max"):
            check_number(owner, name, getattr(self, name), low=0.0, low_open=True)
        check_number(owner, "temperature_min", self.temperature_min, low=0.0)
        if not self.temperature_min <= self.temperature_max:
            raise ValueError(
                f"{owner}: temperatures must satisfy 0 <= temperature_min <= temperature_max, got "
                f"min={self.temperature_min!r}, max={self.temperature_max!r}"
            )
        check_num_steps(self.num_steps)
        lowest = self.temperature_min + (self.temperature_max - self.temperature_min) * (
            torch.tensor(1, dtype=torch.int32) / self.num_steps)  # tau_1, the smallest, as step() computes it
        if not float(lowest) > 0:
            raise ValueError(f"{owner}: the temperature at the last step, temperature_min + (temperature_max - "
                             f"temperature_min) / T = {float(lowest)!r}, must be > 0 (min={self.temperature_min!r}, "
                             f"max={self.temperature_max!r}, T={self.num_steps})")
        if self.categorical not in CATEGORICAL_DRAWS:
            raise ValueError(f"unknown categorical draw {self.categorical!r}; valid: {', '.join(CATEGORICAL_DRAWS)}")


class EntropyBoundSampler(ConfiguredSampler):
    """Entropy-bound sampling over a uniform-noise canvas (Algorithm 2), diffusers-style.

    ``set_timesteps(T)`` then, for ``n = T, ..., 1``, ``step(logits, n, z_n, generator)``. ``n`` may
    also be a (B,) tensor of per-row step indices (used by training rollouts, where rows sit at
    different points of the grid); the temperature is then per row.

    Args:
        vocab_size: V, the number of ids the canvas and the noise range over.
        entropy_bound, temperature_max, temperature_min, num_steps, categorical: see
            :class:`EntropyBoundSamplerConfig`.
    """

    consumes = "logits"  # the loop hands it the denoiser's raw logits, not log-probabilities

    def __init__(
        self,
        vocab_size: int,
        entropy_bound: float = 0.1,
        temperature_max: float = 0.8,
        temperature_min: float = 0.4,
        num_steps: int = 48,
        categorical: str = "multinomial",
    ) -> None:
        check_integer("vocab_size", vocab_size, minimum=2)
        self.config = EntropyBoundSamplerConfig(entropy_bound, temperature_max, temperature_min, num_steps, categorical)
        self.vocab_size = vocab_size
        self.entropy_bound = float(entropy_bound)
        self.temperature_max = float(temperature_max)
        self.temperature_min = float(temperature_min)
        self.categorical = categorical
        self.num_steps = num_steps

    def time(self, step_index: int) -> float:
        """t(n) = n / T (the sampler itself is time-free; for time-conditioned networks only)."""
        return step_index / self.num_steps

    def temperature(self, step_index: int | Tensor, device: torch.device | None = None) -> Tensor:
        """tau_n = tau_min + (tau_max - tau_min) n / T as float32: a 0-d tensor, or (B, 1, 1) for (B,) steps.

        Evaluated like the released sampler (an int32 step tensor divided by T in float32), so that the
        scaled logits match it bit for bit.
        """
        if isinstance(step_index, Tensor):
            n = step_index.to(device=device if device is not None else step_index.device, dtype=torch.int32)
            if n.dim() == 1:
                n = n[:, None, None]  # (B, 1, 1)
            elif n.dim() != 0:
                raise ValueError(f"step_index must be an int, a 0-d or a (B,) tensor; got shape {tuple(n.shape)}")
        else:
            n = torch.tensor(step_index, dtype=torch.int32, device=device)
        return self.temperature_min + (self.temperature_max - self.temperature_min) * (n / self.num_steps)

    def _check_steps(self, step_index: int | Tensor) -> None:
        if isinstance(step_index, Tensor):
            if step_index.numel() and (int(step_index.min()) < 1 or int(step_index.max()) > self.num_steps):
                raise ValueError(
                    f"step indices must be in 1..{self.num_steps}, got values in "
                    f"[{int(step_index.min())}, {int(step_index.max())}]"
                )
        else:
            check_step_index(step_index, self.num_steps)

    def scale_logits(self, logits: Tensor, step_index: int | Tensor) -> Tensor:
        """L_n / tau_n in float32: (B, L, V) -> (B, L, V)."""
        return logits.float() / self.temperature(step_index, device=logits.device)

    def initial_canvas(
        self, batch_size: int, seq_len: int, generator: torch.Generator | None, device: torch.device
    ) -> Tensor:
        """The uniform prior: ids drawn uniformly from the vocabulary, (B, L)."""
        return _randint(self.vocab_size, (batch_size, seq_len), generator, torch.device(device))

    def _draw(self, probs: Tensor, generator: torch.Generator | None) -> Tensor:
        B, L, V = probs.shape
        if self.categorical == "gumbel":
            return sample_categorical(probs, generator)  # (B, L)
        where = generator.device if generator is not None else probs.device  # a CPU generator can seed CUDA work
        flat = probs.view(-1, V).to(where)  # (B*L, V)
        return torch.multinomial(flat, num_samples=1, generator=generator).to(probs.device).view(B, L)

    def step(
        self, logits: Tensor, step_index: int | Tensor, z_t: Tensor, generator: torch.Generator | None = None
    ) -> EntropyBoundOutput:
        """One reverse step of Algorithm 2.

        Args:
            logits: raw denoiser logits L_n (B, L, V) (log-probabilities work too: softmax is
                shift-invariant, though then not bit-identical to the released sampler).
            step_index: n in 1..T, an int or a (B,) tensor.
            z_t: the current canvas z_n (B, L).
            generator: source of randomness.

        Returns:
            EntropyBoundOutput with ``prev_sample`` = z_{n-1} (the greedy canvas where n == 1).
        """
        self._check_steps(step_index)
        if logits.dim() != 3 or logits.shape[:2] != z_t.shape:
            raise ValueError(f"logits {tuple(logits.shape)} must be (B, L, V) for a canvas of shape {tuple(z_t.shape)}")
        scaled = self.scale_logits(logits, step_index)  # (B, L, V)
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)  # (B, L, V)
        candidate = self._draw(probs, generator)  # (B, L)
        del probs  # freed before the entropy's temporaries are made (EntropyBoundOutput.x0_probs recomputes it)
        argmax = torch.argmax(scaled, dim=-1)  # (B, L)
        entropy = token_entropy(scaled)  # (B, L)
        accepted = entropy_bound_accept(entropy, self.entropy_bound)  # (B, L)
        kept = torch.where(accepted, candidate, z_t)  # (B, L)
        noise = _randint(self.vocab_size, tuple(z_t.shape), generator, z_t.device)  # (B, L)
        renoised = torch.where(~accepted, noise, kept)  # (B, L)
        if isinstance(step_index, Tensor):
            last = (step_index.to(z_t.device) == 1)[:, None] if step_index.dim() == 1 else step_index == 1
            prev = torch.where(last, argmax, renoised)
        else:
            # The draws at n = 1 are made and discarded, as the released sampler does.
            prev = argmax if step_index == 1 else renoised
        return EntropyBoundOutput(prev_sample=prev, argmax=argmax, scaled_logits=scaled, accepted=accepted,
                                  entropy=entropy)
