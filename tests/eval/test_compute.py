import pytest

from tadm.eval.compute import compute_row, layer_calls
from tadm.protocol import LayerSplit

MDLM = LayerSplit(0, 0, 12)
ADLM = LayerSplit(0, 12, 6)
TADM = LayerSplit(0, 12, 6)

# Paper Table 2, "Compute" column: (T, K used by TADM, MDLM calls, ADLM calls, TADM calls, TADM ratio to MDLM)
TABLE2 = [
    (128, 2, 1536, 2304, 1536, 1.00),
    (256, 2, 3072, 4608, 3072, 1.00),
    (512, 2, 6144, 9216, 6144, 1.00),
    (1024, 8, 12288, 18432, 7680, 0.62),
    (2048, 4, 24576, 36864, 18432, 0.75),
    (4096, 4, 49152, 73728, 36864, 0.75),
]


@pytest.mark.parametrize("T,K,mdlm,adlm,tadm,ratio", TABLE2)
def test_analytic_compute_reproduces_table2(T, K, mdlm, adlm, tadm, ratio):
    assert layer_calls(MDLM, T) == mdlm
    assert layer_calls(ADLM, T, 1) == adlm  # ADLM refreshes its anchor at every step
    assert layer_calls(TADM, T, K) == tadm
    row = compute_row("tadm", TADM, T, K, baseline_layers=12)
    assert row.baseline_layer_calls == mdlm
    assert round(row.relative, 2) == ratio
    assert round(compute_row("adlm", ADLM, T, 1, baseline_layers=12).relative, 2) == 1.50


def test_ceiling_when_K_does_not_divide_T():
    # refresh steps are i = 10, 7, 4, 1 for T = 10, K = 3 -> ceil(10/3) = 4 anchor evaluations
    assert layer_calls(LayerSplit(2, 20, 8), 10, 3) == 10 * (2 + 8) + 4 * 20


@pytest.mark.parametrize(
    "args,match",
    [((TADM, 0, 1), "steps"), ((TADM, 8, 0), "refresh"), ((LayerSplit(0, 0, 0), 8, 1), "at least one"),
     ((LayerSplit(-1, 2, 2), 8, 1), "shared")],
)
def test_bad_compute_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        layer_calls(*args)


def test_generation_flops_by_hand():
    """d = 32, r = 4, V = 65, L = 8, B = 2, T = 4, K = 2 on tadm-tiny (2 anchor + 1 denoiser blocks)."""
    from tadm.eval.compute import generation_flops
    from tadm.nn import mdlm_tiny, tadm_tiny

    model = tadm_tiny()
    d, V, L, B, T = 32, 65, 8, 2, 4
    assert (model.config.hidden_size, model.config.mlp_ratio, model.config.vocab_size) == (d, 4, V)
    flops = generation_flops(model, batch_size=B, seq_len=L, num_steps=T, refresh_interval=2)
    per_block = 2 * B * L * (12 * d * d + 2 * L * d)
    calls = T * 1 + 2 * 2  # denoiser every step, anchor at 2 of the 4 steps
    assert flops.layers == per_block * calls
    assert flops.fusion == 2 * B * L * 14 * d * d * T
    assert flops.head == 2 * B * L * T * d * V
    assert flops.total == flops.layers + flops.fusion + flops.head
    assert generation_flops(model, batch_size=B, seq_len=L, num_steps=T, head_rows=5).head == 2 * 5 * d * V
    assert generation_flops(mdlm_tiny(), batch_size=B, seq_len=L, num_steps=T).fusion == 0
