"""Throughput: tokens/s bookkeeping, warm-up, and counted layer calls equal to Eq. (anchor-cache-compute)."""

from __future__ import annotations

import pytest
import torch

from tadm.eval.compute import layer_calls
from tadm.eval.throughput import measure_throughput, resolve_dtype
from tadm.sampling import generate, get_sampler
from tests.eval.test_evaluator import tiny_diffusion


@pytest.mark.parametrize("T,K", [(8, 1), (8, 2), (10, 3), (6, 8)])
def test_counted_layer_calls_match_the_analytic_count(T, K):
    model = tiny_diffusion("tadm")
    result = measure_throughput(model, get_sampler("remdm-cap", model.mask_token_id), seq_len=12, num_steps=T,
                                refresh_interval=K, num_generations=2, warmup=0)
    assert result.layer_calls["total"] == result.analytic_layer_calls == layer_calls(model.layer_split, T, K)
    # 2 anchor + 1 denoiser layers: anchor refreshed ceil(T / K) times
    assert result.layer_calls["anchor"] == 2 * -(-T // K) and result.layer_calls["denoiser"] == T


def test_tokens_per_second_counts_every_position_of_timed_generations_only():
    model = tiny_diffusion("mdlm")
    calls = []

    def fake_generate(*args, **kwargs):
        calls.append(kwargs["generator"].initial_seed())
        return generate(*args, **kwargs)

    result = measure_throughput(model, get_sampler("mdlm", model.mask_token_id), seq_len=16, num_steps=4,
                                num_generations=3, batch_size=2, warmup=2, seed=10, generate_fn=fake_generate)
    assert calls == [10, 11, 12, 13, 14]  # 2 warm-up + 3 timed, seeds seed + g
    assert len(result.seconds) == 3
    assert result.tokens_per_second == pytest.approx(3 * 2 * 16 / sum(result.seconds))
    assert result.as_dict()["analytic_layer_calls"] == 4 * 3  # MDLM: 3 layers every step


def test_bfloat16_autocast_runs_and_bad_settings_fail():
    model = tiny_diffusion("tadm")
    sampler = get_sampler("mdlm", model.mask_token_id)
    result = measure_throughput(model, sampler, seq_len=8, num_steps=4, refresh_interval=2, num_generations=1,
                                warmup=0, dtype="bfloat16")
    assert result.dtype == "bfloat16" and result.tokens_per_second > 0
    assert resolve_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; valid: float32, bfloat16, float16"):
        measure_throughput(model, sampler, seq_len=8, num_steps=4, dtype="fp8")
    with pytest.raises(ValueError, match="num_generations"):
        measure_throughput(model, sampler, seq_len=8, num_steps=4, num_generations=0)
