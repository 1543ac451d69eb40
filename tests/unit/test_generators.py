"""JSON generation: the local xgrammar-constrained backend on the real SmolLM2, and the OpenAI
backend's request, retry and parsing logic against a mock transport."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
import torch

from inferscale.pipeline.generators import LocalJsonGenerator, OpenAIJsonGenerator

FACTS = {"type": "object",
         "properties": {"facts": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
         "required": ["facts"], "additionalProperties": False}
ACTION = {"type": "object", "properties": {"action": {"enum": ["ADD", "UPDATE", "DELETE", "NONE"]}},
          "required": ["action"]}
PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "List facts about me: I moved to Berlin in 2021."}],
    [{"role": "system", "content": "Extract short facts about the user as JSON."},
     {"role": "user", "content": "My name is Ana, I have two cats called Mochi and Pixel, and I "
                                 "work as a nurse at the city hospital on night shifts."}],
]


@pytest.fixture(scope="module")
def local(smollm2_dir) -> Iterator[LocalJsonGenerator]:
    # float64: batched (left-padded) and single prompts then agree far below any greedy margin,
    # so the equality below cannot flip on another CPU's kernels (fp32 could, on a near-tie).
    # One intra-op thread: a 135M model gains little from more, and OpenMP threads on a busy
    # host (the suite's own workers) slow each step down many times over.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LocalJsonGenerator(smollm2_dir, device="cpu", dtype=torch.float64)
    torch.set_num_threads(threads)


def test_local_batch_is_valid_and_matches_single_prompts(local):
    batch = local.generate(PROMPTS, FACTS, max_tokens=40)
    for result in batch:
        assert isinstance(result, dict)
        jsonschema.validate(result, FACTS)
    assert batch == [local.generate([p], FACTS, max_tokens=40)[0] for p in PROMPTS]


def test_local_enum_and_shared_model(local):
    results = local.generate(PROMPTS, ACTION, max_tokens=16)
    for result in results:
        jsonschema.validate(result, ACTION)
    shared = LocalJsonGenerator.from_loaded(local.model, local.tokenizer)
    assert shared.generate(PROMPTS[:1], ACTION, max_tokens=16) == results[:1]


def test_local_unfinished_output_is_none(local):
    assert local.generate(PROMPTS[:2], FACTS, max_tokens=3) == [None, None]
    assert local.generate([], FACTS) == []


class FakeServer:
    """A mock OpenAI server: answers each request with the next scripted reply (the last one
    repeats); a reply is a status and a message content, or an exception to raise."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.requests.append(request)
            reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(reply, Exception):
            raise reply
        status, content = reply
        if callable(content):
            content = content(json.loads(request.content))
        return httpx.Response(status, json={"choices": [{"message": {"content": content}}]})

    def generator(self, base_url: str = "http://llm.test", **kwargs) -> OpenAIJsonGenerator:
        return OpenAIJsonGenerator(base_url, "served-model", api_key="sk-test", backoff_s=0,
                                   transport=httpx.MockTransport(self), **kwargs)


@pytest.mark.parametrize("base_url", ["http://llm.test", "http://llm.test/v1/"])
def test_openai_retries_transient_errors(base_url):
    server = FakeServer((503, ""), (503, ""), (200, '{"facts": ["likes tea"]}'))
    assert server.generator(base_url).generate(PROMPTS[:1], FACTS, max_tokens=32) == [
        {"facts": ["likes tea"]}]
    assert len(server.requests) == 3
    request = server.requests[-1]
    assert str(request.url) == "http://llm.test/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    body = json.loads(request.content)
    assert body == {"model": "served-model", "messages": PROMPTS[0], "temperature": 0,
                    "max_tokens": 32, "response_format": {"type": "json_schema", "json_schema": {
                        "name": "output", "schema": FACTS, "strict": True}}}


def test_openai_gives_up_after_attempts(caplog):
    for failure in [(429, ""), httpx.ConnectError("refused")]:
        server = FakeServer(failure)
        with caplog.at_level(logging.WARNING, logger="inferscale.pipeline.generators"):
            assert server.generator(attempts=3).generate(PROMPTS[:1], FACTS) == [None]
        assert len(server.requests) == 3
    assert "chat completion failed" in caplog.text


@pytest.mark.parametrize("reply", [(200, "{not json"), (200, '{"facts": "not a list"}'),
                                   (200, '{"facts": [], "extra": 1}'), (200, '["a"]'),
                                   (200, None), (400, "")])
def test_openai_bad_answer_is_none_without_retry(reply):
    server = FakeServer(reply)
    assert server.generator().generate(PROMPTS[:1], FACTS) == [None]
    assert len(server.requests) == 1


def test_openai_batch_keeps_order_and_isolates_failures():
    def answer(body):
        text = body["messages"][-1]["content"]
        return "{bad" if text == "Hi" else json.dumps({"facts": [text[:20]]})

    server = FakeServer((200, answer))
    results = server.generator(concurrency=3).generate(PROMPTS, FACTS)
    assert results == [None] + [{"facts": [p[-1]["content"][:20]]} for p in PROMPTS[1:]]
