"""The ``tadm`` lm-eval model: generate_until on tiny models, stop strings, seeds, stats, errors, registration."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from tadm.tasks import register_lm_eval_model  # noqa: E402
from tadm.sampling.refresh import parse_refresh  # noqa: E402
from tadm.tasks.lm_eval_model import TadmLM, batch_seed, stop_strings, truncate_at_stops  # noqa: E402
from tadm.tasks.model_args import TadmModelArgs, repeated_keys  # noqa: E402

PROMPTS = ["hello how are you", "the cat", "what is it"]
STEPS = 4


def requests(prompts=PROMPTS, until=(), max_gen_toks=16, **gen):
    """generate_until Instances; ``max_gen_toks=None`` leaves the budget to the model's default."""
    budget = {} if max_gen_toks is None else {"max_gen_toks": max_gen_toks}
    return [Instance("generate_until", {"id": n}, (p, {"until": list(until), **budget, **gen}), n,
                     metadata=("tiny", n, 1)) for n, p in enumerate(prompts)]


def base_lm(base_dir, **args):
    args = {"split": "1:3", "steps": STEPS, "device": "cpu", **args}
    return TadmLM(base=str(base_dir), **args)


@pytest.fixture(scope="module")
def adapter_lm(base_dir, adapter_dir):
    return TadmLM(base=str(base_dir), adapter=str(adapter_dir), K=2, steps=STEPS, batch_size=2, device="cpu")


def test_registered_with_lm_eval():
    assert register_lm_eval_model() is TadmLM
    assert get_model("tadm") is TadmLM


@pytest.mark.slow
def test_generate_until_with_an_adapter(adapter_lm):
    adapter_lm.reset_stats()
    texts = adapter_lm.generate_until(requests())
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts) and any(texts)
    stats = adapter_lm.request_stats
    assert len(stats) == 3 and len(adapter_lm.batch_stats) == 2  # batch_size 2
    assert {(s.task, s.doc_id) for s in stats} == {("tiny", 0), ("tiny", 1), ("tiny", 2)}
    for s in stats:
        assert 0 <= s.generated_tokens <= 16 and s.seconds > 0 and s.stop in ("eos", "length")
        assert s.layer_calls["anchor_refreshes"] == 2 * math.ceil(16 / 8)  # 2 canvases of T = 4 steps, K = 2
        assert s.layer_calls["shared"] == 1 * STEPS * 2 and s.encoder_layer_calls > 0
    summary = adapter_lm.summary()
    assert summary["requests"] == 3 and summary["batches"] == 2
    assert summary["generated_tokens"] == sum(s.generated_tokens for s in stats)
    assert summary["layer_calls"]["total"] == sum(b.layer_calls["total"] for b in adapter_lm.batch_stats)
    # per request: the layer calls its own generation went through (its batch's), not the batch's share
    assert summary["layer_calls_per_request"] == pytest.approx(sum(s.layer_calls["total"] for s in stats) / 3)
    assert summary["layer_calls_per_request"] > summary["layer_calls"]["total"] / 3
    assert summary["tokens_per_second"] > 0
    assert summary["settings"]["refresh_policy"] == {"policy": "fixed", "skip_unchanged": False, "interval": 2}
    assert summary["settings"]["fusion_mode"] == "paired" and summary["settings"]["split"] == [1, 3, 2]


def test_stop_strings_truncate_the_output(adapter_lm):
    full = adapter_lm.generate_until(requests())
    n, text = max(enumerate(full), key=lambda item: len(item[1]))
    words = text.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    cut = adapter_lm.generate_until(requests(until=["zzz-not-there", stop]))
    assert cut[n] == text[:text.index(stop)] and stop not in cut[n]
    assert [c for m, c in enumerate(cut) if m != n] == [truncate_at_stops(f, [stop])[0] for m, f in enumerate(full)
                                                         if m != n]
    assert adapter_lm.request_stats[-3:][[s.doc_id for s in adapter_lm.request_stats[-3:]].index(n)].stop == "until"


@pytest.mark.slow
def test_same_seed_same_text_other_seed_other_text(base_dir):
    first = base_lm(base_dir, seed=5).generate_until(requests())
    assert base_lm(base_dir, seed=5).generate_until(requests()) == first
    assert base_lm(base_dir, seed=6).generate_until(requests()) != first


@pytest.mark.slow
def test_a_request_alone_or_in_a_run_gives_the_same_text(base_dir):
    lm = base_lm(base_dir, batch_size=1)
    together = lm.generate_until(requests())
    alone = lm.generate_until(requests(PROMPTS[1:2]))
    assert alone == together[1:2]
    assert batch_seed(0, ["a"]) != batch_seed(1, ["a"]) and batch_seed(0, ["a", "b"]) != batch_seed(0, ["ab"])


def test_max_gen_toks_and_budget_groups(base_dir):
    lm = base_lm(base_dir, batch_size=4)
    reqs = requests(max_gen_toks=5)[:2] + requests(max_gen_toks=11)[2:]
    lm.generate_until(reqs)
    assert [b.max_new_tokens for b in lm.batch_stats] == [5, 11]  # one budget per batch
    by_doc = {s.doc_id: s for s in lm.request_stats}
    assert by_doc[0].generated_tokens <= 5 and by_doc[2].generated_tokens <= 11
    assert all(s.stop == "length" for s in lm.request_stats if s.generated_tokens in (5, 11))


@pytest.mark.slow
def test_naive_reuse_and_refresh_policies(base_dir):
    naive = base_lm(base_dir, naive=True, K=3)
    naive.generate_until(requests(PROMPTS[:1], max_gen_toks=8))
    assert naive.summary()["settings"]["fusion_mode"] == "naive"
    assert naive.batch_stats[0].layer_calls["anchor_refreshes"] == math.ceil(STEPS / 3)
    schedule = base_lm(base_dir, refresh_policy="schedule", refresh_steps="4:1")
    texts = schedule.generate_until(requests(PROMPTS[:1], max_gen_toks=8))
    assert schedule.batch_stats[0].layer_calls["anchor_refreshes"] == 2
    short = base_lm(base_dir, K="schedule:steps=4/1")  # the short form is the same policy
    assert short.generate_until(requests(PROMPTS[:1], max_gen_toks=8)) == texts
    assert short.batch_stats[0].layer_calls == schedule.batch_stats[0].layer_calls
    adaptive = base_lm(base_dir, refresh_policy="adaptive", tau=2.0, max_interval=2)
    adaptive.generate_until(requests(PROMPTS[:1], max_gen_toks=8))
    assert adaptive.batch_stats[0].layer_calls["anchor_refreshes"] == 2  # tau > 1: every max_interval steps
    ready = TadmLM(generator=schedule.generator, seed=0)  # a ready generator with the same seed: the same text
    assert ready.generate_until(requests(PROMPTS[:1], max_gen_toks=8)) == texts


def test_one_loaded_model_serves_several_settings(adapter_lm):
    from tadm.tasks.generation import GenerationSettings
    from tadm.sampling import FixedRefresh

    loaded = adapter_lm.generator
    runs = {}
    for K, naive in ((1, False), (3, False), (3, True)):
        generator = loaded.with_settings(GenerationSettings(policy=FixedRefresh(K), steps=STEPS), naive=naive)
        lm = TadmLM(generator=generator, seed=0)
        runs[K, naive] = (lm.generate_until(requests(PROMPTS[:1], max_gen_toks=8)), lm.summary())
        assert lm.summary()["settings"]["fusion_mode"] == ("naive" if naive else "paired")
    assert runs[1, False][1]["layer_calls"]["anchor_refreshes"] == STEPS
    assert runs[3, False][1]["layer_calls"]["anchor_refreshes"] == math.ceil(STEPS / 3)
    assert loaded.model is generator.model and loaded.fusion_mode == "paired"
    with pytest.raises(ValueError, match="ready generator"):
        TadmLM(generator=loaded, base="x")


def test_entropy_bound_settings_reach_the_sampler(base_dir):
    lm = base_lm(base_dir, entropy_bound=0.3, temperature_max=0.9, temperature_min=0.5, canvas_length=4)
    settings = lm.generator.generation_kwargs(8)  # what the base's own generate is given
    assert (settings["sampler_config"].entropy_bound, settings["t_max"], settings["t_min"]) == (0.3, 0.9, 0.5)
    assert settings["max_denoising_steps"] == STEPS and lm.generator.canvas_length == 4
    lm.generate_until(requests(PROMPTS[:1], max_gen_toks=8))
    calls, stop = lm.batch_stats[0].layer_calls["denoiser_calls"], lm.request_stats[0].stop
    one_canvas = stop == "eos" and lm.request_stats[0].generated_tokens < 4
    assert calls == (STEPS if one_canvas else 2 * STEPS)  # canvases of 4 tokens
    default = TadmLM(base=str(base_dir), split="1:3", device="cpu")
    assert default.generator.steps == 48 and default.generator.options.entropy_bound == 0.1  # the paper's


def test_chat_template_has_thinking_off_and_one_bos(adapter_lm):
    prompt = adapter_lm.apply_chat_template([{"role": "user", "content": "what is it"}])
    assert prompt.startswith("<bos><start_of_turn>user") and prompt.rstrip().endswith("<start_of_turn>model")
    ids = adapter_lm.generator.encode(prompt)
    assert ids.count(adapter_lm.generator.tokenizer.bos_token_id) == 1
    assert adapter_lm.tokenizer_name and adapter_lm.chat_template(True)


def test_tadm_own_model_by_prefix_infilling(tadm_model_dir):
    lm = TadmLM(model=str(tadm_model_dir), steps=6, K=2, batch_size=2, max_gen_toks=12, device="cpu")
    texts = lm.generate_until(requests(["The jury said", "It was a", "He"], until=["\n\n"], max_gen_toks=None,
                                       do_sample=False, temperature=0.0))
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
    assert all(s.generated_tokens <= 12 and s.encoder_layer_calls == 0 for s in lm.request_stats)
    assert lm.batch_stats[0].layer_calls["anchor_refreshes"] == 3  # T = 6, K = 2
    assert lm.summary()["settings"]["sampler"] == "mdlm"
    with pytest.raises(ValueError, match="no chat template"):
        lm.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_prompt_cut_to_fit_the_canvas_is_counted_and_said_once(tadm_model_dir, caplog):
    lm = TadmLM(model=str(tadm_model_dir), steps=4, batch_size=2, max_gen_toks=60, device="cpu")  # canvas of 64
    long_prompt = "the jury said it " * 20
    with caplog.at_level("WARNING"):
        lm.generate_until(requests([long_prompt, "He"], until=[], max_gen_toks=None))
        lm.generate_until(requests([long_prompt], until=[], max_gen_toks=None))
    n = len(lm.generator.encode(long_prompt))
    by_prompt = sorted((s.prompt_tokens, s.prompt_tokens_dropped) for s in lm.request_stats)
    assert by_prompt == [(len(lm.generator.encode("He")), 0), (n, n - 4), (n, n - 4)]  # 4 = 64 - 60 kept
    assert lm.summary()["prompts_cut"] == 2
    warnings = [r.getMessage() for r in caplog.records if "lost its first" in r.getMessage()]
    assert warnings == [f"tadm model: a prompt of {n} tokens lost its first {n - 4} to fit the model's canvas beside "
                        "max_gen_toks=60; a lower --max-gen-toks keeps more of each prompt (the results count these "
                        "as prompts_cut)"]


def test_prefix_stays_fixed_under_a_remasking_sampler(tadm_model_dir, monkeypatch):
    import tadm.tasks.generation as generation

    lm = TadmLM(model=str(tadm_model_dir), steps=6, sampler="remdm-loop", device="cpu")
    gen, runs = lm.generator, []
    generate = generation.generate_canvas
    monkeypatch.setattr(generation, "generate_canvas", lambda *a, **k: runs.append(generate(*a, **k)) or runs[-1])
    prompt = gen.encode("The jury said it")
    gen.generate([prompt], 10, torch.Generator().manual_seed(0))
    final = runs[0].tokens
    assert final[0, :len(prompt)].tolist() == prompt and not bool((final == gen.model.mask_token_id).any())


def test_a_post_training_base_refuses_loglikelihood_requests(adapter_lm):
    with pytest.raises(NotImplementedError, match="answered by tadm's own models .* generation tasks"):
        adapter_lm.loglikelihood([Instance("loglikelihood", {}, ("a", " b"), 0)])
    with pytest.raises(NotImplementedError, match="loglikelihood_rolling.*answered by tadm's own models"):
        adapter_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("a",), 0)])


@pytest.mark.parametrize("args, match", [
    ({}, "exactly one of model"),
    ({"model": "tadm-tiny", "base": "x"}, "exactly one of model"),
    ({"model": "tadm-tiny", "adapter": "x"}, "apply to a post-training base"),
    ({"model": "tadm-tiny", "nope": 1}, "unknown model_args nope"),
    ({"model": "tadm-tiny", "K": 0}, "K must be an integer >= 1"),
    ({"model": "tadm-tiny", "batch_size": "x"}, "batch_size"),
    ({"model": "tadm-tiny", "refresh_policy": "schedule"}, "needs refresh_steps"),
    ({"model": "tadm-tiny", "refresh_policy": "adaptive", "K": 2}, "K=2 and refresh_policy=adaptive name two policies; give one"),
    ({"model": "tadm-tiny", "refresh_policy": "sometimes"}, "unknown refresh policy"),
    ({"base": "/nonexistent/base"}, "nonexistent"),
    ({"model": "tadm-tiny", "mc_samples": 0}, "mc_samples must be an integer >= 1"),
    ({"model": "tadm-tiny", "likelihood_steps": 0}, "likelihood_steps must be an integer >= 1"),
    ({"model": "tadm-tiny", "greedy_check": "maybe"}, "greedy_check must be true or false"),
    ({"base": "x", "mc_samples": 8}, "mc_samples=8 set.* a post-training base .* generation tasks only"),
])
def test_bad_model_args_are_clear_errors(args, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        TadmLM(device="cpu", **args)


@pytest.mark.parametrize("args, match", [
    ({"tau": 0.2}, r"tau=0.2 is a parameter of refresh_policy=adaptive, not of K=1 \(the default\); add refresh_"),
    ({"max_interval": 4}, "max_interval=4 is a parameter of refresh_policy=adaptive"),
    ({"min_interval": 2, "K": "adaptive:tau=0.3"}, "min_interval=2 .* not of K=adaptive:tau=0.3; give it inside K"),
    ({"refresh_steps": "8:4"}, "refresh_steps=8:4 is a parameter of refresh_policy=schedule"),
    ({"refresh_policy": "schedule", "refresh_steps": "8:4", "tau": 0.1},
     "tau=0.1 .* not of refresh_policy=schedule; drop tau"),
    ({"refresh_policy": "adaptive", "tau": 0.1, "refresh_steps": "8:4"}, "refresh_steps=8:4 .* drop refresh_steps"),
    ({"policy": "adaptive:tau=0.3", "K": 2}, "policy is the whole refresh policy; drop K"),
    ({"policy": "adaptive:tau=0.3", "skip_unchanged": True}, "policy is .*; drop skip_unchanged"),
    ({"canvas_length": 16}, "canvas_length=16 applies only to a post-training base"),
    ({"canvas_length": 4000}, "canvas_length=4000 applies only to a post-training base"),
    ({"self_conditioning": False}, "self_conditioning=False applies only to a post-training base"),
    ({"adaptive_stopping": True, "canvas_length": 8}, "canvas_length=8, adaptive_stopping=True apply only to"),
])
def test_model_args_that_would_be_ignored_are_refused(args, match):
    with pytest.raises(ValueError, match=f"tadm model: {match}"):
        TadmLM(model="tadm-tiny", device="cpu", **args)


def test_the_long_form_still_builds_its_policy():
    args = TadmModelArgs.from_kwargs(model="tadm-tiny", refresh_policy="adaptive", tau=0.2, min_interval=2,
                                     max_interval=4)
    assert args.build_policy().config() == parse_refresh("adaptive:tau=0.2:min_interval=2:max_interval=4").config()
    args = TadmModelArgs.from_kwargs(base="x", canvas_length=16, self_conditioning=False, adaptive_stopping=True)
    assert args.settings().canvas_length == 16 and not args.settings().self_conditioning


def test_a_model_arg_given_twice_is_refused():
    with pytest.raises(ValueError, match="model_args K given more than once"):
        TadmLM.create_from_arg_string("model=tadm-tiny,K=2,K=3", {"device": "cpu"})
    assert repeated_keys(["model=x,K=2", "K=3", "steps=4,steps=5"]) == ["K", "steps"]
    assert repeated_keys(["model=x,K=adaptive:tau=0.3"]) == []


def test_bad_models_and_sampler_options(tadm_model_dir, base_dir):
    with pytest.raises(ValueError, match="top_p"):
        TadmLM(model=str(tadm_model_dir), top_p=2.0, device="cpu")
    with pytest.raises(ValueError, match="no option.*top_p"):
        TadmLM(base=str(base_dir), split="1:3", top_p=0.9, device="cpu")
    with pytest.raises(ValueError, match="samples with 'entropy-bound'"):
        TadmLM(base=str(base_dir), split="1:3", sampler="mdlm", device="cpu")
    with pytest.raises(ValueError, match=r"tokenizer vocabulary \(320\) != model vocabulary \(65\)"):
        TadmLM(model="tadm-tiny", tokenizer=str(tadm_model_dir), device="cpu")  # a builder name


def test_lm_eval_construction_merges_its_own_settings(base_dir):
    lm = TadmLM.create_from_arg_string(f"base={base_dir},split=1:3,steps=2,seed=3",
                                       {"batch_size": "auto", "max_batch_size": 3, "device": "cuda:0"})
    assert lm.batch_size == 3 and lm.args.seed == 3 and str(lm.generator.device) == "cpu"
    lm = TadmLM.create_from_arg_obj({"base": str(base_dir), "split": "1:3", "device": "cpu"}, {"batch_size": 2})
    assert lm.batch_size == 2


def test_stop_string_helpers():
    assert stop_strings(None) == [] and stop_strings("x") == ["x"] and stop_strings(["a", ""]) == ["a"]
    with pytest.raises(ValueError, match="until"):
        stop_strings(3)
    assert truncate_at_stops("abc. def\n\nQ:", ["Q:", "\n\n"]) == ("abc. def", True)
    assert truncate_at_stops("abc", ["x"]) == ("abc", False)


def test_a_stop_string_ends_generation_early(adapter_lm):
    """A row whose text holds a stop string gets no further canvas: fewer passes, same text up to the stop."""
    prompts = [adapter_lm.generator.encode(p) for p in PROMPTS[:2]]
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    full = adapter_lm.generator.generate(prompts, 16, gen())
    early = adapter_lm.generator.generate(prompts, 16, gen(), stop=lambda row, ids: True)
    assert early.layer_calls["total"] * 2 == full.layer_calls["total"]  # one canvas of two
    for a, b in zip(early.tokens, full.tokens):
        assert a == b[:len(a)] and len(a) <= 8


def test_a_missing_tokenizer_names_the_model_argument():
    with pytest.raises(FileNotFoundError) as info:
        TadmLM(model="tadm-tiny", device="cpu")
    assert str(info.value) == ("no tokenizer found for model 'tadm-tiny': give its tokenizer directory in the model "
                               "arguments (tokenizer=DIR)")


class _Task:
    def __init__(self, output_type):
        self.OUTPUT_TYPE = output_type


def test_tasks_the_model_does_not_answer_are_named_before_any_request():
    from tadm.tasks.lm_eval_cli import refuse_unanswered_tasks

    refuse_unanswered_tasks({"gsm8k": _Task("generate_until")})  # generation only: nothing to say
    mixed = {"gsm8k": _Task("generate_until"), "arc": _Task("multiple_choice"), "wiki": _Task("loglikelihood_rolling")}
    with pytest.raises(NotImplementedError, match=r"^tadm model: tasks 'arc' \(output_type multiple_choice\), 'wiki' "
                                                  r"\(output_type loglikelihood_rolling\) need log-likelihoods"):
        refuse_unanswered_tasks(mixed)  # a post-training base (no model, or a block generator)
    own = type("LM", (), {"generator": type("G", (), {"kind": "tadm"})()})()
    refuse_unanswered_tasks(mixed, own)  # tadm's own models answer log-likelihood tasks


def test_the_cost_table_shows_the_refresh_policy_tokens_per_second_and_layer_calls():
    from tadm.tasks.stats import BatchStats, RequestStats, summarize, summary_table

    calls = {"shared": 8, "anchor": 24, "denoiser": 16, "total": 48, "anchor_refreshes": 2}
    batch = BatchStats(index=0, size=2, max_new_tokens=8, seed=0, seconds=2.0, generated_tokens=10, layer_calls=calls)
    reqs = [RequestStats(task="t", doc_id=n, batch=0, batch_size=2, prompt_tokens=3, generated_tokens=5, seconds=2.0,
                         layer_calls=calls, encoder_layer_calls=0, decoder_forward_passes=8, stop="eos")
            for n in range(2)]
    for config, label in (({"policy": "fixed", "interval": 4}, "K=4"), ({"policy": "adaptive", "tau": 0.3},
                                                                        "adaptive tau=0.3")):
        table = summary_table({**summarize(reqs, [batch]), "settings": {"refresh_policy": config}}).splitlines()
        assert table[0] == ("|refresh|requests|generated tokens|seconds|tokens/s|layer calls|per request|"
                            "shared / anchor / denoiser|anchor refreshes|")
        assert table[2] == f"|{label}|2|10|2.0|5.0|48|48|8 / 24 / 16|2|"
