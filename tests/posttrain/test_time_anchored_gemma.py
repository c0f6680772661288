"""The anchor cache inside the model: TimeAnchoredDiffusionGemma is a transformers DiffusionGemma whose own generate,
diffusers' pipeline and a user's forward loop all run Algorithm 1.

Golden tokens (``test_anchored_gemma_golden.py``) fix plain generation at K = 1-4; here: transformers' conventions,
every generate option of the base (identical to the base at K = 1, to the golden tokens at K = 2 and 3 where the
option does not change the sampling), diffusers' pipeline against an explicit stage-by-stage run of Algorithm 1,
training through the same class, and bad input.
"""

import copy
import json
import math
import pickle

import pytest
import torch
from transformers import (DiffusionGemmaForBlockDiffusion, DynamicCache, LogitsProcessor, LogitsProcessorList,
                          StoppingCriteria, StoppingCriteriaList)

from tadm.posttrain import AnchoredBackbone, DiffusionGemmaBackbone, FusionSpec, SplitSpec, StackContext, save_adapter
from tadm.posttrain.hf_model import TIME_ANCHOR_KEY, TimeAnchoredDiffusionGemma, default_split
from tadm.posttrain.layer_cache import LayerStackCache, install_layer_cache, remove_layer_cache
from tadm.posttrain.backbone import tiny_diffusion_gemma_config

from .anchored_gemma_golden import FIXED_STEPS, FIXTURE, prompt
from .conftest import build_tiny_gemma, randomize, tiny_chat_tokenizer

GOLDEN = {c["name"]: c for c in json.loads((FIXTURE / "tokens.json").read_text())["cases"]}
SETTINGS = dict(max_new_tokens=16, max_denoising_steps=6, **FIXED_STEPS)  # the golden "fixed-steps" cases
V, L = 128, 8


def _golden(K, batch=2, seed=7):
    return GOLDEN[f"fixed-steps/K{K}/B{batch}/seed{seed}"]["sequences"]


@pytest.fixture(scope="module")
def base():
    return DiffusionGemmaForBlockDiffusion.from_pretrained(FIXTURE / "base").eval()


@pytest.fixture(scope="module")
def model():
    return TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=FIXTURE / "adapter")


def _run(m, K=None, seed=7, **kwargs):
    ids, mask = prompt(1, 2, left_pad=True)
    torch.manual_seed(seed)
    options = dict(SETTINGS)
    options.update(kwargs)
    if K is not None:
        options["refresh_interval"] = K
    return m.generate(ids, attention_mask=mask, **options)


# ------------------------------------------------------------------------------ a transformers model
def test_it_is_a_diffusion_gemma_with_the_usual_parts(model):
    assert isinstance(model, DiffusionGemmaForBlockDiffusion)
    assert model.get_input_embeddings() is model.model.encoder.get_input_embeddings()
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight  # tied, as in the base
    keys = list(model.state_dict())
    base_keys = set(DiffusionGemmaForBlockDiffusion(model.config).state_dict())
    assert {k for k in keys if not k.startswith("fusion.")} == base_keys  # the base's names, unchanged
    assert sorted(k for k in keys if k.startswith("fusion.")) == sorted(f"fusion.{k}" for k in model.fusion.state_dict())
    layers = model.model.decoder.layers
    anchored = [type(layer).__name__.startswith("TimeAnchored") for layer in layers]
    assert anchored == [False, True, True, True, False, False]  # the anchor layers of the 1 / 3 / 2 split
    assert model.num_parameters(only_trainable=True) == sum(p.numel() for p in model.fusion.parameters())


def test_output_loading_info_and_keyword_loading(model):
    loaded, info = TimeAnchoredDiffusionGemma.from_pretrained(
        pretrained_model_name_or_path=FIXTURE / "base", adapter=FIXTURE / "adapter", output_loading_info=True)
    assert isinstance(loaded, TimeAnchoredDiffusionGemma)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    for (name, a), (_, b) in zip(loaded.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


def test_construction_from_a_config_and_a_whole_save_load_round_trip(tmp_path):
    config = tiny_diffusion_gemma_config()
    torch.manual_seed(0)
    built = TimeAnchoredDiffusionGemma(config)  # the paper's split scaled to 6 layers, a default fusion, K = 1
    assert built.layer_split == default_split(6).resolve(6) and built.refresh_policy.fixed_interval == 1
    assert torch.equal(built.fusion.up.weight, torch.zeros_like(built.fusion.up.weight))  # identity at init
    assert float(built.fusion.gate_out.bias) == -3.0
    other = TimeAnchoredDiffusionGemma(config, split=(1, 3), fusion=FusionSpec(rank=8, num_heads=2),
                                       refresh_interval=3)
    assert (other.layer_split.shared, other.layer_split.anchor, other.fusion.rank) == (1, 3, 8)
    randomize(other.fusion, seed=1)
    other.save_pretrained(tmp_path / "whole")  # built from a config: the whole model, as any transformers model
    saved = json.loads((tmp_path / "whole" / "config.json").read_text())[TIME_ANCHOR_KEY]
    assert saved["refresh_policy"]["interval"] == 3 and saved["anchor_layers"] == 3
    again = TimeAnchoredDiffusionGemma.from_pretrained(tmp_path / "whole")
    assert again.refresh_policy.fixed_interval == 3 and again.layer_split == other.layer_split
    for (name, a), (_, b) in zip(again.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    # transformers' config= / state_dict= construction
    rebuilt = TimeAnchoredDiffusionGemma.from_pretrained(None, config=other.config, state_dict=other.state_dict())
    assert torch.equal(rebuilt.fusion.up.weight, other.fusion.up.weight)


def test_the_refresh_policy_is_saved_with_the_adapter_and_restored(model, tmp_path):
    model.refresh_policy = "adaptive:tau=0.3:max_interval=4"
    try:
        model.save_pretrained(tmp_path / "adapter")  # loaded as base + adapter: the adapter only
    finally:
        model.refresh_policy = 1
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]
    loaded = TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=tmp_path / "adapter")
    assert loaded.refresh_policy.config() == {"policy": "adaptive", "tau": 0.3, "min_interval": 1, "max_interval": 4,
                                              "skip_unchanged": False}
    assert TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=tmp_path / "adapter",
                                                      refresh_interval=2).refresh_policy.fixed_interval == 2
    # an adapter saved before the key existed serves at K = 1
    assert TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=FIXTURE / "adapter"
                                                      ).refresh_policy.fixed_interval == 1


def test_attention_implementations_are_the_bases(model):
    eager = TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=FIXTURE / "adapter",
                                                       attn_implementation="eager")
    assert eager.config._attn_implementation == "eager" and model.config._attn_implementation == "sdpa"
    backbone = DiffusionGemmaBackbone(DiffusionGemmaForBlockDiffusion.from_pretrained(FIXTURE / "base"))
    ids, mask = prompt(1, 2, left_pad=True)
    cache = backbone.prefill(ids, mask).past_key_values
    z = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, m in (("sdpa", model), ("eager", eager)):
        past = copy.deepcopy(cache)
        logits[name] = m(decoder_input_ids=z, past_key_values=past,
                         decoder_attention_mask=torch.nn.functional.pad(mask.bool(), (0, L), value=True)).logits
    torch.testing.assert_close(logits["eager"], logits["sdpa"], atol=1e-4, rtol=1e-4)


def test_a_copy_and_a_pickle_carry_their_own_cache(model):
    twin = copy.deepcopy(model)
    assert twin.anchor_cache is not model.anchor_cache
    assert all(layer.__dict__.get("_tadm_layer_cache", twin.anchor_cache) is twin.anchor_cache
               for layer in twin.model.decoder.layers)
    assert _run(twin, K=3).sequences.tolist() == _golden(3)
    assert twin.last_generation.layer_calls.anchor_refreshes == 4 and model.last_generation is not \
        twin.last_generation
    restored = pickle.loads(pickle.dumps(twin))
    assert _run(restored, K=2).sequences.tolist() == _golden(2)


def test_removing_the_cache_gives_back_the_base_layers():
    gemma = build_tiny_gemma()
    layers = gemma.model.decoder.layers
    classes = [type(layer) for layer in layers]
    cache = install_layer_cache(layers, LayerStackCache(SplitSpec(1, 3).resolve(6), None, 2))
    assert [type(layer) for layer in layers] != classes
    remove_layer_cache(layers)
    assert [type(layer) for layer in layers] == classes and "_tadm_layer_cache" not in layers[1].__dict__
    with pytest.raises(ValueError, match="covers 6 layers, but the stack has 5"):
        install_layer_cache(layers[:5], cache)


# ------------------------------------------------------------------------------ every generate option
class _Recorder:
    """A streamer that keeps what the base's generate sends it."""

    def __init__(self):
        self.tokens, self.drafts, self.ended = [], [], False

    def put(self, value):
        self.tokens.append(value.clone())

    def put_draft(self, value=None, logits=None):
        self.drafts.append(value.clone())

    def end(self):
        self.ended = True


class _Ban(LogitsProcessor):
    """Forbids tokens 5..39: changes what is sampled."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[..., 5:40] = -1e9
        return scores


class _Identity(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


class _AfterCanvases(StoppingCriteria):
    def __init__(self, prompt_length, canvases):
        self.prompt_length, self.canvases = prompt_length, canvases

    def __call__(self, input_ids, scores, **kwargs):
        done = (input_ids.shape[1] - self.prompt_length) >= self.canvases * L
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


OPTIONS = {
    "streamer": lambda: dict(streamer=_Recorder()),
    "logits processor (no-op)": lambda: dict(logits_processor=LogitsProcessorList([_Identity()])),
    "logits processor (bans tokens)": lambda: dict(logits_processor=LogitsProcessorList([_Ban()])),
    "stopping criteria (never)": lambda: dict(stopping_criteria=StoppingCriteriaList([_AfterCanvases(5, 99)])),
    "stopping criteria (after one canvas)": lambda: dict(stopping_criteria=StoppingCriteriaList([_AfterCanvases(5, 1)]),
                                                        pad_token_id=0),
    "starting canvas": lambda: dict(decoder_input_ids=torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(2))),
    "explicit dynamic cache": lambda: dict(past_key_values=DynamicCache(config=tiny_diffusion_gemma_config().text_config)),
    "static cache, uncompiled": lambda: dict(cache_implementation="static", disable_compile=True),
    "max_length": lambda: dict(max_new_tokens=256, max_length=13),
}
SAME_SAMPLING = ("streamer", "logits processor (no-op)", "stopping criteria (never)", "explicit dynamic cache",
                 "static cache, uncompiled")


@pytest.mark.slow
@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_generate_option_is_the_bases_at_k1_and_runs_the_cache_beyond(base, model, option):
    reference = _run(base, **OPTIONS[option]())
    ours = _run(model, K=1, **OPTIONS[option]())
    assert torch.equal(ours.sequences, reference.sequences)
    torch.testing.assert_close(ours.tokens_per_forward, reference.tokens_per_forward)
    for K in (2, 3):
        out = _run(model, K=K, **OPTIONS[option]())
        calls = model.last_generation.layer_calls
        assert calls.anchor_refreshes == math.ceil(6 / K) * len(model.last_generation.refresh_steps)
        assert calls.anchor_refreshes < calls.denoiser_calls  # the anchor layers were skipped
        if option in SAME_SAMPLING:
            assert out.sequences.tolist() == _golden(K)
        else:
            assert out.sequences.tolist() != _golden(K) or option == "max_length"
    if option == "stopping criteria (after one canvas)":
        assert (reference.sequences[:, 5 + L:] == 0).all()


@pytest.mark.slow
def test_a_streamer_gets_the_same_canvases_and_drafts_as_from_the_base(base, model):
    sent = {}
    for name, m in (("base", base), ("tadm", model)):
        sent[name] = _Recorder()
        _run(m, streamer=sent[name])
    assert sent["tadm"].ended and len(sent["tadm"].drafts) == 12  # two canvases of six steps
    for a, b in zip(sent["tadm"].tokens + sent["tadm"].drafts, sent["base"].tokens + sent["base"].drafts):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_continuing_a_conversation_through_past_key_values(base, model):
    follow = torch.randint(3, V, (2, 3), generator=torch.Generator().manual_seed(9))
    out = {}
    for name, m, K in (("base", base, None), ("tadm", model, 1), ("tadm-K2", model, 2)):
        first = _run(m, K=K)
        torch.manual_seed(4)
        options = dict(SETTINGS) if K is None else dict(SETTINGS, refresh_interval=K)
        out[name] = m.generate(follow, past_key_values=first.past_key_values, **options).sequences
    assert torch.equal(out["tadm"], out["base"])
    assert out["tadm-K2"].shape == out["base"].shape and model.last_generation.layer_calls.anchor_refreshes == 6
    assert model.last_generation.encoder_layer_calls == 2 * 6  # only the new turn and one canvas are encoded


def test_the_compiled_step_path_at_k1_is_the_bases(base, model, monkeypatch):
    """A static cache makes generate compile its step; with torch.compile standing in as the identity (a real
    compile takes minutes on a CPU) the path runs and gives the base's tokens. A real compile at K = 1 was checked
    by hand (docs/results/time-anchored-diffusiongemma-cpu.md)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    for m in (base, model):
        for name in ("_compiled_encoder", "_compiled_decoder_forward", "_compiled_accept_canvas",
                     "_compiled_renoise_canvas"):
            m.__dict__.pop(name, None)
    reference = _run(base, cache_implementation="static")
    assert torch.equal(_run(model, K=1, cache_implementation="static").sequences, reference.sequences)
    for m in (base, model):
        for name in list(m.__dict__):
            if name.startswith("_compiled"):
                del m.__dict__[name]


def test_a_generator_is_drawn_from_as_the_global_one_would_be(model):
    ids, mask = prompt(1, 2, left_pad=True)
    generator = torch.Generator().manual_seed(7)
    out = model.generate(ids, attention_mask=mask, refresh_interval=3, generator=generator, **SETTINGS)
    assert out.sequences.tolist() == _golden(3)
    state = torch.get_rng_state()
    again = model.generate(ids, attention_mask=mask, refresh_interval=3, generator=generator, **SETTINGS)
    assert not torch.equal(again.sequences, out.sequences)  # the generator advanced
    assert torch.equal(torch.get_rng_state(), state)  # the global generator did not


# ------------------------------------------------------------------------------ diffusers
class _ExplicitAlgorithm1(torch.nn.Module):
    """A reference for the pipeline: the base driven stage by stage (tadm's AnchoredBackbone), the anchor
    recomputed at every K-th pass of a canvas and the step count reset whenever the encoder runs."""

    def __init__(self, K):
        super().__init__()
        gemma = DiffusionGemmaForBlockDiffusion.from_pretrained(FIXTURE / "base").eval()
        adapter = json.loads((FIXTURE / "adapter" / "adapter_config.json").read_text())
        self.view = AnchoredBackbone(DiffusionGemmaBackbone(gemma),
                                     SplitSpec(adapter["shared_layers"], adapter["anchor_layers"]),
                                     FusionSpec(rank=adapter["rank"], num_heads=adapter["num_heads"]))
        from safetensors.torch import load_file

        self.view.fusion.load_state_dict(load_file(str(FIXTURE / "adapter" / "adapter_model.safetensors")))
        self.model, self.config, self.K, self.n, self.anchor = gemma.model, gemma.config, K, 0, None
        gemma.model.encoder.register_forward_pre_hook(lambda *args: setattr(self, "n", 0))

    @property
    def device(self):  # what diffusers asks of a pipeline component
        return torch.device("cpu")

    def forward(self, decoder_input_ids, past_key_values, self_conditioning_logits, decoder_attention_mask,
                decoder_position_ids):
        from tadm.posttrain.backbone import PromptCache, _GemmaPass

        backbone = self.view.backbone
        ref = torch.empty(0, dtype=backbone.dtype)
        rotary = {lt: backbone.decoder.rotary_emb(ref, decoder_position_ids, lt) for lt in set(backbone.layer_types)}
        context = PromptCache(past_key_values, torch.ones(1, past_key_values.get_seq_length(), dtype=torch.bool),
                              decoder_input_ids.shape[0])  # the layers read the cache; the mask is given below
        prepared = _GemmaPass(context=StackContext(prompt=context, self_conditioning_logits=self_conditioning_logits),
                              position_ids=decoder_position_ids, position_embeddings=rotary,
                              masks=decoder_attention_mask)
        z = decoder_input_ids
        c = self.view.encode(z, prepared)
        if self.n % self.K == 0:
            self.anchor = self.view.compute_anchor(c, prepared)
        self.n += 1
        return type("Out", (), {"logits": self.view.predict_logits(z, c, self.anchor, prepared)})


@pytest.mark.slow
def test_diffusers_pipeline_runs_the_cache_inside_the_model(base):
    diffusers = pytest.importorskip("diffusers")
    tokenizer = tiny_chat_tokenizer()
    scheduler = diffusers.EntropyBoundScheduler(entropy_bound=0.1, t_max=0.8, t_min=0.4, num_inference_steps=6)

    def run(m):
        pipe = diffusers.DiffusionGemmaPipeline(model=m, scheduler=scheduler, processor=tokenizer)
        pipe.set_progress_bar_config(disable=True)
        torch.manual_seed(0)
        return pipe(prompt=["the cat sat", "the dog ran"], gen_length=2 * L, num_inference_steps=6,
                    confidence_threshold=None, output_type="seq").sequences

    reference = {1: run(base)}
    for K in (1, 2, 3):
        model = TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=FIXTURE / "adapter",
                                                           refresh_interval=K)
        record = model.anchor_cache.start_record()
        ours = run(model)
        record = model.anchor_cache.finish_record()
        if K > 1:
            reference[K] = run(_ExplicitAlgorithm1(K))
            assert not torch.equal(reference[K], reference[1])
        assert torch.equal(ours, reference[K]), K
        assert record.layer_calls.denoiser_calls == 12 and record.layer_calls.anchor_refreshes == 2 * math.ceil(6 / K)
        assert record.layer_calls.anchor == 3 * record.layer_calls.anchor_refreshes
        assert record.refresh_steps == [list(range(0, 6, K))] * 2  # positions n: the pipeline gives no step index


def test_a_model_passed_to_the_pipeline_is_the_model_itself(model):
    """diffusers' pipeline reads ``model.model.encoder`` and ``model.model.decoder``: they are the base's."""
    assert type(model.model.encoder).__name__ == "DiffusionGemmaEncoderModel"
    assert hasattr(model.model.decoder, "create_diffusion_decoder_attention_mask")


# ------------------------------------------------------------------------------ a user's loop
def test_a_user_loop_calling_forward_runs_algorithm_1(model):
    """Each forward is one pass; giving input_ids (the context) starts the count anew."""
    ids, mask = prompt(1, 2)
    z = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(0))
    model.refresh_policy = 3
    try:
        record = model.anchor_cache.start_record()
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        first = model(input_ids=ids, attention_mask=mask, past_key_values=cache, decoder_input_ids=z).logits
        full = torch.nn.functional.pad(mask.bool(), (0, L), value=True)
        for _ in range(4):
            model(decoder_input_ids=z, past_key_values=cache, decoder_attention_mask=full)
        record = model.anchor_cache.finish_record()
    finally:
        model.refresh_policy = 1
    assert record.layer_calls.denoiser_calls == 5 and record.layer_calls.anchor_refreshes == 2  # passes 0 and 3
    assert record.encoder_layer_calls == 6
    # the first pass refreshed: the base's own logits
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(FIXTURE / "base").eval()
    expected = reference(input_ids=ids, attention_mask=mask, decoder_input_ids=z,
                         past_key_values=DynamicCache(config=model.config.get_text_config(decoder=True))).logits
    torch.testing.assert_close(first, expected, atol=0, rtol=0)


# ------------------------------------------------------------------------------ training in the same class
def test_the_fusion_trains_inside_the_served_class_with_gradient_checkpointing():
    from tadm.diffusion import get_schedule
    from tadm.posttrain.rollout import draw_rollout
    from tadm.posttrain.trainer import posttrain_loss
    from tadm.sampling.entropy_bound import EntropyBoundSampler

    served = TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", adapter=FIXTURE / "adapter")
    view = served.stage_view()
    assert view.fusion is served.fusion and all(p.requires_grad for p in served.fusion.parameters())
    assert not any(p.requires_grad for n, p in served.named_parameters() if not n.startswith("fusion."))
    ids, mask = prompt(1, 2)
    x0 = torch.randint(3, V, (2, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        context = view.backbone.prefill(ids, mask)
    state = draw_rollout(view, x0, sampler=EntropyBoundSampler(V, num_steps=6), schedule=get_schedule("loglinear"),
                         prompt=context, cache_age=torch.tensor([2, 1]), self_conditioning_prob=0.0,
                         generator=torch.Generator().manual_seed(3))
    grads = {}
    for checkpointing in (False, True):
        if checkpointing:
            served.gradient_checkpointing_enable()
        served.fusion.zero_grad()
        posttrain_loss(view, state).loss.backward()
        grads[checkpointing] = [p.grad.clone() for p in served.fusion.parameters()]
    served.gradient_checkpointing_disable()
    assert any(float(g.abs().sum()) > 0 for g in grads[False])
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------ bad input
def test_bad_input_is_one_line_and_nothing_is_half_loaded(tmp_path):
    gemma = build_tiny_gemma()
    other = AnchoredBackbone(DiffusionGemmaBackbone(build_tiny_gemma(hidden_size=48, head_dim=16)), SplitSpec(1, 3),
                             FusionSpec(rank=8, num_heads=2))
    save_adapter(tmp_path / "wide", other, base_model="elsewhere")
    deeper = AnchoredBackbone(DiffusionGemmaBackbone(build_tiny_gemma(num_layers=8)), SplitSpec(1, 3),
                              FusionSpec(rank=8, num_heads=2))
    save_adapter(tmp_path / "deep", deeper, base_model="elsewhere")
    cases = [
        (dict(adapter=tmp_path / "wide"), "was trained on a 6-layer base of hidden size 48 .*this base has 6 layers of "
                                          "size 32"),
        (dict(adapter=tmp_path / "deep"), "was trained on a 8-layer base of hidden size 32"),
        (dict(split=(2, 9)), "exceeds the backbone's 6 layers"),
        (dict(split=(1, 0)), "anchor_layers must be >= 1"),
        (dict(split=(1, 3), refresh_interval=0), "K must be an integer >= 1"),
        (dict(split=(1, 3), refresh_policy="often"), "unknown policy 'often'"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match) as error:
            TimeAnchoredDiffusionGemma.from_pretrained(gemma, **kwargs)
        assert "\n" not in str(error.value)
        assert type(gemma) is DiffusionGemmaForBlockDiffusion  # the loaded base was not converted
        with pytest.raises(ValueError, match=match):
            TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", **kwargs)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TimeAnchoredDiffusionGemma.from_pretrained(tmp_path / "missing", split=(1, 3))
    with pytest.raises(ValueError, match="a new fusion needs split="):
        TimeAnchoredDiffusionGemma.from_pretrained(FIXTURE / "base", fusion=FusionSpec())
