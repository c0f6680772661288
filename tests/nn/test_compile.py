"""``compile_stacks``: the compiled fixed-shape stacks give the eager model's tokens; weights unchanged.

The ``aot_eager`` backend traces and partitions the graphs as ``torch.compile`` does but runs the
ATen ops eagerly, so its numbers equal the eager model's bit for bit and the test takes seconds;
the default ``inductor`` backend (about 40 s to compile the tiny model on two cores) is exercised
by ``benchmarks/bench_gpu.py --compile``.
"""

from __future__ import annotations

import pytest
import torch

from tadm.nn import NaiveReuse, mdlm_tiny, tadm_tiny
from tadm.sampling import generate, get_sampler


def _randomized(make):
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _tokens(model, sampler="remdm-loop", K=2):
    return generate(model, get_sampler(sampler, model.mask_token_id), batch_size=2, seq_len=16, num_steps=8,
                    refresh_interval=K, generator=torch.Generator().manual_seed(1)).tokens


@pytest.mark.slow
@pytest.mark.parametrize("make", [tadm_tiny, mdlm_tiny, lambda: NaiveReuse(tadm_tiny())])
def test_compiled_stacks_sample_the_eager_tokens(make):
    torch._dynamo.reset()
    model = _randomized(make)
    eager = _tokens(model)
    keys = list(model.state_dict())
    compiled = model.compile_stacks(backend="aot_eager")
    assert compiled is model and list(model.state_dict()) == keys  # checkpoints load either way
    inner = model.model if isinstance(model, NaiveReuse) else model
    stacks = [getattr(inner, n) for n in ("anchor", "fusion", "denoiser", "blocks") if hasattr(inner, n)]
    assert stacks and all(m._compiled_call_impl is not None for m in stacks)
    assert inner.head._compiled_call_impl is None  # the head sees a varying number of rows: eager
    assert torch.equal(_tokens(model), eager)
