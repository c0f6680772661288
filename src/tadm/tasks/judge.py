"""The degeneration judge: an LLM labels each (prompt, response) as incoherent and/or a repetition loop.

The paper measures corruption of the naive-reuse baseline vs TADM after post-training with an
evaluator prompt (appendix "Generation corruption Evaluation Prompt"), shipped here as
``prompts/degeneration_judge.txt``. The evaluator judges degeneration, not correctness. Each pair
is sent as one user message: the prompt's instructions, then the question and the response between
tags marking them as data. Answers are cached on disk (:class:`~tadm.tasks.verdict_cache.VerdictCache`)
as they arrive, so an interrupted run resumes; a request that fails for good stops the run with a
:class:`JudgeError` that says how many verdicts were kept.

    client = make_judge_client(url="http://localhost:8000/v1", model="Qwen/Qwen3-30B-A3B")
    result = DegenerationJudge(client, cache_dir="runs/judge").evaluate([(prompt, response), ...])
    result.summary.corruption, result.summary.null_share, result.summary.unparsed
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from tadm.tasks.judge_clients import ChatClient, JudgeRequestError, make_judge_client
from tadm.tasks.verdict import Verdict, VerdictSummary, parse_verdict, summarize_verdicts
from tadm.tasks.verdict_cache import VerdictCache, verdict_key

__all__ = ["PROMPT_FILE", "DegenerationJudge", "JudgeError", "JudgeRequestError", "JudgeResult", "judge_messages",
           "load_judge_prompt", "make_judge_client"]

PROMPT_FILE = Path(__file__).resolve().parent / "prompts" / "degeneration_judge.txt"


class JudgeError(RuntimeError):
    """Judging stopped because a request failed for good; finished verdicts are in the cache."""


def load_judge_prompt(path: str | os.PathLike[str] | None = None) -> str:
    """The evaluator prompt: ``path`` (default: the paper's, :data:`PROMPT_FILE`) less its ``#`` header lines."""
    text = Path(path or PROMPT_FILE).read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("#")).strip()


def judge_messages(prompt: str, response: str, instructions: str | None = None) -> list[dict[str, str]]:
    """The chat sent for one pair: the evaluator prompt, then the question and response as tagged data."""
    instructions = load_judge_prompt() if instructions is None else instructions
    content = (f"{instructions}\n\n<question>\n{prompt}\n</question>\n\n"
               f"<response>\n{response}\n</response>")
    return [{"role": "user", "content": content}]


@dataclass
class JudgeResult:
    """Verdicts in the order of the pairs, and their summary (corruption, null share, unparsed)."""

    verdicts: list[Verdict]
    summary: VerdictSummary
    requests: int  # requests sent in this run (the rest came from the cache)


class DegenerationJudge:
    """Labels (prompt, response) pairs with a chat client, ``concurrency`` requests at a time.

    Args:
        client: an :class:`~tadm.tasks.judge_clients.OpenAIChatClient`, a
            :class:`~tadm.tasks.judge_clients.LocalChatClient`, or anything with ``judge_id`` and
            ``complete(messages)``.
        cache_dir: where answers are cached (None: in memory only).
        concurrency: requests in flight at once (>= 1).
        instructions: the evaluator prompt (default: the paper's).
    """

    def __init__(self, client: ChatClient, *, cache_dir: str | os.PathLike[str] | None = None, concurrency: int = 4,
                 instructions: str | None = None) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        self.client, self.concurrency = client, concurrency
        self.instructions = load_judge_prompt() if instructions is None else instructions
        self.cache = VerdictCache(cache_dir) if cache_dir is not None else None
        self._answers: dict[str, str] = {}
        self.requests = 0  # requests sent by the last judge() call

    def _cached(self, key: str) -> str | None:
        if key in self._answers:
            return self._answers[key]
        return self.cache.get(key) if self.cache is not None else None

    def _ask(self, key: str, prompt: str, response: str) -> None:
        raw = self.client.complete(judge_messages(prompt, response, self.instructions))
        self._answers[key] = raw
        if self.cache is not None:
            self.cache.put(key, raw, self.client.judge_id)

    def _run(self, todo: dict[str, tuple[str, str]]) -> None:
        """Ask for every pair of ``todo``, at most ``concurrency`` at once; after a failure no new
        request starts, running ones finish (and are cached), then :class:`JudgeError` is raised."""
        pending, running, failure = iter(todo.items()), set(), None
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="judge") as pool:
            while True:
                if failure is None:
                    running |= {pool.submit(self._ask, key, *pair)
                                for key, pair in itertools.islice(pending, self.concurrency - len(running))}
                if not running:
                    break
                done, running = wait(running, return_when=FIRST_COMPLETED)
                failure = failure or next((f.exception() for f in done if f.exception() is not None), None)
        if failure is not None:
            finished = sum(key in self._answers for key in todo)
            kept = f"; answers are cached in {self.cache.path}, rerun to resume" if self.cache is not None else ""
            raise JudgeError(f"judging stopped: {failure} ({finished} of {len(todo)} new verdicts "
                             f"finished{kept})") from failure

    def judge(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        """A verdict for each (prompt, response) pair, asking only for pairs not cached."""
        keys = [verdict_key(self.client.judge_id, prompt, response) for prompt, response in pairs]
        todo = {key: (str(p), str(r)) for key, (p, r) in zip(keys, pairs) if self._cached(key) is None}
        self.requests = len(todo)
        if todo:
            self._run(todo)
        return [parse_verdict(self._cached(key) or "") for key in keys]  # every key is answered here

    def evaluate(self, pairs: Sequence[tuple[str, str]]) -> JudgeResult:
        """:meth:`judge` plus the summary: corruption, null share and unparsed count."""
        verdicts = self.judge(pairs)
        return JudgeResult(verdicts=verdicts, summary=summarize_verdicts(verdicts), requests=self.requests)

