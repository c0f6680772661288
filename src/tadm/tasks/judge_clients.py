"""Chat models that answer the degeneration judge: an OpenAI-compatible endpoint or a local causal LM.

Both take chat messages (``[{"role": "user", "content": ...}]``) and return the answer's text, and
have a ``judge_id`` that names the judge in cache keys.

* :class:`OpenAIChatClient` - ``POST {base_url}/chat/completions`` of any server speaking that protocol
  (OpenAI, vLLM, SGLang, llama.cpp, ...), greedy (temperature 0), with retries; standard library only.
* :class:`LocalChatClient` - a ``transformers`` causal LM directory, loaded without running code
  shipped with it and prompted through its chat template. The offline default is
  SmolLM2-135M-Instruct as prepared by ``tadm eval prepare-evaluator``. Two ways to answer:

  - ``decoding="labels"`` (``local:PATH``, the default): the answer is the verdict JSON with each
    label chosen by the model's likelihood. After the chat prompt the text ``{"incoherent": `` is
    fixed, ``true``, ``false`` and ``null`` are scored (sum of the log-probabilities of their tokens)
    and the best one is written; then ``, "repetition_loop": `` and the same choice. Small models that
    do not follow the prompt's output format (SmolLM2-135M answers the question instead) still give a
    verdict that parses, and its ``brief_reason`` records the scores. This is constrained decoding, not
    a judgement of its quality: how well a small model's choices agree with degeneration is a matter of
    measurement (``scripts/judge_agreement.py``);
  - ``decoding="free"`` (``local-free:PATH``): greedy free text, parsed like an endpoint's answer.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Protocol

import torch

from tadm.eval.evaluator import default_evaluator_path

__all__ = ["LABEL_CHOICES", "LOCAL_DECODINGS", "ChatClient", "JudgeRequestError", "LocalChatClient",
           "OpenAIChatClient", "make_judge_client"]

Messages = list[dict[str, str]]


class JudgeRequestError(RuntimeError):
    """A judge request that failed for good (after retries, or with a non-retryable HTTP status)."""


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ChatClient(Protocol):
    """Anything that answers chat messages with text."""

    judge_id: str

    def complete(self, messages: Messages) -> str: ...


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _content(payload: bytes) -> str:
    """``choices[0].message.content`` of a chat-completions response body."""
    try:
        content = json.loads(payload)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise _Retryable(f"malformed chat-completions response: {payload[:200]!r}") from None
    return content if isinstance(content, str) else json.dumps(content)


class OpenAIChatClient:
    """A chat-completions endpoint at ``base_url`` (e.g. ``http://localhost:8000/v1``) serving ``model``.

    Args:
        api_key_env: environment variable holding the API key (sent as a Bearer token when set).
        timeout: seconds per request (connect and read).
        max_attempts: tries per request (>= 1) on connection errors, timeouts, HTTP 429 and 5xx; waits
            ``backoff * 2**(n-1)`` seconds (at most ``max_backoff``) between them, or what the server's
            ``Retry-After`` asks, if shorter than ``max_backoff``.
        max_tokens: the answer's token budget.
    """

    def __init__(self, base_url: str, model: str, *, api_key_env: str = "OPENAI_API_KEY", timeout: float = 60.0,
                 max_attempts: int = 4, backoff: float = 1.0, max_backoff: float = 30.0, max_tokens: int = 512,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not base_url or not model:
            raise ValueError("an OpenAI-compatible judge needs a base URL (--judge URL) and a model (--judge-model)")
        if int(max_attempts) < 1 or float(timeout) <= 0:
            raise ValueError(f"max_attempts must be >= 1 and timeout > 0, got {max_attempts!r}, {timeout!r}")
        url = base_url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model, self.api_key_env, self.timeout = model, api_key_env, float(timeout)
        self.max_attempts, self.backoff, self.max_backoff = int(max_attempts), float(backoff), float(max_backoff)
        self.max_tokens, self.sleep = int(max_tokens), sleep
        self.judge_id = f"openai:{self.url}:{model}"

    def _post(self, body: bytes) -> str:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(self.api_key_env)  # read at each request, so a key set later is used
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return _content(response.read())
        except urllib.error.HTTPError as err:
            if err.code == 429 or err.code >= 500:
                raise _Retryable(f"HTTP {err.code}", _retry_after(err.headers.get("Retry-After"))) from None
            hint = f" (is ${self.api_key_env} set?)" if err.code in (401, 403) else ""
            detail = err.read()[:200].decode("utf-8", "replace")
            raise JudgeRequestError(f"judge {self.url}: HTTP {err.code}{hint}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise _Retryable(f"{type(reason).__name__}: {reason}") from None

    def complete(self, messages: Messages) -> str:
        """The model's answer to ``messages``; JudgeRequestError after ``max_attempts`` failed tries."""
        body = json.dumps({"model": self.model, "messages": messages, "temperature": 0.0,
                           "max_tokens": self.max_tokens}).encode("utf-8")
        for attempt in range(1, self.max_attempts + 1):
            try:
                return self._post(body)
            except _Retryable as err:
                if attempt == self.max_attempts:
                    raise JudgeRequestError(f"judge {self.url} failed after {attempt} attempt(s): {err}") from None
                backoff = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                self.sleep(min(err.retry_after, self.max_backoff) if err.retry_after is not None else backoff)
        raise AssertionError("unreachable")


LOCAL_DECODINGS = ("labels", "free")
LABEL_CHOICES = ("true", "false", "null")


def _shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` have in common."""
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class LocalChatClient:
    """A local ``transformers`` causal LM directory answering through its chat template.

    Args:
        decoding: ``"labels"`` (each verdict label chosen by likelihood among true / false / null, see
            the module docstring) or ``"free"`` (greedy free text of up to ``max_new_tokens``).

    Requests are served one at a time (a lock), whatever the judge's concurrency.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_new_tokens: int = 256, device: str = "cpu",
                 decoding: str = "labels") -> None:
        if decoding not in LOCAL_DECODINGS:
            raise ValueError(f"unknown local judge decoding {decoding!r}; valid: {', '.join(LOCAL_DECODINGS)}")
        # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"local judge {str(path)!r} is not a Hugging Face model directory "
                                    "(no config.json); run `tadm eval prepare-evaluator` for the default "
                                    "SmolLM2-135M-Instruct")
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"local judge {str(path)!r}: its tokenizer has no chat template")
        self.model = AutoModelForCausalLM.from_pretrained(str(directory), trust_remote_code=False).to(device).eval()
        self.max_new_tokens, self.device, self.decoding = int(max_new_tokens), device, decoding
        self.judge_id = f"local:{directory.resolve()}" if decoding == "free" else f"local-labels:{directory.resolve()}"
        self._lock = threading.Lock()
        self._cache: Any = None  # key/value cache of the last sequence scored (labels decoding)
        self._cached_ids: list[int] = []

    def complete(self, messages: Messages) -> str:
        """The answer to ``messages``: a verdict JSON with scored labels, or free text."""
        with self._lock:
            return self._labels(messages) if self.decoding == "labels" else self._free(messages)

    def continuation_logprob(self, text: str, continuation: str) -> float:
        """log p(continuation | text) under the model: the sum over the tokens of ``text + continuation``
        after the longest run of ids it shares with ``text`` alone (so a merge across the boundary is scored).

        The key/value cache of the last sequence scored is kept: a new one that shares its first tokens
        (the chat prompt, for the three choices of a label and for the next label) runs only the rest.
        """
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        full = self.tokenizer(text + continuation, add_special_tokens=False)["input_ids"]
        return self._logprob(full, max(_shared_prefix(ids, full), 1))

    def _logprob(self, full: list[int], start: int) -> float:
        """Sum of log p(full[n] | full[:n]) for n >= start, reusing the cached prefix of ``full``."""
        # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
        from transformers import DynamicCache

        keep = min(_shared_prefix(self._cached_ids, full), start - 1)
        if keep == 0 or self._cache is None:
            self._cache, keep = DynamicCache(), 0
        elif self._cache.get_seq_length() > keep:
            self._cache.crop(keep - self._cache.get_seq_length())  # a negative count removes that many
        with torch.no_grad():
            logits = self.model(torch.tensor([full[keep:]], device=self.device), past_key_values=self._cache,
                                use_cache=True).logits[0].float()
        self._cached_ids = list(full)
        logprobs = torch.log_softmax(logits[start - 1 - keep:-1], dim=-1)  # row r predicts token start + r
        targets = torch.tensor(full[start:], device=self.device)
        return float(logprobs.gather(-1, targets[:, None]).sum())

    def _labels(self, messages: Messages) -> str:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        answer, reasons = "{", []
        for n, label in enumerate(("incoherent", "repetition_loop")):
            answer += f'{", " if n else ""}"{label}": '
            scores = {choice: self.continuation_logprob(text + answer, choice) for choice in LABEL_CHOICES}
            best = max(LABEL_CHOICES, key=lambda choice: scores[choice])
            answer += best
            reasons.append(f"{label} " + " ".join(f"{c} {scores[c]:.3f}" for c in LABEL_CHOICES))
        reason = "labels chosen by log-likelihood: " + "; ".join(reasons)
        return answer + ', "evidence": [], "brief_reason": ' + json.dumps(reason) + "}"

    def _free(self, messages: Messages) -> str:
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)
        inputs = {k: v.to(self.device) for k, v in encoded.items()}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False,
                                      temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        return self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def make_judge_client(judge: str | None = None, *, url: str | None = None, model: str | None = None,
                      **options: Any) -> ChatClient:
    """The judge named on the command line.

    ``judge="local:PATH"`` is a local model with scored labels, ``"local-free:PATH"`` the same model
    answering in free text; ``judge=None``, ``"local"`` or ``"local-free"`` without ``url`` is the
    prepared SmolLM2-135M-Instruct (:func:`tadm.eval.evaluator.default_evaluator_path`); ``url`` with
    ``model`` is an OpenAI-compatible endpoint. ``options`` go to the client (timeout, max_attempts,
    api_key_env, ... or max_new_tokens, device).
    """
    if judge is not None and judge.startswith(("local:", "local-free:")):
        kind, path = judge.split(":", 1)
    elif url is not None:
        if judge not in (None, "openai"):
            raise ValueError(f"give --judge local:PATH or --judge URL with --judge-model, not both ({judge!r})")
        return OpenAIChatClient(url, model or "", **options)
    elif judge in (None, "local", "local-free"):
        kind, path = judge or "local", default_evaluator_path()
    else:
        raise ValueError(f"unknown judge {judge!r}: use none, local, local:PATH, local-free:PATH, or an "
                         "http(s):// URL with --judge-model NAME")
    return LocalChatClient(path, **{"decoding": "free" if kind == "local-free" else "labels", **options})
