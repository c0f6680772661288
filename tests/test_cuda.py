"""CUDA paths (``pytest -m cuda`` on a GPU machine; skipped without one): compiled = eager tokens, bf16 weights,
the decoded-rows path on CUDA, and no host-device synchronisation in the loop beyond the one allowed per step."""

from __future__ import annotations

import warnings

import pytest
import torch

from tadm.nn import mdlm_tiny, tadm_tiny
from tadm.sampling import generate, get_sampler

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"


def _generate(model, *, K=1, T=16, L=32, full_output=False, seed=0, B=2):
    sampler = get_sampler("remdm-loop", model.mask_token_id)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return generate(model, sampler, batch_size=B, seq_len=L, num_steps=T, refresh_interval=K, generator=g,
                    device=DEVICE, full_output=full_output).tokens


@pytest.mark.parametrize("build", [tadm_tiny, mdlm_tiny], ids=["tadm", "mdlm"])
def test_decoded_rows_equal_the_full_output_path_on_cuda(build):
    torch.manual_seed(0)
    model = build().to(DEVICE).eval()
    for K in ((1, 2, 4) if model.layer_split.anchor else (1,)):
        assert torch.equal(_generate(model, K=K), _generate(model, K=K, full_output=True))


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_stacks_sample_the_eager_tokens_on_cuda(mode):
    torch.manual_seed(0)
    eager = tadm_tiny().to(DEVICE).eval()
    compiled = tadm_tiny().to(DEVICE).eval()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_stacks(mode=mode)
    for K in (1, 4):
        assert torch.equal(_generate(eager, K=K), _generate(compiled, K=K))


def test_bf16_weights_and_autocast_run_and_agree_mostly():
    torch.manual_seed(0)
    fp32 = tadm_tiny().to(DEVICE).eval()
    bf16 = tadm_tiny().to(DEVICE).eval()
    bf16.load_state_dict(fp32.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        autocast_tokens = _generate(fp32, K=2)
    weight_tokens = _generate(bf16, K=2)
    reference = _generate(fp32, K=2)
    for tokens in (autocast_tokens, weight_tokens):
        assert tokens.shape == reference.shape and int(tokens.max()) < fp32.vocab_size
        assert (tokens == reference).float().mean() > 0.5  # rounding flips some draws, not most
    assert torch.equal(weight_tokens, _generate(bf16, K=2))  # bf16 is deterministic run to run


def test_one_synchronisation_per_step_at_most():
    """Reading the number of decoded rows (``plan_moves``) is the one host-device sync a step may make."""
    torch.manual_seed(0)
    model = tadm_tiny().to(DEVICE).eval()
    _generate(model, K=4, T=32)  # warm-up: allocations, kernels
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _generate(model, K=4, T=32)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    assert syncs <= 32 + 4, syncs  # one per step, plus a few at the start and the end
