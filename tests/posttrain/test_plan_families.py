"""tadm posttrain plan for LLaDA-8B and Dream-7B: analytic counts from their config.json, memory of the sampler step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tadm.cli import main
from tadm.posttrain.backbones.dream import dream_7b_config, dream_shape
from tadm.posttrain.backbones.llada import llada_8b_config, llada_shape
from tadm.posttrain.config import load_posttrain_config
from tadm.posttrain.model import FusionSpec
from tadm.posttrain.plan import SEQUENCE_FAMILIES, plan_posttrain, resolve_sequence_config
from tests.standins.dream import FIXTURE as DREAM_FIXTURE
from tests.standins.dream import load_dream
from tests.standins.llada import FIXTURE as LLADA_FIXTURE
from tests.standins.llada import load_llada

LLADA_ARGS = ["base.backbone=llada", "base.path=GSAI-ML/LLaDA-8B-Instruct", "split.anchor_layers=22"]
DREAM_ARGS = ["base.backbone=dream", "base.path=Dream-org/Dream-v0-Instruct-7B", "split.anchor_layers=18"]


def plan(args, *more):
    return plan_posttrain(load_posttrain_config("posttrain-diffusiongemma", [*args, *more]))


@pytest.mark.parametrize("shape, load, fixture", [(llada_shape, load_llada, LLADA_FIXTURE),
                                                  (dream_shape, load_dream, DREAM_FIXTURE)])
def test_the_analytic_count_equals_the_stand_ins_parameters(shape, load, fixture):
    config = json.loads((fixture / "config.json").read_text())
    assert shape(config).parameters() == sum(p.numel() for p in load().parameters())


def test_the_real_sizes():
    # LLaDA-8B: 8.0B parameters; Dream-7B: Qwen2.5-7B's 7.62B (7,615,616,512)
    assert llada_shape(llada_8b_config()).parameters() == 8_015_581_184
    assert dream_shape(dream_7b_config()).parameters() == 7_615_616_512


@pytest.mark.parametrize("args, total, split", [(LLADA_ARGS, 8_015_581_184, (2, 22, 8)),
                                                (DREAM_ARGS, 7_615_616_512, (2, 18, 8))])
def test_the_plan_counts_the_fusion_at_the_papers_rank(args, total, split):
    result = plan(args, "data.max_prompt_tokens=512", "data.max_response_tokens=256")
    d = 4096 if "llada" in args[0] else 3584
    with torch.device("meta"):
        fusion = sum(p.numel() for p in FusionSpec(rank=256, num_heads=4).build(d).parameters())
    assert result.backbone_parameters == total and result.fusion_parameters == fusion
    assert result.split == split
    assert [e.what for e in result.estimates] == ["training step, micro-batch 1, sequence 768",
                                                  "inference, batch 1, sequence 768", "inference, batch 8, sequence 768"]
    weights = result.estimates[0].items["backbone weights"]
    assert weights == total * 2  # bf16
    infer1, infer8 = result.estimates[1].total - weights, result.estimates[2].total - weights
    assert 7.5 < infer8 / infer1 < 8.1  # everything but the weights scales with the batch


def test_a_split_that_does_not_fit_is_one_line():
    with pytest.raises(ValueError, match="does not cover the backbone's 32 layers"):
        plan(["base.backbone=llada", "base.path=GSAI-ML/LLaDA-8B-Instruct"])


def test_a_local_config_json_is_read_without_code(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**dream_7b_config(), "num_hidden_layers": 10}))
    config, source = resolve_sequence_config(str(tmp_path), "dream")
    assert config["num_hidden_layers"] == 10 and source.endswith("config.json")
    with pytest.raises(ValueError, match="is a 'Dream' checkpoint; base.backbone llada plans 'llada' ones"):
        resolve_sequence_config(str(tmp_path), "llada")
    with pytest.raises(FileNotFoundError, match="tadm records the architecture of GSAI-ML/LLaDA-8B-Base"):
        resolve_sequence_config("someone/unknown", "llada")


def test_the_plan_command_for_llada(capsys):
    assert main(["posttrain", "plan", "posttrain-diffusiongemma", *LLADA_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backbone_parameters"] == 8_015_581_184 and out["split"] == {"shared": 2, "anchor": 22, "denoiser": 8}


MEASURE = textwrap.dedent("""
    import sys, torch
    from tadm.sampling import get_sampler
    name, temperature = sys.argv[1], float(sys.argv[2])
    B, L, V = 2, 256, 20000
    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    logits = torch.randn(B, L, V)
    z = torch.full((B, L), 3)
    z[:, :64] = 5
    options = {"top_p": 0.95} if name.startswith("dream") else {}
    sampler = get_sampler(name, mask_id=3, temperature=temperature, **options)
    sampler.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    sampler.step(logits, 4, z, g)
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current size
    base = rss("VmRSS")
    sampler.step(logits, 4, z, g)
    print((rss("VmHWM") - base) / (B * L * V) + 4)  # the logits themselves: 4 bytes per entry
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak-RSS counters")
@pytest.mark.parametrize("family, sampler", [("llada", "llada"), ("dream", "dream-entropy")])
def test_the_sampler_bytes_are_within_25_percent_of_a_measured_peak(family, sampler):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", MEASURE, sampler, "0.8"], capture_output=True, text=True, env=env,
                         check=True)
    measured = float(run.stdout.strip())
    assert abs(SEQUENCE_FAMILIES[family].sampler_bytes - measured) <= 0.25 * measured  # measured 44.0 and 26.5
