"""The forward (noising) process q(z_t | x) of Eq. (fwd), absorbing or uniform, and z_t -> z_t' of Eq. (fwd_t_t').

Time-like arguments (alpha_t, alpha_t', sigma, t) may be a Python number, a 0-d tensor, a per-example
tensor of shape (B,) or (B, 1), or a per-token tensor (B, L); they are broadcast to (B, L) here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


PRIORS = ("mask", "uniform")

# Slack allowed when checking alpha_t' <= alpha_t: schedules evaluated in float32 at nearby
# times can invert by a few ulps.
_ALPHA_ORDER_TOL = 1e-6


def _column(value: Tensor | float, *, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
    """Coerce a time-like argument to a tensor that broadcasts against (B, L).

    Python numbers become 0-d tensors (float64 unless ``dtype`` says otherwise, so that no
    precision is lost before the caller's cast); (B,) becomes (B, 1); (B, 1) and (B, L) are kept.
    """
    if isinstance(value, Tensor):
        out = value.to(device=device) if device is not None else value
        if not out.is_floating_point():
            out = out.to(torch.get_default_dtype())
        if dtype is not None:
            out = out.to(dtype)
    else:
        out = torch.as_tensor(float(value), dtype=dtype or torch.float64, device=device)
    if out.dim() == 1:
        out = out.unsqueeze(-1)  # (B,) -> (B, 1)
    elif out.dim() > 2:
        raise ValueError(f"time-like argument must be a scalar, (B,), (B, 1) or (B, L); got shape {tuple(out.shape)}")
    return out


def _per_token(value: Tensor | float, like: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """Broadcast a time-like argument to the (B, L) shape of ``like`` (on its device)."""
    col = _column(value, dtype=dtype, device=like.device)
    B, L = like.shape[0], like.shape[1]
    if col.dim() == 2 and (col.shape[0] not in (1, B) or col.shape[1] not in (1, L)):
        raise ValueError(
            f"time-like argument of shape {tuple(col.shape)} does not broadcast to (B, L) = ({B}, {L}); "
            "use a scalar, (B,), (B, 1) or (B, L)"
        )
    return col.expand(B, L)


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str | None) -> Tensor:
    """U[0, 1) draws made on the generator's device, then moved: a CPU generator seeds CUDA work too."""
    where = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=where).to(device)


def _randint(
    high: int, shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str | None
) -> Tensor:
    """Uniform ids in [0, high), drawn like :func:`_rand` on the generator's device."""
    where = generator.device if generator is not None else device
    return torch.randint(0, high, shape, generator=generator, device=where).to(device)


def _check_tokens(x: Tensor, name: str = "x") -> None:
    if x.dim() != 2 or x.dtype != torch.long:
        raise ValueError(
            f"{name} must be a LongTensor of token ids (B, L); got dtype {x.dtype}, shape {tuple(x.shape)}"
        )


def mask_corrupt(
    x: Tensor, alpha_t: Tensor | float, mask_id: int, generator: torch.Generator | None = None
) -> Tensor:
    """Sample z_t ~ q(z_t | x) of Eq. (fwd) with the absorbing prior pi = m.

    Each token is kept with probability alpha_t and replaced by ``mask_id`` otherwise.

    Args:
        x: clean token ids (B, L).
        alpha_t: keep probability; scalar, (B,), (B, 1) or (B, L).
        mask_id: id of the mask token.
        generator: source of randomness.

    Returns:
        z_t: token ids (B, L).
    """
    _check_tokens(x)
    keep_prob = _per_token(alpha_t, x)  # (B, L)
    u = _rand(tuple(x.shape), generator, x.device)  # (B, L)
    return torch.where(u < keep_prob, x, torch.full_like(x, mask_id))


def uniform_corrupt(
    x: Tensor, alpha_t: Tensor | float, vocab_size: int, generator: torch.Generator | None = None
) -> Tensor:
    """Sample z_t ~ q(z_t | x) of Eq. (fwd) with the uniform prior pi = 1/K over ``vocab_size`` ids.

    Each token is kept with probability alpha_t and otherwise redrawn uniformly from
    {0, ..., vocab_size - 1}; the redraw may return the original id, so the total probability of
    keeping it is alpha_t + (1 - alpha_t) / K, as Eq. (fwd) requires.

    Args:
        x: clean token ids (B, L), all < vocab_size.
        alpha_t: scalar, (B,), (B, 1) or (B, L).
        vocab_size: number of ids K the noise is uniform over.
        generator: source of randomness.

    Returns:
        z_t: token ids (B, L).
    """
    _check_tokens(x)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    keep_prob = _per_token(alpha_t, x)  # (B, L)
    u = _rand(tuple(x.shape), generator, x.device)  # (B, L)
    return torch.where(u < keep_prob, x, _randint(vocab_size, tuple(x.shape), generator, x.device))


def further_mask(
    z_t: Tensor,
    alpha_t: Tensor | float,
    alpha_tp: Tensor | float,
    mask_id: int,
    generator: torch.Generator | None = None,
    *,
    uniform: Tensor | None = None,
) -> Tensor:
    """Sample z_t' ~ q(z_t' | z_t) of Eq. (fwd_t_t') for t' >= t (absorbing prior).

    An unmasked token of z_t survives with probability alpha_t' / alpha_t and is masked otherwise;
    masks of z_t stay masked. Composed with ``mask_corrupt(x, alpha_t)`` this gives
    z_t' ~ q(z_t' | x), the stale anchor state of TADM pretraining.

    Args:
        z_t: token ids (B, L).
        alpha_t: alpha at the current time t; scalar, (B,), (B, 1) or (B, L).
        alpha_tp: alpha at the anchor time t' >= t, so alpha_tp <= alpha_t.
        mask_id: id of the mask token.
        generator: source of randomness.
        uniform: (B, L) U[0, 1) draws to use instead of drawing from ``generator``. Passing the
            same draws for several anchor times couples them: the masks of z_t' then grow with t'
            (nested), which makes a curve over cache ages free of sampling noise between points.

    Returns:
        z_t': token ids (B, L) whose masks are a superset of those of z_t.

    Raises:
        ValueError: if alpha_tp exceeds alpha_t anywhere (t' < t).
    """
    _check_tokens(z_t, "z_t")
    a_t = _per_token(alpha_t, z_t, dtype=torch.float64)  # (B, L)
    a_tp = _per_token(alpha_tp, z_t, dtype=torch.float64)  # (B, L)
    excess = (a_tp - a_t).max() if a_t.numel() > 0 else torch.zeros(())
    if excess > _ALPHA_ORDER_TOL:
        raise ValueError(
            f"further_mask needs alpha_tp <= alpha_t (anchor time t' >= t); alpha_tp exceeds alpha_t by up to "
            f"{excess.item():.3g}"
        )
    # alpha_t = 0 means z_t is all noise already; any keep probability gives the same z_t'.
    keep_prob = torch.where(a_t > 0, a_tp / a_t.clamp_min(torch.finfo(torch.float64).tiny), 0.0).clamp(0.0, 1.0)
    if uniform is None:
        u = _rand(tuple(z_t.shape), generator, z_t.device)  # (B, L)
    else:
        if uniform.shape != z_t.shape:
            raise ValueError(f"uniform draws of shape {tuple(uniform.shape)} do not match z_t {tuple(z_t.shape)}")
        u = uniform.to(z_t.device)
    return torch.where(u < keep_prob, z_t, torch.full_like(z_t, mask_id))


def forward_marginal(
    x: Tensor, alpha_t: Tensor | float, prior: str, vocab_size: int, mask_id: int | None = None
) -> Tensor:
    """The probabilities alpha_t one_hot(x) + (1 - alpha_t) pi of Eq. (fwd).

    Args:
        x: clean token ids (B, L).
        alpha_t: scalar, (B,), (B, 1) or (B, L). The output takes its dtype when it is a floating
            tensor, and the default dtype otherwise.
        prior: "mask" (pi = one-hot at ``mask_id``) or "uniform" (pi = 1 / vocab_size).
        vocab_size: V, the last dimension of the output (includes the mask id for "mask").
        mask_id: required for prior "mask".

    Returns:
        (B, L, V) probabilities, each row summing to 1.
    """
    _check_tokens(x)
    if prior not in PRIORS:
        raise ValueError(f"unknown forward prior {prior!r}; valid: {', '.join(PRIORS)}")
    dtype = alpha_t.dtype if isinstance(alpha_t, Tensor) and alpha_t.is_floating_point() else torch.get_default_dtype()
    a = _per_token(alpha_t, x, dtype=dtype).unsqueeze(-1)  # (B, L, 1)
    if prior == "mask":
        if mask_id is None or not 0 <= mask_id < vocab_size:
            raise ValueError(f"prior 'mask' needs mask_id in [0, {vocab_size}), got {mask_id}")
        pi = F.one_hot(torch.tensor(mask_id, device=x.device), vocab_size).to(dtype)  # (V,)
    else:
        pi = torch.full((vocab_size,), 1.0 / vocab_size, dtype=dtype, device=x.device)  # (V,)
    x_onehot = F.one_hot(x, vocab_size).to(dtype)  # (B, L, V)
    return a * x_onehot + (1.0 - a) * pi
