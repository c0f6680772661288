"""The ``tadm`` model of EleutherAI's lm-evaluation-harness: tasks on tadm's diffusion LMs.

Importing this module registers :class:`TadmLM` as ``tadm`` in lm-eval's model registry (the command
line: :mod:`tadm.tasks.lm_eval_cli`); from Python, ``import tadm.tasks.lm_eval_model`` before
``lm_eval.simple_evaluate(model="tadm", ...)``. Its settings (model or base + adapter, refresh policy,
sampler; paper: canvas 256, 48 steps) are :class:`~tadm.tasks.model_args.TadmModelArgs`.
``generate_until`` requests are answered by both kinds of model (the paper's post-training benchmarks
are all generation tasks); ``loglikelihood`` and ``loglikelihood_rolling`` requests (multiple-choice,
likelihood and perplexity tasks) by tadm's own models (``model=...``) with Monte-Carlo estimates of
tadm's likelihood bounds at the run's K (:mod:`tadm.tasks.likelihood`). Per-request tokens, wall time,
tokens/s and layer calls are kept in :attr:`TadmLM.request_stats` and :attr:`TadmLM.likelihood_stats`
and summed by :meth:`TadmLM.summary`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from tadm.tasks.likelihood import LikelihoodScorer, LikelihoodStats
from tadm.tasks.model_args import TadmModelArgs, parse_batch_size, repeated_keys
from tadm.tasks.stats import BatchStats, RequestStats, summarize, summarize_likelihood

__all__ = ["TadmLM", "batch_seed", "stop_strings", "truncate_at_stops"]

log = logging.getLogger(__name__)


def stop_strings(until: Any) -> list[str]:
    """lm-eval's ``until`` (None, a string or a list of strings) as a list of non-empty strings."""
    if until is None:
        return []
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
        raise ValueError(f"generate_until: 'until' must be a string or a list of strings, got {until!r}")
    return [s for s in until if s]


def truncate_at_stops(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest occurrence of any stop string; and whether one occurred."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def batch_seed(seed: int, contexts: list[str]) -> int:
    """The generator seed of one batch: a hash of the run's ``seed`` and the batch's prompts.

    A batch's output therefore depends only on the seed, its prompts and the settings, not on
    which batches ran before it (a resumed or ``--limit``-ed run reproduces the same texts).
    """
    digest = hashlib.sha256(str(int(seed)).encode())
    for text in contexts:
        digest.update(b"\x00" + text.encode("utf-8"))
    return int(digest.hexdigest()[:15], 16)


@dataclass
class _Job:
    """A parsed ``generate_until`` request."""

    index: int
    request: Any
    context: str
    ids: list[int]
    until: list[str]
    max_gen_toks: int


@register_model("tadm")
class TadmLM(LM):
    """lm-eval model over a tadm generator (:mod:`tadm.tasks.generation`).

    Args:
        generator: a ready :class:`~tadm.tasks.generation.BlockGenerator` or
            :class:`~tadm.tasks.generation.PrefixGenerator` (Python only); then ``model_args`` hold
            only run settings (seed, batch_size, max_gen_toks, thinking).
        **model_args: :class:`~tadm.tasks.model_args.TadmModelArgs` (what ``--model_args`` gives).
    """

    def __init__(self, generator: Any = None, **model_args: Any) -> None:
        super().__init__()
        self.args = TadmModelArgs.from_kwargs(require_model=generator is None, **model_args)
        self.generator = generator if generator is not None else self.args.load_generator()
        self._device = self.generator.device
        self.batch_size = parse_batch_size(self.args.batch_size, self.args.max_batch_size)
        self.request_stats: list[RequestStats] = []
        self.batch_stats: list[BatchStats] = []
        self.likelihood_stats: list[LikelihoodStats] = []
        self._scorer: LikelihoodScorer | None = None
        self._warned_gen_kwargs = False
        self._warned_prompt_cut = False

    # ------------------------------------------------------------------ construction by lm-eval
    @staticmethod
    def _merged(model_args: dict[str, Any], additional: dict[str, Any] | None) -> dict[str, Any]:
        """``model_args`` over lm-eval's own settings (batch_size, device, ...), which may repeat keys.

        lm-eval's CLI always passes ``device`` (default ``cuda:0``); without CUDA that default falls
        back to the CPU with a warning, while a device named in ``model_args`` is used as given.
        """
        extra = {key: value for key, value in (additional or {}).items() if value is not None}
        device = extra.get("device")
        if "device" not in model_args and str(device).startswith("cuda") and not torch.cuda.is_available():
            log.warning("tadm model: device %r is not available; using the CPU", device)
            extra["device"] = "cpu"
        return {**extra, **model_args}

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> TadmLM:
        # deferred: lm-eval is an optional dependency (the tasks extra)
        from lm_eval.utils import simple_parse_args_string

        repeated = repeated_keys([arg_string or ""])
        if repeated:
            raise ValueError(f"tadm model: model_args {', '.join(repeated)} given more than once; give each once")
        return cls(**cls._merged(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> TadmLM:
        return cls(**cls._merged(dict(arg_dict), additional_config))

    # ------------------------------------------------------------------ log-likelihood
    def likelihood_scorer(self) -> LikelihoodScorer:
        """The scorer of log-likelihood requests (built on first use); a post-training base has none."""
        if self._scorer is None:
            if getattr(self.generator, "kind", None) != "tadm":
                raise NotImplementedError(
                    "tadm model: log-likelihood requests (output_type loglikelihood, multiple_choice or "
                    "loglikelihood_rolling) are answered by tadm's own models (model=...); a post-training base "
                    "(base=...) answers generation tasks (output_type: generate_until) only")
            self._scorer = LikelihoodScorer(self.generator, mc_samples=self.args.mc_samples,
                                            likelihood_steps=self.args.likelihood_steps, seed=self.args.seed,
                                            batch_size=self.batch_size, greedy_check=bool(self.args.greedy_check))
        return self._scorer

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p estimate, is_greedy) of each request's continuation after its context (tadm.tasks.likelihood)."""
        scorer = self.likelihood_scorer()
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="tadm loglikelihood"):
            context, continuation = request.args
            ll, greedy, stats = scorer.score(context, continuation, task=getattr(request, "task_name", None),
                                             doc_id=getattr(request, "doc_id", None))
            self.likelihood_stats.append(stats)
            results.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, (ll, greedy))
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """log p estimate of each request's whole text, over lm-eval's disjoint rolling windows."""
        scorer = self.likelihood_scorer()
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="tadm loglikelihood_rolling"):
            (text,) = request.args[:1]
            ll, stats = scorer.score_rolling(text, task=getattr(request, "task_name", None),
                                             doc_id=getattr(request, "doc_id", None))
            self.likelihood_stats.extend(stats)
            results.append(ll)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, ll)
        return results

    # ------------------------------------------------------------------ chat template
    def _chat_tokenizer(self) -> Any:
        tokenizer = getattr(self.generator, "tokenizer", None)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"tadm model {self.generator.name!r}: its tokenizer has no chat template; run without "
                             "--apply_chat_template")
        return tokenizer

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat as one prompt string, thinking mode off unless ``thinking=true`` (paper: no-think)."""
        return self._chat_tokenizer().apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            enable_thinking=bool(self.args.thinking))

    @property
    def tokenizer_name(self) -> str:
        tokenizer = getattr(self.generator, "tokenizer", None)
        return str(getattr(tokenizer, "name_or_path", "") or self.generator.name).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._chat_tokenizer().chat_template if chat_template else None

    # ------------------------------------------------------------------ generation
    def _job(self, index: int, request: Any) -> _Job:
        context, gen_kwargs = request.args
        kwargs = dict(gen_kwargs or {})
        until = stop_strings(kwargs.pop("until", None))
        budget = int(kwargs.pop("max_gen_toks", self.args.max_gen_toks))
        ignored = sorted(kwargs)  # do_sample, temperature, ...: the diffusion sampler decides
        if ignored and not self._warned_gen_kwargs:
            self._warned_gen_kwargs = True
            log.warning(f"tadm model: generation kwargs {ignored} are ignored; the diffusion sampler's settings "
                        "come from --model_args")
        return _Job(index, request, context, self.generator.encode(context), until, budget)

    def _batches(self, jobs: list[_Job]) -> list[list[_Job]]:
        """Jobs grouped by token budget, longest prompts first, in batches of ``batch_size``."""
        ordered = sorted(jobs, key=lambda j: (j.max_gen_toks, -len(j.ids), j.index))
        groups = [list(group) for _, group in itertools.groupby(ordered, key=lambda j: j.max_gen_toks)]
        return [group[n:n + self.batch_size] for group in groups for n in range(0, len(group), self.batch_size)]

    def _run_batch(self, batch: list[_Job]) -> list[str]:
        seed = batch_seed(self.args.seed, [job.context for job in batch])
        generator = torch.Generator(device=self.generator.device).manual_seed(seed)
        budget = batch[0].max_gen_toks
        out = self.generator.generate([job.ids for job in batch], budget, generator, stop=self._stop(batch))
        stats = BatchStats(index=len(self.batch_stats), size=len(batch), max_new_tokens=budget, seed=seed,
                           seconds=out.seconds, generated_tokens=sum(len(t) for t in out.tokens),
                           layer_calls=out.layer_calls, encoder_layer_calls=out.encoder_layer_calls)
        self.batch_stats.append(stats)
        texts, passes, dropped = [], out.decoder_forward_passes, out.prompt_tokens_dropped or [0] * len(batch)
        if any(dropped) and not self._warned_prompt_cut:
            self._warned_prompt_cut = True
            worst = dropped.index(max(dropped))
            log.warning(f"tadm model: a prompt of {len(batch[worst].ids)} tokens lost its first {dropped[worst]} to "
                        f"fit the model's canvas beside max_gen_toks={budget}; a lower --max-gen-toks keeps more of "
                        "each prompt (the results count these as prompts_cut)")
        for row, job in enumerate(batch):
            text, cut = truncate_at_stops(self.generator.decode(out.tokens[row]), job.until)
            texts.append(text)
            self.request_stats.append(RequestStats(
                task=getattr(job.request, "task_name", None), doc_id=getattr(job.request, "doc_id", None),
                batch=stats.index, batch_size=stats.size, prompt_tokens=len(job.ids),
                generated_tokens=len(out.tokens[row]), seconds=out.seconds, layer_calls=dict(out.layer_calls),
                encoder_layer_calls=out.encoder_layer_calls, decoder_forward_passes=int(passes[row]) if passes else 0,
                stop="until" if cut else ("eos" if out.ended[row] else "length"),
                prompt_tokens_dropped=int(dropped[row])))
        return texts

    def _stop(self, batch: list[_Job]) -> Any:
        """(row, ids) -> whether the row's text already holds one of its ``until`` strings (None: none has any)."""
        if not any(job.until for job in batch):
            return None
        return lambda row, ids: bool(batch[row].until) and truncate_at_stops(
            self.generator.decode(ids), batch[row].until)[1]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each request's context, cut at its ``until`` strings and ``max_gen_toks``."""
        jobs = [self._job(n, request) for n, request in enumerate(requests)]
        results: list[str] = [""] * len(jobs)
        for batch in tqdm(self._batches(jobs), disable=disable_tqdm, desc="tadm generate_until"):
            for job, text in zip(batch, self._run_batch(batch)):
                results[job.index] = text
                self.cache_hook.add_partial("generate_until", job.request.args, text)
        return results

    # ------------------------------------------------------------------ accounting
    def summary(self) -> dict[str, Any]:
        """Totals of every request answered so far (:func:`tadm.tasks.stats.summarize`) and the settings; with
        log-likelihood requests answered, their totals under ``"loglikelihood"``
        (:func:`tadm.tasks.stats.summarize_likelihood`: tokens, wall time, tokens/s, passes and layer calls at K)."""
        out = {**summarize(self.request_stats, self.batch_stats), "settings": self.generator.describe(),
               "seed": self.args.seed, "batch_size": self.batch_size}
        if self.likelihood_stats:
            assert self._scorer is not None
            out["loglikelihood"] = {**summarize_likelihood(self.likelihood_stats), **self._scorer.describe()}
        return out

    def reset_stats(self) -> None:
        """Forget the recorded requests and batches (e.g. between tasks)."""
        self.request_stats.clear()
        self.batch_stats.clear()
        self.likelihood_stats.clear()
