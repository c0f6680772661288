import math

import pytest
import torch

from tadm.eval.compute import layer_calls
from tadm.sampling import MDLMSampler, ReMDMSampler, generate, get_sampler, is_refresh_step
from tadm.protocol import LayerSplit

from .oracle import OracleDenoiser

V = 9
MASK = V - 1


def _oracle(B=2, L=6, seed=0, **kw):
    target = torch.randint(0, V - 1, (B, L), generator=torch.Generator().manual_seed(seed))
    return OracleDenoiser(target, V, **kw), target


@pytest.mark.slow
@pytest.mark.parametrize("T,K", [(128, 2), (256, 2), (512, 2), (1024, 8), (2048, 4), (4096, 4), (10, 3), (7, 1)])
def test_counter_matches_table2_formula_and_algorithm1(T, K):
    split = LayerSplit(0, 12, 6)
    model, _ = _oracle(B=1, L=2, split=split)
    out = generate(model, MDLMSampler(MASK), batch_size=1, seq_len=2, num_steps=T, refresh_interval=K)
    assert out.layer_calls.total == layer_calls(split, T, K)
    assert out.layer_calls.anchor_refreshes == math.ceil(T / K)
    assert out.layer_calls.denoiser_calls == T
    # Algorithm 1: refreshes exactly at the steps with (T - i) mod K == 0, starting at i = T
    assert out.refresh_steps == [i for i in range(T, 0, -1) if (T - i) % K == 0]
    assert model.calls[:3] == ["encode", "anchor", "predict"]
    if K > 1:
        assert model.calls[3:5] == ["encode", "predict"]


def test_counter_counts_shared_layers_every_step():
    model, _ = _oracle(split=LayerSplit(2, 20, 8))
    out = generate(model, MDLMSampler(MASK), batch_size=2, seq_len=6, num_steps=48, refresh_interval=3)
    c = out.layer_calls
    assert (c.shared, c.anchor, c.denoiser) == (2 * 48, 20 * 16, 8 * 48)


@pytest.mark.slow
def test_oracle_generation_recovers_target_with_mdlm_and_remdm():
    model, target = _oracle()
    for sampler in [MDLMSampler(MASK), ReMDMSampler(MASK, "cap", eta=0.04), get_sampler("remdm-loop", MASK)]:
        out = generate(model, sampler, batch_size=2, seq_len=6, num_steps=32, refresh_interval=4,
                       generator=torch.Generator().manual_seed(0))
        assert torch.equal(out.tokens, target)


@pytest.mark.slow
def test_same_seed_same_tokens_and_different_seed_differs():
    model, _ = _oracle(B=3, L=16, sharpness=1.0)
    run = lambda seed: generate(model, get_sampler("remdm-cap", MASK), batch_size=3, seq_len=16, num_steps=16,
                                refresh_interval=2, generator=torch.Generator().manual_seed(seed)).tokens
    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


def test_skip_unchanged_reuses_predictions_and_keeps_output():
    model, target = _oracle(B=1, L=4)
    base = generate(model, MDLMSampler(MASK), batch_size=1, seq_len=4, num_steps=64, refresh_interval=2,
                    generator=torch.Generator().manual_seed(1))
    fast = generate(model, MDLMSampler(MASK), batch_size=1, seq_len=4, num_steps=64, refresh_interval=2,
                    generator=torch.Generator().manual_seed(1), skip_unchanged=True)
    assert torch.equal(base.tokens, fast.tokens)
    # 4 tokens over 64 steps: most steps leave the canvas unchanged and are skipped
    assert fast.layer_calls.skipped_steps > 32
    assert fast.layer_calls.denoiser_calls + fast.layer_calls.skipped_steps == 64
    assert fast.layer_calls.total < base.layer_calls.total


@pytest.mark.parametrize(
    "kwargs,match",
    [({"refresh_interval": 0}, "refresh interval"), ({"refresh_interval": 1.5}, "refresh interval"),
     ({"num_steps": 0}, "number of steps"), ({"seq_len": 0}, "sequence length"),
     ({"seq_len": 100, "max_seq_len": 64}, "exceeds"), ({"batch_size": 0}, "batch size")],
)
def test_bad_generation_inputs(kwargs, match):
    model, _ = _oracle()
    args = dict(batch_size=2, seq_len=6, num_steps=8, refresh_interval=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(model, MDLMSampler(MASK), **args)


def test_is_refresh_step():
    assert [i for i in range(8, 0, -1) if is_refresh_step(i, 8, 4)] == [8, 4]


class _FrozenSampler(MDLMSampler):
    """Never unmasks: every position is still masked after the last step (forces the final call)."""

    def step(self, log_probs, step_index, z_t, generator=None):
        from tadm.sampling import SamplerOutput

        return SamplerOutput(prev_sample=z_t)


@pytest.mark.parametrize("K,refresh_at_end", [(1, True), (3, True), (4, False)])
def test_released_grid_final_argmax_is_one_more_counted_step_of_algorithm_1(K, refresh_at_end):
    split = LayerSplit(0, 12, 6)
    model, target = _oracle(B=2, L=6, split=split)
    sampler = _FrozenSampler(MASK, time_grid="released")
    out = generate(model, sampler, batch_size=2, seq_len=6, num_steps=6, refresh_interval=K)
    assert torch.equal(out.tokens, target)  # the oracle's argmax fills every mask
    # one more encode + predict at step 0, and an anchor refresh when (T - 0) mod K == 0
    assert out.layer_calls.denoiser_calls == 7
    assert out.layer_calls.anchor_refreshes == math.ceil(6 / K) + int(refresh_at_end)
    assert (out.refresh_steps[-1] == 0) == refresh_at_end
    paper = generate(model, _FrozenSampler(MASK), batch_size=2, seq_len=6, num_steps=6, refresh_interval=K)
    assert paper.layer_calls.total == layer_calls(split, 6, K)  # the paper grid: no extra call
