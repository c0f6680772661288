"""Every caller of Algorithm 1's loop, and the AR sampler, give the tokens recorded in ``tests/golden/loop_tokens.json``.

The file was written by the implementation before the loop was unified (one inner loop for
unconditional generation, block-wise generation and rollouts); the refresh policies, prompted
generation of tadm's own models (``prefix/``) and the AR sampler (``ar/``) were added before
prompts came to ``generate``. Any change of a sampled token in any caller fails here. Regenerate deliberately with ``TADM_WRITE_GOLDEN=1 pytest tests/sampling/test_loop_golden.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tadm.diffusion import get_schedule
from tadm.nn import adlm_tiny, mdlm_tiny, tadm_tiny
from tadm.posttrain import AnchoredBackbone, DiffusionGemmaBackbone, FusionSpec, MDLMBackbone, SplitSpec
from tadm.posttrain.rollout import on_policy_rollout
from tadm.nn import ar_tiny
from tadm.sampling import AdaptiveRefresh, FixedRefresh, ScheduleRefresh, generate, get_sampler
from tadm.sampling.autoregressive import generate_autoregressive
from tadm.sampling.entropy_bound import EntropyBoundSampler
from tadm.tasks.generation import GenerationSettings, PrefixGenerator

from tests.posttrain.conftest import _one_thread  # noqa: F401  (autouse: tiny tensors run fastest on one thread)

GOLDEN = Path(__file__).parents[1] / "golden" / "loop_tokens.json"


def _randomize(module, seed=1, std=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(std * torch.randn(p.shape, generator=g))
    return module


def _unconditional_cases():
    torch.manual_seed(0)
    nets = {
        "tadm": _randomize(tadm_tiny()).eval(),
        "tadm-tc": _randomize(tadm_tiny(time_conditioning=True)).eval(),
        "adlm": _randomize(adlm_tiny()).eval(),
        "mdlm": _randomize(mdlm_tiny()).eval(),
    }
    split_mdlm = AnchoredBackbone(MDLMBackbone(nets["mdlm"]), SplitSpec(1, 1), FusionSpec(rank=8, num_heads=2))
    _randomize(split_mdlm.fusion, seed=4, std=0.2)
    nets["split-mdlm"] = split_mdlm
    cases = []
    for net in ("tadm", "adlm", "mdlm"):
        for sampler in ("mdlm", "remdm-cap", "remdm-loop", "remdm-rescale", "remdm-conf"):
            for K in (1, 2, 4):
                cases.append((net, sampler, K, {}))
    for K in (1, 3):
        cases.append(("tadm", "remdm-loop", K, {"top_p": 0.9}))
        cases.append(("tadm", "mdlm", K, {"top_p": 0.8, "nucleus": "standard"}))
        cases.append(("tadm", "remdm-cap", K, {"time_grid": "released", "top_p": 0.9}))
        cases.append(("tadm-tc", "remdm-cap", K, {"time_conditioned": True}))
        cases.append(("tadm", "mdlm", K, {"skip_unchanged": True}))
        cases.append(("split-mdlm", "mdlm", K, {}))
    cases.append(("tadm", "mdlm", 4, {"time_grid": "released", "skip_unchanged": True}))
    for net in ("tadm", "adlm"):  # refresh policies other than a fixed K
        cases.append((net, "remdm-cap", "adaptive", {}))
        cases.append((net, "mdlm", "schedule", {}))
    return nets, cases


POLICIES = {"adaptive": lambda: AdaptiveRefresh(tau=0.2, max_interval=4), "schedule": lambda: ScheduleRefresh([10, 8, 4])}


def _run_unconditional():
    nets, cases = _unconditional_cases()
    out = {}
    for net, sampler_name, K, options in cases:
        options = dict(options)
        loop = {k: options.pop(k) for k in ("time_conditioned", "skip_unchanged") if k in options}
        model = nets[net]
        sampler = get_sampler(sampler_name, model.mask_token_id, **options)
        refresh = {"policy": POLICIES[K]()} if K in POLICIES else {"refresh_interval": K}
        result = generate(model, sampler, batch_size=2, seq_len=12, num_steps=10,
                          generator=torch.Generator().manual_seed(11), **refresh, **loop)
        key = f"generate/{net}/{sampler_name}/{K if K in POLICIES else f'K{K}'}/" + ",".join(f"{k}={v}" for k, v in sorted({**options, **loop}.items()))
        out[key] = {"tokens": result.tokens.tolist(), "refresh_steps": result.refresh_steps,
                    "layer_calls": result.layer_calls.as_dict()}
    return out


def _gemma_model(mode="paired"):
    from transformers import DiffusionGemmaForBlockDiffusion

    from tadm.posttrain.backbone import tiny_diffusion_gemma_config

    torch.manual_seed(0)
    gemma = DiffusionGemmaForBlockDiffusion(tiny_diffusion_gemma_config()).eval()
    with torch.no_grad():
        gemma.model.decoder.embed_tokens.weight.mul_(30.0)
    model = AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), FusionSpec(rank=8, num_heads=2), mode)
    _randomize(model.fusion, seed=9, std=0.2)
    return model


def _run_blocks():
    """Block-wise generation, now the base's own ``generate`` on the time-anchored model (the cache inside the
    model): the tokens tadm's former block loop recorded, with its sampler settings (eta 0.1, tau 0.8 -> 0.4)."""
    from tadm.posttrain import TimeAnchoredDiffusionGemma
    from tadm.tasks.generation import _passes

    split = _gemma_model()
    model = TimeAnchoredDiffusionGemma.from_pretrained(split.backbone.model, split=(1, 3),
                                                       fusion=FusionSpec(rank=8, num_heads=2))
    model.fusion.load_state_dict(split.fusion.state_dict())
    V = model.config.text_config.vocab_size
    prompt = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("paired", "naive"):
        for K in (1, 2, 3):
            for stop in (None, (0, 1.0)):
                for sc in (True, False):
                    result = model.generate(
                        prompt, refresh_interval=K, naive=mode == "naive", self_conditioning=sc,
                        max_new_tokens=20, max_denoising_steps=6, t_min=0.4, t_max=0.8, eos_token_id=[7],
                        pad_token_id=0, stability_threshold=None if stop is None else stop[0],
                        confidence_threshold=None if stop is None else stop[1],
                        generator=torch.Generator().manual_seed(3),
                    )
                    record = model.last_generation
                    key = f"blocks/{mode}/K{K}/stop={stop}/sc={sc}"
                    out[key] = {"tokens": result.sequences.tolist(), "refresh_steps": record.refresh_steps,
                                "layer_calls": record.layer_calls.as_dict(),
                                "passes": _passes(result.sequences[:, 5:], result.tokens_per_forward, 0)}
    return out


def _run_rollouts():
    model = _gemma_model()
    V = model.vocab_size
    sampler = EntropyBoundSampler(V, num_steps=8)
    x0 = torch.randint(3, V, (4, 8), generator=torch.Generator().manual_seed(0))
    prompt = model.backbone.prefill(torch.randint(3, V, (4, 4), generator=torch.Generator().manual_seed(1)))
    out = {}
    for sc_prob in (0.0, 0.5, 1.0):
        for ages in ((0, 0, 0, 0), (2, 1, 0, 2), None):
            state = on_policy_rollout(
                model, x0, sampler=sampler, schedule=get_schedule("loglinear"), prompt=prompt,
                cache_age=None if ages is None else torch.tensor(ages), self_conditioning_prob=sc_prob,
                generator=torch.Generator().manual_seed(5),
            )
            key = f"rollout/sc={sc_prob}/ages={ages}"
            out[key] = {"z_anchor": state.z_anchor.tolist(), "z_current": state.z_current.tolist(),
                        "i_a": state.i_a.tolist(), "i_s": state.i_s.tolist(),
                        "anchor_sum": round(float(state.anchor.double().sum()), 3),
                        "c_sum": round(float(state.c_current.double().sum()), 3)}
    return out


class _IdTokenizer:
    """Token ids as text ("3 4 5"): enough of a tokenizer for PrefixGenerator's bookkeeping."""

    def __init__(self, vocab_size):
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, 0, 1

    def encode(self, text):
        return [int(word) for word in text.split()]


def _run_prefix():
    """tadm's own models after a prompt (the lm-eval path): prompts of two lengths, each K, two samplers."""
    nets, _ = _unconditional_cases()
    out = {}
    for net in ("tadm", "adlm", "mdlm"):
        model = nets[net]
        for sampler in ("mdlm", "remdm-cap"):
            for K in (1, 3):
                settings = GenerationSettings(policy=FixedRefresh(K), steps=8, sampler=sampler)
                gen = PrefixGenerator(model, _IdTokenizer(model.vocab_size), settings)
                batch = gen.generate([[0, 5, 6, 7], [0, 9]], 6, torch.Generator().manual_seed(4))
                out[f"prefix/{net}/{sampler}/K{K}"] = {"tokens": batch.tokens, "layer_calls": batch.layer_calls}
    return out


def _run_autoregressive():
    torch.manual_seed(0)
    model = _randomize(ar_tiny()).eval()
    out = {}
    for top_p in (1.0, 0.9, 0.5):
        for seed in (2, 3, 4):
            tokens = generate_autoregressive(model, batch_size=2, seq_len=8, bos_id=0, top_p=top_p,
                                             generator=torch.Generator().manual_seed(seed))
            out[f"ar/top_p={top_p}/seed={seed}"] = {"tokens": tokens.tolist()}
    return out


RUNS = {"generate": _run_unconditional, "blocks": _run_blocks, "rollout": _run_rollouts, "prefix": _run_prefix,
        "ar": _run_autoregressive}


def _golden() -> dict:
    if os.environ.get("TADM_WRITE_GOLDEN") == "1":
        data = {}
        for run in RUNS.values():
            with torch.no_grad():
                data.update(run())
        GOLDEN.write_text(json.dumps(data, indent=None, sort_keys=True) + "\n")
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def golden():
    return _golden()


@pytest.mark.slow
@pytest.mark.parametrize("caller", sorted(RUNS))
def test_caller_reproduces_recorded_tokens(golden, caller):
    with torch.no_grad():
        now = RUNS[caller]()
    recorded = {k: v for k, v in golden.items() if k.startswith(caller + "/")}
    assert len(now) >= 9 and set(now) == set(recorded)
    for key, value in now.items():
        assert value == recorded[key], key
