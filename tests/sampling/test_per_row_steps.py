"""Per-row step indices (post-training rollouts) in the LLaDA, Dream and MDLM samplers.

With the same step index in every row the per-row path must commit exactly the batched step's
tokens (same draws); with different indices each row follows its own schedule.
"""

import pytest
import torch

from tadm.sampling import DreamSampler, LLaDASampler
from tadm.sampling.mdlm import MDLMSampler
from tadm.sampling.remdm import ReMDMSampler

MASK, V, B, P, G = 7, 12, 3, 2, 9


def _canvas(seed=0):
    prompt = torch.randint(0, MASK, (B, P), generator=torch.Generator().manual_seed(seed))
    return torch.cat([prompt, torch.full((B, G), MASK)], dim=1)  # (B, P + G)


def _logits(seed, shape):
    logits = torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed)) * 2.0
    logits[..., MASK] = -1e4  # a trained model never predicts the mask itself
    return logits


def _run(sampler, T, per_row, seed=0, consumes_log_probs=False):
    """A trajectory driven by random logits, stepped with int or (B,) tensor step indices."""
    sampler.set_timesteps(T)
    z, g = _canvas(), torch.Generator().manual_seed(seed)
    for i in range(T, 0, -1):
        logits = _logits(100 + i, z.shape)
        out = logits.log_softmax(-1) if consumes_log_probs else logits
        if consumes_log_probs:
            out[..., MASK] = -1e6
        step = torch.full((B,), i) if per_row else i
        z = sampler.step(out, step, z, g).prev_sample
    return z


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("T", [3, 4, 9])
def test_llada_per_row_equals_the_batched_step_in_one_block(remasking, temperature, T):
    batched = _run(LLaDASampler(MASK, None, remasking, temperature), T, per_row=False)
    rows = _run(LLaDASampler(MASK, None, remasking, temperature), T, per_row=True)
    assert torch.equal(batched, rows)
    assert not (rows == MASK).any()


def test_llada_rows_commit_ceil_of_masks_over_steps_left():
    sampler = LLaDASampler(MASK)
    sampler.set_timesteps(8)
    z = _canvas()
    z[1, P:P + 2] = 3  # row 1 has 7 masks, the others 9
    out = sampler.step(_logits(0, z.shape), torch.tensor([8, 3, 1]), z).prev_sample
    decoded = ((z == MASK) & (out != MASK)).sum(dim=1)
    assert decoded.tolist() == [2, 3, 9]  # ceil(9 / 8), ceil(7 / 3), ceil(9 / 1)
    assert torch.equal(out[z != MASK], z[z != MASK])


def test_llada_per_row_steps_need_one_block():
    sampler = LLaDASampler(MASK, block_length=3)
    sampler.set_timesteps(3)
    with pytest.raises(ValueError, match="build the LLaDA sampler with block_length=None"):
        sampler.step(_logits(0, (B, P + G)), torch.full((B,), 3), _canvas())


DREAM_CASES = [(alg, temperature, alg_temp) for alg in ("origin", "maskgit_plus", "topk_margin", "entropy")
               for temperature, alg_temp in ((0.0, None), (0.7, None), (0.7, 0.5)) if alg != "origin" or not alg_temp]


@pytest.mark.parametrize("alg, temperature, alg_temp", DREAM_CASES)
def test_dream_per_row_equals_the_batched_step(alg, temperature, alg_temp):
    make = lambda: DreamSampler(MASK, alg, temperature, alg_temp=alg_temp)  # noqa: E731
    batched, rows = _run(make(), 5, per_row=False), _run(make(), 5, per_row=True)
    assert torch.equal(batched, rows)
    assert not (rows == MASK).any()


@pytest.mark.parametrize("alg", ["origin", "entropy"])
def test_dream_rows_follow_their_own_grid(alg):
    sampler = DreamSampler(MASK, alg)
    sampler.set_timesteps(4)
    z = _canvas()
    out = sampler.step(_logits(0, z.shape), torch.tensor([4, 1, 1]), z, torch.Generator().manual_seed(0)).prev_sample
    assert not (out[1:] == MASK).any()  # i = 1 decodes every mask
    if alg == "entropy":  # k = floor(9 (1 - t_1 / t_0)) with t = linspace(1, 1e-3, 5)
        grid = torch.linspace(1, 1e-3, 5)
        assert int(((z[0] == MASK) & (out[0] != MASK)).sum()) == int(torch.tensor(9.0) * (1 - grid[1] / grid[0]))


@pytest.mark.parametrize("time_grid", ["paper", "released"])
def test_mdlm_per_row_equals_the_batched_step(time_grid):
    batched = _run(MDLMSampler(MASK, time_grid=time_grid), 6, per_row=False, consumes_log_probs=True)
    rows = _run(MDLMSampler(MASK, time_grid=time_grid), 6, per_row=True, consumes_log_probs=True)
    assert torch.equal(batched, rows)


def test_mdlm_rows_move_with_their_own_probability():
    sampler = MDLMSampler(MASK)
    sampler.set_timesteps(4)
    moves = sampler.plan_moves(torch.tensor([4, 1, 4]), _canvas(), torch.Generator().manual_seed(0))
    decoded = torch.bincount(moves.rows[:, 0], minlength=B)
    assert int(decoded[1]) == G  # at i = 1 (alpha_0 = 1) every mask is decoded
    with pytest.raises(ValueError, match=r"step indices must be in 1..4"):
        sampler.plan_moves(torch.tensor([5, 1, 1]), _canvas())


def test_samplers_without_per_row_steps_say_so():
    sampler = ReMDMSampler(MASK, strategy="cap")
    sampler.set_timesteps(4)
    with pytest.raises(ValueError, match="ReMDMSampler runs every row at the same step"):
        sampler.plan_moves(torch.full((B,), 4), _canvas())
