"""Throughput: tokens/s bookkeeping, warm-up, and counted layer calls equal to Eq. (anchor-cache-compute)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tadm.eval.throughput as throughput_mod
from tadm.eval.compute import layer_calls
from tadm.eval.pipeline import throughput_note
from tadm.eval.throughput import measure_throughput, resolve_dtype
from tadm.sampling import generate, get_sampler
from tests.eval.test_evaluator import tiny_diffusion


@pytest.mark.slow
@pytest.mark.parametrize("T,K", [(8, 1), (8, 2), (10, 3), (6, 8)])
def test_counted_layer_calls_match_the_analytic_count(T, K):
    model = tiny_diffusion("tadm")
    result = measure_throughput(model, get_sampler("remdm-cap", model.mask_token_id), seq_len=12, num_steps=T,
                                refresh_interval=K, num_generations=2, warmup=0)
    assert result.layer_calls["total"] == result.analytic_layer_calls == layer_calls(model.layer_split, T, K)
    # 2 anchor + 1 denoiser layers: anchor refreshed ceil(T / K) times
    assert result.layer_calls["anchor"] == 2 * -(-T // K) and result.layer_calls["denoiser"] == T


@pytest.mark.slow
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
    assert result.tokens_per_second == pytest.approx(2 * 16 / sorted(result.seconds)[1])  # the median of 3
    assert result.tokens_per_second_min <= result.tokens_per_second <= result.tokens_per_second_max
    assert result.as_dict()["analytic_layer_calls"] == 4 * 3  # MDLM: 3 layers every step


@pytest.mark.slow
def test_bfloat16_autocast_runs_and_bad_settings_fail():
    model = tiny_diffusion("tadm")
    sampler = get_sampler("mdlm", model.mask_token_id)
    result = measure_throughput(model, sampler, seq_len=8, num_steps=4, refresh_interval=2, num_generations=1,
                                warmup=0, dtype="bfloat16")
    assert result.dtype == "bfloat16" and result.tokens_per_second > 0
    assert resolve_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; valid: auto, fp32, bf16, fp16"):
        measure_throughput(model, sampler, seq_len=8, num_steps=4, dtype="fp8")
    with pytest.raises(ValueError, match="num_generations"):
        measure_throughput(model, sampler, seq_len=8, num_steps=4, num_generations=0)


@pytest.mark.slow
def test_interleaved_timing_shuffles_every_round_and_reports_median_min_max():
    from tadm.eval.throughput import TimingCell, interleaved_throughput

    tadm, mdlm = tiny_diffusion("tadm"), tiny_diffusion("mdlm")
    order: list[tuple[str, int, int]] = []

    def recording_generate(model, sampler, **kwargs):
        order.append(("tadm" if model is tadm else "mdlm", kwargs["policy"].interval, kwargs["generator"].initial_seed()))
        return generate(model, sampler, **kwargs)

    cells = [TimingCell(key=(name, K), model=m, make_sampler=lambda m=m: get_sampler("mdlm", m.mask_token_id),
                        seq_len=8, num_steps=4, policy=K)
             for name, m in (("tadm", tadm), ("mdlm", mdlm)) for K in (1, 2)]
    results = interleaved_throughput(cells, num_generations=5, warmup=1, seed=3, order_seed=0,
                                     generate_fn=recording_generate)
    assert len(order) == 6 * 4
    rounds = [order[r * 4:(r + 1) * 4] for r in range(6)]
    assert all({(n, K) for n, K, _ in rnd} == {("tadm", 1), ("tadm", 2), ("mdlm", 1), ("mdlm", 2)} for rnd in rounds)
    assert len({tuple((n, K) for n, K, _ in rnd) for rnd in rounds}) > 1  # the order changes between rounds
    assert all(seed == 3 + r for r, rnd in enumerate(rounds) for _, _, seed in rnd)
    for key, result in results.items():
        assert len(result.seconds) == 5
        assert result.tokens_per_second == pytest.approx(8 / sorted(result.seconds)[2])
        assert result.tokens_per_second_min <= result.tokens_per_second <= result.tokens_per_second_max
        assert result.layer_calls["total"] == result.analytic_layer_calls
    with pytest.raises(ValueError, match="num_generations must be >= 5"):
        interleaved_throughput(cells, num_generations=2)


def test_tokens_per_second_is_tokens_over_the_median_time_and_the_note_says_so(monkeypatch):
    """With 4 timed generations of 0.05, 0.10, 0.30 and 0.40 s (after an untimed warm-up), tokens/s is
    16 / median(seconds) = 16 / 0.2 = 80, not the median of the per-generation tokens/s (104.17); the report's
    note names that quantity (the paper only divides tokens by end-to-end generation time)."""
    # the warm-up reads the clock once (it is not timed); each timed generation reads it at its start and end
    readings = iter([0.0, 9.0, 9.05, 10.0, 10.10, 11.0, 11.30, 12.0, 12.40])
    monkeypatch.setattr(throughput_mod, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    model = tiny_diffusion("mdlm")
    result = measure_throughput(model, get_sampler("mdlm", model.mask_token_id), seq_len=16, num_steps=2,
                                num_generations=4, warmup=1)
    assert result.seconds == pytest.approx([0.05, 0.10, 0.30, 0.40])  # the warm-up is not timed
    assert result.tokens_per_second == pytest.approx(80.0)
    assert (result.tokens_per_second_min, result.tokens_per_second_max) == pytest.approx((40.0, 320.0))
    row = {"tokens_per_second": 80.0, "throughput_generations": 4, "throughput_batch_size": 1}
    note = throughput_note([row], warmup=1)
    assert note == ("Throughput: tokens/s = generated tokens / median generation time [slowest-fastest generation] "
                    "of 4 timed generations of batch 1 after 1 warm-up, all cells interleaved in shuffled rounds")
    assert "median tokens/s" not in note
