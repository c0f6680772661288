"""The degeneration judge against a loopback chat-completions server started here, and a tiny local model.

The fake server answers according to a marker in the judged response: a verdict, HTTP 500 or 429
before succeeding, a malformed verdict or body, a slow answer (timeouts), or 401.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tadm.tasks.judge import (PROMPT_FILE, DegenerationJudge, JudgeError, judge_messages, load_judge_prompt,
                              make_judge_client)
from tadm.tasks.judge_clients import LABEL_CHOICES, JudgeRequestError, LocalChatClient, OpenAIChatClient
from tadm.tasks.verdict import parse_verdict

CLEAN = {"incoherent": False, "repetition_loop": False, "evidence": [], "brief_reason": "fine"}
LOOP = {"incoherent": False, "repetition_loop": True, "evidence": ["a a a"], "brief_reason": "loops"}


class FakeChatServer:
    """A chat-completions server on 127.0.0.1; ``behaviour(response_text, attempt)`` -> (status, body, delay)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.attempts: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.released = threading.Event()  # set at close: a reply held "forever" (delay HELD) goes out then
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.record(self.path, dict(self.headers), body)
                status, payload, delay, headers = server.answer(body["messages"][-1]["content"])
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                counted = True
                try:
                    if delay == HELD:
                        server.released.wait(60)
                    else:
                        time.sleep(delay)
                    with server.lock:  # before the reply: a client that got it may send its next request at once
                        server.in_flight -= 1
                        counted = False
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass
                finally:
                    if counted:
                        with server.lock:
                            server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def record(self, path, headers, body):
        with self.lock:
            self.requests.append({"path": path, "headers": headers, "body": body})

    def answer(self, content: str):
        response = content.split("<response>\n", 1)[1].split("\n</response>", 1)[0]
        with self.lock:
            attempt = self.attempts[response] = self.attempts.get(response, 0) + 1
        return behaviour(response, attempt)

    def close(self):
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def chat_body(text: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}).encode()


# A slow answer is held until the test ends, so that the client's time-out always expires first, while the other
# answers come back long before it (5 s): no outcome depends on how fast a loaded machine answers.
HELD = float("inf")


def behaviour(response: str, attempt: int):
    """(status, body, delay seconds, headers) for the n-th request about ``response``."""
    ok = (200, chat_body(json.dumps(LOOP if "loop" in response else CLEAN)), 0.0, {})
    if response.startswith("fail500") and attempt <= 2:
        return 500, b'{"error": "boom"}', 0.0, {}
    if response.startswith("busy429") and attempt == 1:
        return 429, b'{"error": "slow down"}', 0.0, {"Retry-After": "0.25"}
    if response.startswith("garbled"):
        return 200, chat_body("Sure! The response is {incoherent: maybe"), 0.0, {}
    if response.startswith("notchat"):
        return 200, b'{"unexpected": true}', 0.0, {}
    if response.startswith("slow-once") and attempt == 1:
        return 200, ok[1], HELD, {}
    if response.startswith("always-slow"):
        return 200, ok[1], HELD, {}
    if response.startswith("unauthorised"):
        return 401, b'{"error": "bad key"}', 0.0, {}
    if response.startswith("sleepy"):
        return 200, ok[1], 0.15, {}
    return ok


@pytest.fixture
def server():
    fake = FakeChatServer()
    yield fake
    fake.close()


def client(server, **options):
    delays: list[float] = []
    options = {"timeout": 5.0, "max_attempts": 3, "sleep": delays.append, **options}
    return OpenAIChatClient(server.url, "judge-model", **options), delays


def test_prompt_file_is_the_papers_without_its_header():
    text = load_judge_prompt()
    assert PROMPT_FILE.is_file() and "Generation corruption Evaluation Prompt" in PROMPT_FILE.read_text()
    assert text.startswith("You are evaluating generation degeneration, NOT answer correctness.")
    assert text.endswith('- "brief_reason": a short explanation') and "#" not in text.splitlines()[0]
    messages = judge_messages("What is 2+2?", "4")
    assert messages[0]["role"] == "user" and messages[0]["content"].startswith(text)
    assert "<question>\nWhat is 2+2?\n</question>" in messages[0]["content"]


@pytest.mark.slow
def test_valid_verdicts_and_the_request(server, monkeypatch, tmp_path):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test")
    judge = DegenerationJudge(client(server, api_key_env="MY_JUDGE_KEY")[0], cache_dir=tmp_path)
    result = judge.evaluate([("q1", "a fine answer"), ("q2", "loop loop loop")])
    assert [v.outcome for v in result.verdicts] == ["clean", "corrupted"]
    assert result.summary.corruption == 0.5 and result.summary.unparsed == 0 and result.requests == 2
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["headers"]["Authorization"] == "Bearer sk-test"
    assert request["body"]["model"] == "judge-model" and request["body"]["temperature"] == 0.0


@pytest.mark.slow
def test_http_500_is_retried_with_exponential_backoff(server):
    judge_client, delays = client(server, backoff=0.5)
    verdicts = DegenerationJudge(judge_client).judge([("q", "fail500 then fine")])
    assert verdicts[0].outcome == "clean" and server.attempts["fail500 then fine"] == 3 and delays == [0.5, 1.0]


@pytest.mark.slow
def test_429_waits_as_retry_after_asks(server):
    judge_client, delays = client(server)
    assert DegenerationJudge(judge_client).judge([("q", "busy429 loop")])[0].outcome == "corrupted"
    assert delays == [0.25]


@pytest.mark.slow
def test_a_malformed_verdict_is_counted_unparsed(server):
    result = DegenerationJudge(client(server)[0]).evaluate([("q", "garbled"), ("q", "fine")])
    assert [v.outcome for v in result.verdicts] == ["unparsed", "clean"]
    assert result.summary.unparsed == 1 and result.summary.parsed == 1 and result.summary.corruption == 0.0
    assert "maybe" in result.verdicts[0].raw


@pytest.mark.slow
def test_a_malformed_response_body_is_retried_then_an_error(server):
    judge_client, delays = client(server, max_attempts=2)
    with pytest.raises(JudgeError, match="malformed chat-completions response"):
        DegenerationJudge(judge_client).judge([("q", "notchat")])
    assert server.attempts["notchat"] == 2 and len(delays) == 1


@pytest.mark.slow
def test_a_timeout_is_retried(server):
    judge_client, delays = client(server)
    assert DegenerationJudge(judge_client).judge([("q", "slow-once")])[0].outcome == "clean"
    assert server.attempts["slow-once"] == 2 and len(delays) == 1


@pytest.mark.slow
def test_timeouts_stop_the_run_and_finished_work_resumes_from_the_cache(server, tmp_path):
    judge_client, _ = client(server, max_attempts=2)
    pairs = [("q", "fine one"), ("q", "always-slow"), ("q", "loop two")]
    with pytest.raises(JudgeError, match=r"timed out.*1 of 3 new verdicts finished; answers are cached in "
                                         r".*verdicts.jsonl, rerun to resume"):
        DegenerationJudge(judge_client, cache_dir=tmp_path, concurrency=1).judge(pairs)
    assert server.attempts == {"fine one": 1, "always-slow": 2}  # the run stopped before "loop two"
    resumed = DegenerationJudge(judge_client, cache_dir=tmp_path).evaluate([pairs[0], pairs[2]])
    assert resumed.requests == 1 and server.attempts["fine one"] == 1
    assert [v.outcome for v in resumed.verdicts] == ["clean", "corrupted"]


@pytest.mark.slow
def test_cached_verdicts_are_not_requested_again(server, tmp_path):
    pairs = [("q", f"answer {n}") for n in range(4)] + [("q", "loop x")]
    first = DegenerationJudge(client(server)[0], cache_dir=tmp_path).evaluate(pairs)
    assert first.requests == 5 and len(server.requests) == 5
    with (tmp_path / "verdicts.jsonl").open("a") as cache:
        cache.write('{"key": "cut short')  # an interrupted write
    second = DegenerationJudge(client(server)[0], cache_dir=tmp_path).evaluate(pairs)
    assert second.requests == 0 and len(server.requests) == 5
    assert [v.outcome for v in second.verdicts] == [v.outcome for v in first.verdicts]
    third = DegenerationJudge(client(server)[0], cache_dir=tmp_path).evaluate(pairs + [("q", "new one")])
    assert third.requests == 1 and len(server.requests) == 6
    other_model = OpenAIChatClient(server.url, "another-judge", sleep=lambda s: None)
    assert DegenerationJudge(other_model, cache_dir=tmp_path).evaluate(pairs[:1]).requests == 1  # key has the judge


@pytest.mark.slow
def test_concurrency_limit(server):
    pairs = [("q", f"sleepy {n}") for n in range(6)]
    DegenerationJudge(client(server)[0], concurrency=2).judge(pairs)
    assert server.max_in_flight == 2
    server.max_in_flight = 0
    DegenerationJudge(client(server)[0], concurrency=1).judge([("q", f"sleepy again {n}") for n in range(3)])
    assert server.max_in_flight == 1


@pytest.mark.slow
def test_unreachable_url_and_bad_key_are_clear_errors(server, tmp_path):
    port = server.httpd.server_address[1]
    server.close()
    unreachable, delays = client(server, max_attempts=2)
    assert unreachable.url == f"http://127.0.0.1:{port}/v1/chat/completions"
    with pytest.raises(JudgeError, match=r"failed after 2 attempt\(s\).*(Connection|refused)"):
        DegenerationJudge(unreachable, cache_dir=tmp_path).judge([("q", "anything")])
    assert len(delays) == 1


@pytest.mark.slow
def test_unauthorised_is_not_retried(server, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    judge_client, delays = client(server)
    with pytest.raises(JudgeError, match=r"HTTP 401 \(is \$OPENAI_API_KEY set\?\)"):
        DegenerationJudge(judge_client).judge([("q", "unauthorised")])
    assert delays == [] and server.attempts["unauthorised"] == 1
    with pytest.raises(JudgeRequestError):
        judge_client.complete(judge_messages("q", "unauthorised"))


def test_client_choice_and_bad_arguments(tmp_path, monkeypatch):
    assert isinstance(make_judge_client(url="http://localhost:1/v1", model="m"), OpenAIChatClient)
    with pytest.raises(ValueError, match="--judge-model"):
        make_judge_client(url="http://localhost:1/v1")
    with pytest.raises(ValueError, match="unknown judge"):
        make_judge_client("gpt")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        make_judge_client(f"local:{tmp_path / 'missing'}")
    monkeypatch.setenv("TADM_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match="prepare-evaluator"):
        make_judge_client()  # the default SmolLM2 judge, not prepared here
    with pytest.raises(ValueError, match="concurrency"):
        DegenerationJudge(make_judge_client(url="http://localhost:1/v1", model="m"), concurrency=0)


# ------------------------------------------------------------------------------------- local judge
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_local_judge(tmp_path_factory):
    """A randomly initialised tiny Llama with a word-level chat tokenizer, saved like a prepared evaluator."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "{", "}", '"incoherent":', "true", "false", "null", "the", "a"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<unk>", chat_template=CHAT_TEMPLATE)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    out = tmp_path_factory.mktemp("local-judge")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_local_judge_garbage_is_counted_unparsed(tiny_local_judge, tmp_path):
    judge_client = make_judge_client(f"local-free:{tiny_local_judge}", max_new_tokens=6)
    assert isinstance(judge_client, LocalChatClient) and judge_client.judge_id.startswith("local:")
    judge = DegenerationJudge(judge_client, cache_dir=tmp_path, concurrency=2)
    result = judge.evaluate([("what is it", "the the the the"), ("hello", "a fine answer")])
    assert result.summary.total == 2 and result.summary.unparsed == 2 and result.requests == 2
    assert all(v.raw is not None and not v.parsed for v in result.verdicts)
    again = DegenerationJudge(judge_client, cache_dir=tmp_path).evaluate([("what is it", "the the the the")])
    assert again.requests == 0 and again.verdicts[0].raw == result.verdicts[0].raw  # greedy answers, cached


def _direct_logprob(model, ids, start):
    """log p(ids[start:] | ids[:start]) by one forward pass, summed token by token."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return sum(float(torch.log_softmax(logits[n - 1], -1)[ids[n]]) for n in range(start, len(ids)))


def test_local_judge_labels_are_the_most_likely_choices_and_always_parse(tiny_local_judge, tmp_path):
    client = make_judge_client(f"local:{tiny_local_judge}")
    assert client.decoding == "labels" and client.judge_id.startswith("local-labels:")
    messages = judge_messages("what is it", "the the the the", instructions="judge a")
    text = client.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prefix = text + '{"incoherent": '
    ids = client.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    direct = {}
    for choice in LABEL_CHOICES:
        full = client.tokenizer(prefix + choice, add_special_tokens=False)["input_ids"]
        assert full[:len(ids)] == ids and len(full) == len(ids) + 1  # one word, one token
        direct[choice] = _direct_logprob(client.model, full, len(ids))
        assert client.continuation_logprob(prefix, choice) == pytest.approx(direct[choice], abs=1e-4)
    assert len(set(direct.values())) == 3  # a random model still ranks them
    # the cached prefix is reused across calls and cropped back; a different prompt starts over
    other = client.tokenizer.apply_chat_template(judge_messages("hello", "a the", "judge a"),
                                                 add_generation_prompt=True, tokenize=False) + '{"incoherent": '
    other_ids = client.tokenizer(other + "null", add_special_tokens=False)["input_ids"]
    expected = _direct_logprob(client.model, other_ids, len(other_ids) - 1)
    assert client.continuation_logprob(other, "null") == pytest.approx(expected, abs=1e-4)
    assert client.continuation_logprob(prefix, "true") == pytest.approx(direct["true"], abs=1e-4)

    raw = client.complete(messages)
    verdict = parse_verdict(raw)
    first = max(LABEL_CHOICES, key=direct.get)
    assert verdict.parsed and raw.startswith('{"incoherent": ' + first + ', "repetition_loop": ')
    assert verdict.incoherent == {"true": True, "false": False, "null": None}[first]
    second = raw.split('"repetition_loop": ')[1].split(",")[0]
    rest = prefix + first + ', "repetition_loop": '
    assert second == max(LABEL_CHOICES, key=lambda c: client.continuation_logprob(rest, c))
    assert "log-likelihood" in verdict.brief_reason and f"incoherent true {direct['true']:.3f}" in verdict.brief_reason

    judge = DegenerationJudge(client, cache_dir=tmp_path, instructions="judge a")
    result = judge.evaluate([("what is it", "the the the the"), ("hello", "a fine answer")])
    assert result.summary.unparsed == 0 and result.summary.total == 2 and result.verdicts[0].raw == raw


def test_local_judge_decoding_is_checked(tiny_local_judge):
    with pytest.raises(ValueError, match="decoding"):
        LocalChatClient(tiny_local_judge, decoding="beam")
    with pytest.raises(ValueError, match="unknown judge"):
        make_judge_client("remote")
    assert make_judge_client(f"local-free:{tiny_local_judge}").decoding == "free"
