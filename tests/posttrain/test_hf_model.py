"""TimeAnchoredDiffusionGemma: a transformers DiffusionGemma whose decoder runs the anchor cache (Algorithm 1)."""

import math

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationConfig,
    DiffusionGemmaGenerationOutput,
    EntropyBoundSamplerConfig,
)

from tadm.posttrain import AnchoredBackbone, DiffusionGemmaBackbone, FusionSpec, SplitSpec, save_adapter
from tadm.posttrain.hf_model import TimeAnchoredDiffusionGemma

from .conftest import build_tiny_gemma, randomize

V, L = 128, 8
SHARED, ANCHOR, DENOISER = 1, 3, 2  # of the tiny model's 6 layers
FIXED_STEPS = dict(stability_threshold=None, confidence_threshold=None, eos_token_id=None)  # every step, every canvas


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random DiffusionGemma saved with save_pretrained, and a trained (randomised) fusion adapter for it."""
    root = tmp_path_factory.mktemp("hf-model")
    gemma = build_tiny_gemma()
    gemma.save_pretrained(root / "base")
    split = AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(SHARED, ANCHOR), FusionSpec(rank=8, num_heads=2))
    randomize(split.fusion, seed=1, std=0.5)
    save_adapter(root / "adapter", split, base_model=str(root / "base"))
    return root / "base", root / "adapter"


def _prompt(seed=0, B=2, P=5):
    return torch.randint(3, V, (B, P), generator=torch.Generator().manual_seed(seed))


def _left_padded(prompt):
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    return mask


CASES = {
    # the model's (empty) generation config: the base's defaults, adaptive stopping included
    "model defaults": dict(max_new_tokens=20, max_denoising_steps=6),
    "explicit config": dict(generation_config=DiffusionGemmaGenerationConfig(
        max_new_tokens=24, max_denoising_steps=5, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.3),
        t_min=0.2, t_max=1.0, stability_threshold=0, confidence_threshold=1.0, eos_token_id=[18, 5], pad_token_id=0,
    )),
    # no temperature schedule; max_length stops after two canvases although max_new_tokens allows three
    "no temperature, max_length": dict(max_new_tokens=24, max_length=15, max_denoising_steps=4, t_min=None,
                                       t_max=None, stability_threshold=None, confidence_threshold=None),
    "budget from max_length": dict(max_length=21, max_denoising_steps=3),
    # t_min = 0, which the base accepts: tau_n = t_max n / T is positive at every step n >= 1
    "zero minimum temperature": dict(max_new_tokens=16, max_denoising_steps=5, t_min=0.0, t_max=0.8, **FIXED_STEPS),
}

CANVASES = {"model defaults": 3, "explicit config": 3, "no temperature, max_length": 2, "budget from max_length": 2,
            "zero minimum temperature": 2}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_k1_gives_the_base_models_own_generate(saved, case):
    """K = 1 (fresh anchor every step; the trained fusion is then the identity) returns what the
    base's generate returns: same type, same tokens, same tokens per forward, for the same seed and config."""
    base_dir, adapter = saved
    base = DiffusionGemmaForBlockDiffusion.from_pretrained(base_dir).eval()
    model = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter)  # built before seeding
    prompt = _prompt()
    mask = _left_padded(prompt)
    torch.manual_seed(7)
    reference = base.generate(prompt, attention_mask=mask, **CASES[case])
    torch.manual_seed(7)
    out = model.generate(prompt, attention_mask=mask, **CASES[case])
    assert type(out) is type(reference) is DiffusionGemmaGenerationOutput
    assert out.sequences.shape == reference.sequences.shape == (2, 5 + CANVASES[case] * L)
    assert torch.equal(out.sequences, reference.sequences)
    if case == "explicit config":  # row 0 emits EOS (18) in its first canvas: padding after it and in later canvases
        assert (out.sequences[0, 10:] == 0).all() and not (out.sequences[1] == 0).any()
    torch.testing.assert_close(out.tokens_per_forward, reference.tokens_per_forward)
    assert model.last_generation.layer_calls.anchor_refreshes == model.last_generation.layer_calls.denoiser_calls
    torch.manual_seed(7)
    plain = model.generate(prompt, attention_mask=mask, return_dict_in_generate=False, **CASES[case])
    assert torch.equal(plain, reference.sequences)


@pytest.mark.slow
def test_a_loaded_base_and_the_settings_of_the_explicit_config_are_used(saved):
    base_dir, adapter = saved
    base = DiffusionGemmaForBlockDiffusion.from_pretrained(base_dir).eval()
    config, generation_config = base.config, base.generation_config
    model = TimeAnchoredDiffusionGemma.from_pretrained(base, adapter=adapter)
    # converted in place, as PEFT's get_peft_model does: the loaded model is the time-anchored one
    assert model is base and isinstance(model, TimeAnchoredDiffusionGemma) and model.config is config
    assert model.generation_config is generation_config
    assert (model.device, model.dtype, model.config.canvas_length) == (torch.device("cpu"), torch.float32, L)
    out = model.generate(_prompt(), **CASES["explicit config"])
    assert out.sequences.shape == (2, 5 + 3 * L)
    for steps in model.last_generation.refresh_steps:  # T = 5 from the config, K = 1; stopping may end a canvas early
        assert steps == list(range(5, 5 - len(steps), -1))


@pytest.mark.slow
def test_k2_runs_the_anchor_layers_at_half_the_steps(saved):
    """Exact layer calls per canvas: S and D at every one of the T steps, A at ceil(T / K) of them."""
    base_dir, adapter = saved
    T, blocks = 6, 3
    model = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter, refresh_interval=2)
    settings = dict(max_new_tokens=blocks * L, max_denoising_steps=T, **FIXED_STEPS)
    calls, tokens = {}, {}
    for K in (1, 2):
        tokens[K] = model.generate(_prompt(), refresh_interval=K, generator=torch.Generator().manual_seed(0),
                                   **settings).sequences
        calls[K] = model.last_generation.layer_calls
        assert model.last_generation.refresh_steps == [[i for i in range(T, 0, -1) if (T - i) % K == 0]] * blocks
    for K, counted in calls.items():
        refreshes = blocks * math.ceil(T / K)
        assert (counted.anchor_refreshes, counted.anchor) == (refreshes, ANCHOR * refreshes)
        assert (counted.shared, counted.denoiser) == (SHARED * T * blocks, DENOISER * T * blocks)
    assert (calls[1].anchor, calls[2].anchor) == (54, 27)
    assert calls[1].total - calls[2].total == 27
    # The model's default K (2, from from_pretrained) is used when a call names none.
    default = model.generate(_prompt(), generator=torch.Generator().manual_seed(0), **settings).sequences
    assert torch.equal(default, tokens[2]) and model.last_generation.layer_calls.anchor == 27
    # naive=True: the stale anchor as is, fusion bypassed; the model stays paired afterwards.
    naive = model.generate(_prompt(), naive=True, generator=torch.Generator().manual_seed(0), **settings).sequences
    assert not torch.equal(naive, tokens[2]) and model.anchor_cache.mode == "paired"
    assert model.last_generation.layer_calls.anchor == 27


@pytest.mark.slow
def test_refresh_policies_in_their_string_forms(saved):
    base_dir, adapter = saved
    T, blocks = 6, 2
    model = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter, refresh_policy="fixed:K=3")
    assert model.refresh_policy.fixed_interval == 3

    def run(**kwargs):
        sequences = model.generate(_prompt(), generator=torch.Generator().manual_seed(3), max_new_tokens=blocks * L,
                                   max_denoising_steps=T, **FIXED_STEPS, **kwargs).sequences
        return sequences, model.last_generation

    by_int, first = run(refresh_interval=3)
    by_spec, second = run(refresh_policy="fixed:K=3")
    by_default, _ = run()
    assert torch.equal(by_int, by_spec) and torch.equal(by_int, by_default)
    assert first.refresh_steps == second.refresh_steps == [[6, 3]] * blocks
    _, scheduled = run(refresh_policy="schedule:steps=6/5/1")
    assert scheduled.refresh_steps == [[6, 5, 1]] * blocks and scheduled.layer_calls.anchor == ANCHOR * 3 * blocks
    _, adaptive = run(refresh_policy={"policy": "adaptive", "tau": 0.3, "max_interval": 4})
    assert all(steps[0] == T for steps in adaptive.refresh_steps)


@pytest.mark.slow
@pytest.mark.parametrize("bad", [0, -1, "x"])
def test_a_bad_refresh_interval_is_one_clean_line(saved, bad):
    base_dir, adapter = saved
    model = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter)
    for call in (lambda: model.generate(_prompt(), refresh_interval=bad),
                 lambda: TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter, refresh_interval=bad)):
        with pytest.raises(ValueError) as error:
            call()
        assert "\n" not in str(error.value) and repr(bad) in str(error.value)
        assert "K must be an integer >= 1" in str(error.value)
    with pytest.raises(ValueError, match="skip_unchanged reuses a whole prediction"):
        model.generate(_prompt(), refresh_policy="2:skip_unchanged=true")
    with pytest.raises(ValueError, match="unknown policy 'x'") as error:
        model.generate(_prompt(), refresh_policy="x:K=2")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="not both"):
        model.generate(_prompt(), refresh_interval=2, refresh_policy="fixed:K=2")


@pytest.mark.slow
def test_dtype_and_other_options_go_to_the_base_loader(saved):
    base_dir, adapter = saved
    model = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter, dtype=torch.bfloat16,
                                                       refresh_interval=2)
    assert model.dtype == torch.bfloat16
    assert {p.dtype for p in model.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.fusion.parameters()} == {torch.float32}  # the fusion is kept in float32
    out = model.generate(_prompt(), max_new_tokens=L, max_denoising_steps=2)
    assert out.sequences.shape == (2, 5 + L) and out.sequences.dtype == torch.long
    with pytest.raises(ValueError, match="apply only when the base is a directory or Hub id"):
        TimeAnchoredDiffusionGemma.from_pretrained(DiffusionGemmaForBlockDiffusion.from_pretrained(base_dir),
                                                   adapter=adapter, dtype=torch.float32)
    with pytest.raises(ValueError, match="trust_remote_code=False"):
        TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter, trust_remote_code=True)


def test_what_generate_cannot_run_with_the_cache_is_refused_in_one_line(saved):
    base_dir, adapter = saved
    model = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter, refresh_interval=2)
    refused = [
        (dict(cache_implementation="static"), "the compiled denoising step \\(a static cache\\) runs only at K = 1"),
        (dict(canvas_length=0), "canvas_length must be an integer >= 1"),
    ]
    for kwargs, match in refused:
        with pytest.raises(ValueError, match=match) as error:
            model.generate(_prompt(), max_new_tokens=L, **kwargs)
        assert "\n" not in str(error.value)
    for ids, got in ((_prompt()[0], r"got shape \(5,\), torch.int64"), (_prompt().float(), "got shape .*torch.float32"),
                     (_prompt().tolist(), "got list")):
        with pytest.raises(ValueError, match=rf"input_ids must be a \(B, P\) tensor of token ids, {got}"):
            model.generate(ids, max_new_tokens=L)
    with pytest.raises(ValueError, match="generate needs input_ids"):
        model.generate(max_new_tokens=L)
    # Text-only token types are accepted, and a refused call leaves the model's own settings as they were.
    model.generate(_prompt(), token_type_ids=torch.zeros(2, 5, dtype=torch.long), max_new_tokens=L,
                   max_denoising_steps=2)
    assert model.refresh_policy.fixed_interval == 2 and model.config.canvas_length == L


def test_prompts_of_any_integer_dtype_generate_as_the_base_does(saved):
    """The base takes int32 input_ids (a tokenizer or a numpy array may give them); tadm used to refuse them with
    a message about the "canvas"."""
    base_dir, adapter = saved
    base = DiffusionGemmaForBlockDiffusion.from_pretrained(base_dir).eval()
    model = TimeAnchoredDiffusionGemma.from_pretrained(base, adapter=adapter)
    settings = dict(max_new_tokens=L, max_denoising_steps=2, **FIXED_STEPS)
    torch.manual_seed(4)
    reference = base.generate(_prompt().int(), **settings).sequences
    for dtype in (torch.int32, torch.int16, torch.uint8, torch.int64):
        torch.manual_seed(4)
        out = model.generate(_prompt().to(dtype), **settings).sequences
        assert out.dtype == reference.dtype == torch.long and torch.equal(out, reference), dtype
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, P\) tensor of token ids, got shape \(2, 5\), "
                                         r"torch.bool"):
        model.generate(_prompt() > 50, **settings)


@pytest.mark.slow
def test_a_split_without_adapter_is_the_base_at_k1_and_naive_reuse_beyond(saved):
    base_dir, adapter = saved
    with pytest.raises(ValueError, match="no adapter given: pass adapter=DIR_OR_HUB_ID, or split="):
        TimeAnchoredDiffusionGemma.from_pretrained(base_dir)
    with pytest.raises(ValueError, match="not both"):
        TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter, split=(SHARED, ANCHOR))
    for bad in ("1:2", (1,), 3):
        with pytest.raises(ValueError, match=r"split must be \(shared, anchor\) layer counts, e\.g\. split=\(2, 20\)"):
            TimeAnchoredDiffusionGemma.from_pretrained(base_dir, split=bad)
    plain = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, split=(SHARED, ANCHOR))
    fused = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter)
    base = DiffusionGemmaForBlockDiffusion.from_pretrained(base_dir).eval()
    settings = dict(max_new_tokens=2 * L, max_denoising_steps=4)
    torch.manual_seed(5)
    reference = base.generate(_prompt(), **settings).sequences
    torch.manual_seed(5)
    assert torch.equal(plain.generate(_prompt(), **settings).sequences, reference)

    def at_k2(model, **kwargs):
        return model.generate(_prompt(), refresh_interval=2, generator=torch.Generator().manual_seed(1),
                              **settings, **kwargs).sequences

    assert torch.equal(at_k2(plain), at_k2(fused, naive=True))
    with pytest.raises(ValueError, match="this model has no adapter to save"):
        plain.save_pretrained(base_dir.parent / "nothing")


def test_an_adapter_alone_loads_the_base_it_records(saved, tmp_path, monkeypatch):
    """As PEFT's AutoPeftModel: from_pretrained(adapter) loads adapter_config.json's base_model."""
    import json

    import tadm.hf

    base_dir, adapter = saved
    alone = TimeAnchoredDiffusionGemma.from_pretrained(adapter, refresh_interval=2)
    paired = TimeAnchoredDiffusionGemma.from_pretrained(base_dir, adapter=adapter, refresh_interval=2)
    settings = dict(max_new_tokens=L, max_denoising_steps=4, **FIXED_STEPS)
    run = lambda m: m.generate(_prompt(), generator=torch.Generator().manual_seed(0), **settings).sequences
    assert alone.adapter_config == paired.adapter_config and torch.equal(run(alone), run(paired))
    # A recorded base that cannot be loaded here: one line saying to pass the base.
    moved = tmp_path / "moved"
    moved.mkdir()
    for file in adapter.iterdir():
        (moved / file.name).write_bytes(file.read_bytes())
    config = json.loads((moved / "adapter_config.json").read_text())
    # a path that is gone; a relative one recorded elsewhere, which reads like a Hub id
    for recorded in (str(tmp_path / "gone"), "runs/tadm-no-such-base"):
        config["base_model"] = recorded
        (moved / "adapter_config.json").write_text(json.dumps(config))
        monkeypatch.setattr(tadm.hf.constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        tadm.hf.hub_reachable.cache_clear()
        with pytest.raises(FileNotFoundError) as error:
            TimeAnchoredDiffusionGemma.from_pretrained(moved)
        tadm.hf.hub_reachable.cache_clear()
        message = str(error.value)
        assert "\n" not in message and f"adapter '{moved}' records its base model as '{recorded}'" in message
        assert f"pass the base: TimeAnchoredDiffusionGemma.from_pretrained(BASE_DIR_OR_HUB_ID, adapter='{moved}')" in message
    # A base without an adapter, and no split: as before.
    with pytest.raises(ValueError, match="no adapter given"):
        TimeAnchoredDiffusionGemma.from_pretrained(base_dir)


def test_num_parameters_counts_as_transformers_does(saved):
    base_dir, adapter = saved
    base = DiffusionGemmaForBlockDiffusion.from_pretrained(base_dir).eval()
    expected = {flags: base.num_parameters(exclude_embeddings=flags[1]) for flags in ((False, False), (False, True))}
    model = TimeAnchoredDiffusionGemma.from_pretrained(base, adapter=adapter)
    fusion = sum(p.numel() for p in model.fusion.parameters())
    assert fusion > 0
    assert model.num_parameters() == expected[(False, False)] + fusion
    assert model.num_parameters(exclude_embeddings=True) == expected[(False, True)] + fusion
    assert model.num_parameters(only_trainable=True) == fusion  # the base is frozen
