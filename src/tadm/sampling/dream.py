"""Dream's samplers (``diffusion_generate``'s ``alg``): origin, maskgit_plus, topk_margin and entropy.

The canvas holds the whole sequence (a prompt, then masks); only masked positions change. The time
grid is ``t_n = linspace(1, eps, T + 1)[n]`` for the n-th step (n = T - i). At every step the
network's logits (B, L, V), aligned with the canvas (Dream's are shifted by one position, which
:class:`~tadm.posttrain.backbones.DreamBackbone` undoes), are read at the masked positions in
row-major order and turned into a prediction and a confidence by :func:`sample_tokens`: divided by the
temperature, filtered by top-p and top-k, a softmax, a categorical draw (temperature > 0) or the
argmax, with the confidence the chosen token's probability, the margin between the two most probable
tokens (``topk_margin``) or the negative entropy (``entropy``). Then

* ``origin``: each masked position is decoded with probability ``1 - t_{n+1} / t_n`` (all at the last
  step) -- MDLM's ancestral step, Eq. (mdlm-posterior-unk);
* ``maskgit_plus``, ``topk_margin``, ``entropy``: ``k = floor(m (1 - t_{n+1} / t_n))`` positions per row
  are decoded, ``m`` the masked positions per row averaged over the batch (all of them at the last
  step): the k most confident, or with ``alg_temp`` a draw without replacement from
  ``softmax(confidence / alg_temp)``.

Per-row step indices (post-training rollouts start every row at its own step i): with a (B,) tensor
``step_index`` each row reads its own ``t_n, t_{n+1}``; ``origin`` decodes each masked position with
its row's probability, and the other algorithms decode ``k = floor(m (1 - t_{n+1} / t_n))`` of the
row's own ``m`` masks. With the same i and the same number of masks in every row this is the
batched step, draw for draw (tested).

Compatibility with ``diffusion_generate`` of the public Dream code (checked in the tests against its
tokens): the random stream is consumed exactly as there (``origin``: one float32 uniform per masked
position, then one multinomial draw over the rows decoded; the others: one multinomial draw over all
masked rows at temperature > 0, then with ``alg_temp`` one multinomial over positions), in float32
where its logits are float32, so the same seed gives the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tadm.sampling.base import (ConfiguredSampler, SamplerOutput, check_integer, check_num_steps, check_number,
                                check_step_index, check_step_rows)

__all__ = ["DREAM_ALGS", "DreamSampler", "DreamSamplerConfig", "sample_tokens", "top_k_logits", "top_p_logits"]

DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclass(frozen=True)
class DreamSamplerConfig:
    """Settings of :class:`DreamSampler` (``DreamGenerationConfig``'s defaults; validated on construction).

    alg: "origin", "maskgit_plus", "topk_margin" or "entropy".
    temperature: >= 0 (0: the argmax). top_p: None or in (0, 1]. top_k: None or an integer >= 1.
    alg_temp: None (or 0) commits the most confident positions; > 0 draws them from
        softmax(confidence / alg_temp). Not for "origin".
    eps: the last time of the grid, in (0, 1).
    """

    alg: str = "origin"
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    alg_temp: float | None = None
    eps: float = 1e-3

    def __post_init__(self) -> None:
        owner = "Dream sampler"
        if self.alg not in DREAM_ALGS:
            raise ValueError(f"{owner}: unknown alg {self.alg!r}; valid: {', '.join(DREAM_ALGS)}")
        check_number(owner, "temperature", self.temperature, low=0.0)
        if self.top_p is not None:
            check_number(owner, "top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.top_k is not None:
            check_integer(f"{owner}: top_k", self.top_k)
        if self.alg_temp is not None:
            check_number(owner, "alg_temp", self.alg_temp, low=0.0)
            if self.alg == "origin" and self.alg_temp > 0:
                raise ValueError(f"{owner}: alg_temp applies to maskgit_plus, topk_margin and entropy, not origin")
        check_number(owner, "eps", self.eps, low=0.0, high=1.0, low_open=True)
        if self.eps >= 1:
            raise ValueError(f"{owner}: eps must be < 1 (the grid runs from t = 1 down to eps), got {self.eps!r}")


def top_p_logits(logits: Tensor, top_p: float) -> Tensor:
    """Keep the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (the crossing id kept);
    the rest get the dtype's minimum: (n, V) -> (n, V)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove_sorted = cumulative > top_p
    remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, remove_sorted)
    return logits.masked_fill(remove, torch.finfo(logits.dtype).min)


def top_k_logits(logits: Tensor, top_k: int) -> Tensor:
    """Logits below the k-th largest get the dtype's minimum: (n, V) -> (n, V)."""
    top_k = min(top_k, logits.size(-1))
    remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(remove, torch.finfo(logits.dtype).min)


def _is_distribution(probs: Tensor) -> bool:
    """Whether every row is a probability vector to 1e-6 (torch.distributions' simplex check)."""
    normalized = probs / probs.sum(-1, keepdim=True)
    return bool(((normalized >= 0).all(dim=-1) & ((normalized.sum(-1) - 1).abs() < 1e-6)).all())


def sample_tokens(logits: Tensor, temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                  margin_confidence: bool = False, neg_entropy: bool = False,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """A prediction and its confidence per row of ``logits`` (n, V) -> ((n,), (n,)) (module docstring).

    At temperature > 0 the draw is ``torch.multinomial`` on the renormalised probabilities (what
    ``torch.distributions.Categorical`` samples with); rows that are no probability vector (NaN) fall
    back to the argmax, as in the public Dream code.
    """
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_logits(logits, top_p)
    if top_k is not None:
        logits = top_k_logits(logits, top_k)
    probs = torch.softmax(logits, dim=-1)  # (n, V)
    if temperature > 0 and _is_distribution(probs):
        where = generator.device if generator is not None else probs.device
        normalized = (probs / probs.sum(-1, keepdim=True)).to(where)
        x0 = torch.multinomial(normalized, 1, True, generator=generator).to(probs.device).view(-1)  # (n,)
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        top = torch.sort(probs, dim=-1, descending=True)[0]
        confidence = top[:, 0] - top[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


class DreamSampler(ConfiguredSampler):
    """Dream's ``diffusion_generate`` step for one ``alg`` (module docstring), diffusers-style.

    ``set_timesteps(T)`` then ``step(logits, i, z)`` for i = T..1. The loop hands it the raw logits
    aligned with the canvas (``consumes = "logits"``).

    Args:
        mask_id: the model's mask token id.
        alg, temperature, top_p, top_k, alg_temp, eps: see :class:`DreamSamplerConfig`.
    """

    consumes = "logits"
    per_row_steps = True  # step() takes a (B,) tensor of step indices

    def __init__(self, mask_id: int, alg: str = "origin", temperature: float = 0.0, top_p: float | None = None,
                 top_k: int | None = None, alg_temp: float | None = None, eps: float = 1e-3) -> None:
        check_integer("mask_id", mask_id, minimum=0)
        self.config = DreamSamplerConfig(alg, temperature, top_p, top_k, alg_temp, eps)
        self.mask_id = mask_id
        self.num_steps = 0

    def set_timesteps(self, num_steps: int) -> None:
        self.num_steps = check_num_steps(num_steps)

    def timesteps(self, device: torch.device | None = None) -> Tensor:
        """The float32 grid linspace(1, eps, T + 1) (T + 1,): step i runs from entry T - i to entry T - i + 1."""
        return torch.linspace(1, self.config.eps, self.num_steps + 1, device=device)

    def time(self, step_index: int) -> float:
        """t(i), the grid's entry T - i (the sampler itself is time-free; for time-conditioned networks only)."""
        return float(self.timesteps()[self.num_steps - step_index])

    def initial_canvas(self, batch_size: int, seq_len: int, generator: torch.Generator | None,
                       device: torch.device) -> Tensor:
        """All mask tokens (B, L): the whole canvas is generated."""
        return torch.full((batch_size, seq_len), self.mask_id, dtype=torch.long, device=device)

    def _draws(self, logits: Tensor, generator: torch.Generator | None, **confidence: bool) -> tuple[Tensor, Tensor]:
        c = self.config
        return sample_tokens(logits, c.temperature, c.top_p, c.top_k, generator=generator, **confidence)

    def _origin_step(self, z: Tensor, mask_index: Tensor, mask_logits: Tensor, p_transfer: float | Tensor,
                     generator: torch.Generator | None) -> SamplerOutput:
        """``alg="origin"``: each masked position of z (B, L) is decoded with probability ``p_transfer`` (a number,
        or one per masked position (m,)), drawn from its row of ``mask_logits`` (m, V); z is updated in place."""
        x0 = torch.full((mask_logits.shape[0],), self.mask_id, dtype=torch.long, device=z.device)
        where = generator.device if generator is not None else z.device
        chosen = torch.rand(x0.shape, generator=generator, device=where).to(z.device) < p_transfer
        _, x0[chosen] = self._draws(mask_logits[chosen], generator)
        z[mask_index] = x0
        return SamplerOutput(prev_sample=z)

    def step(self, logits: Tensor, step_index: int, z_t: Tensor,
             generator: torch.Generator | None = None) -> SamplerOutput:
        """One step of ``diffusion_generate`` (module docstring) on the masked positions of z_t (B, L)."""
        if logits.dim() != 3 or logits.shape[:2] != z_t.shape:
            raise ValueError(f"logits {tuple(logits.shape)} must be (B, L, V) for a canvas of shape {tuple(z_t.shape)}")
        if isinstance(step_index, Tensor):
            return self._step_rows(logits, step_index, z_t, generator)
        check_step_index(step_index, self.num_steps)
        n = self.num_steps - step_index
        grid = self.timesteps(z_t.device)
        t, s = grid[n], grid[n + 1]
        last = step_index == 1
        mask_index = z_t == self.mask_id  # (B, L)
        mask_logits = logits[mask_index]  # (m, V), row-major
        z = z_t.clone()
        if self.config.alg == "origin":
            return self._origin_step(z, mask_index, mask_logits, 1 if last else 1 - s / t, generator)
        confidence, x0 = self._draws(mask_logits, generator, margin_confidence=self.config.alg == "topk_margin",
                                     neg_entropy=self.config.alg == "entropy")
        per_row = mask_index.sum() / mask_index.shape[0]  # float32, as the public code computes it
        k = int(per_row) if last else int(per_row * (1 - s / t))
        if k <= 0:
            return SamplerOutput(prev_sample=z)
        full = torch.full_like(z, -torch.inf, dtype=logits.dtype)  # (B, L)
        full[mask_index] = confidence
        alg_temp = self.config.alg_temp
        if alg_temp is None or alg_temp == 0:
            _, index = torch.topk(full, k)  # (B, k)
        else:
            weights = F.softmax(full / alg_temp, dim=-1)
            where = generator.device if generator is not None else z.device
            index = torch.multinomial(weights.to(where), num_samples=k, generator=generator).to(z.device)
        proposal = torch.full_like(z, self.mask_id)
        proposal[mask_index] = x0
        rows = torch.arange(z.shape[0], device=z.device).unsqueeze(1).expand_as(index)
        z[rows, index] = proposal[rows, index]
        return SamplerOutput(prev_sample=z)

    def _step_rows(self, logits: Tensor, step_index: Tensor, z_t: Tensor,
                   generator: torch.Generator | None) -> SamplerOutput:
        """One step with a step index per row (B,) (module docstring)."""
        check_step_rows(step_index, self.num_steps, z_t.shape[0])
        i = step_index.to(z_t.device).long()  # (B,)
        grid = self.timesteps(z_t.device)
        t, s = grid[self.num_steps - i], grid[self.num_steps - i + 1]  # (B,) each
        last = i == 1  # (B,)
        ratio = torch.where(last, torch.zeros_like(t), s / t)  # (B,) all masks are decoded at the last step
        mask_index = z_t == self.mask_id  # (B, L)
        mask_logits = logits[mask_index]  # (m, V), row-major
        z = z_t.clone()
        if self.config.alg == "origin":
            p_transfer = (1 - ratio)[:, None].expand_as(z_t)[mask_index]  # (m,) each position's row probability
            return self._origin_step(z, mask_index, mask_logits, p_transfer, generator)
        confidence, x0 = self._draws(mask_logits, generator, margin_confidence=self.config.alg == "topk_margin",
                                     neg_entropy=self.config.alg == "entropy")
        masks = mask_index.sum(dim=1).to(t.dtype)  # (B,) float32, as the batched step counts
        k = torch.where(last, masks, masks * (1 - ratio)).long()  # (B,) floor
        full = torch.full_like(z, -torch.inf, dtype=logits.dtype)  # (B, L)
        full[mask_index] = confidence
        proposal = torch.full_like(z, self.mask_id)
        proposal[mask_index] = x0
        alg_temp = self.config.alg_temp
        same = bool((k == k[0]).all())
        rows = [(slice(None), int(k[0]))] if same else [(row, int(k[row])) for row in range(z.shape[0])]
        for row, count in rows:  # one batched choice when every row decodes as many (the batched step's draws)
            if count <= 0:
                continue
            scores = full[row] if same else full[row][None]  # (B or 1, L)
            if alg_temp is None or alg_temp == 0:
                _, index = torch.topk(scores, count)
            else:
                weights = F.softmax(scores / alg_temp, dim=-1)
                where = generator.device if generator is not None else z.device
                index = torch.multinomial(weights.to(where), num_samples=count, generator=generator).to(z.device)
            batch = (torch.arange(z.shape[0], device=z.device) if same else torch.tensor([row], device=z.device))
            batch = batch.unsqueeze(1).expand_as(index)
            z[batch, index] = proposal[batch, index]
        return SamplerOutput(prev_sample=z)
