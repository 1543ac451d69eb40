"""Memory on the Responses API, through the live server (the suite's shared ``served``, whose
vLLM keeps responses: ``VLLM_ENABLE_RESPONSES_API_STORE=1``): a response asked with memory gets
the same prompt, facts and injection as the same chat; streamed and not; under recompute auto;
``instructions`` and ``previous_response_id`` keep working; recording stores the exchange; and
the OpenAI Agents SDK (``openai-agents``, pinned) gets memory with no change but its headers."""

import asyncio
import json
import uuid

import httpx
import pytest

from conftest import AUTH, SUITE_KEY
from helpers import ines_with_two_facts, metric

pytestmark = pytest.mark.slow
QUESTION = "What is my horse called?"
REPORTED = ("x-inferscale-fact-ids", "x-inferscale-prompt-tokens", "x-inferscale-injected-tokens",
            "x-inferscale-facts-injected")


@pytest.fixture(scope="module")
async def ines(served, smol, base_settings, engine, embedder):
    return await ines_with_two_facts(served, smol, base_settings, engine, embedder, "resp")


def respond(served, user: str | None, body: dict, headers: dict | None = None
            ) -> httpx.Response:
    body = {"model": "inferscale", "max_output_tokens": 12, "temperature": 0, **body}
    if user is not None:
        body["user"] = user
    return httpx.post(f"{served.url}/v1/responses", json=body, timeout=120,
                      headers={**AUTH, **(headers or {})})


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def test_a_response_gets_the_memory_prompt_of_the_same_chat(served, ines):
    options = {"mode": "inject", "k": 2, "recompute": 0}
    chat = served.chat(ines, QUESTION, max_tokens=12, **{"inferscale": options})
    assert chat.status_code == 200, chat.text
    response = respond(served, ines, {"input": QUESTION, "inferscale": options})
    assert response.status_code == 200, response.text
    assert {h: response.headers[h] for h in REPORTED} == {h: chat.headers[h] for h in REPORTED}
    assert int(response.headers["x-inferscale-injected-tokens"]) > 0
    answer = response.json()
    assert answer["kv_transfer_params"]["injected_tokens"] == int(
        response.headers["x-inferscale-injected-tokens"])
    assert answer["usage"]["input_tokens"] == int(response.headers["x-inferscale-prompt-tokens"])
    assert output_text(answer)
    plain = respond(served, None, {"input": QUESTION})  # no owner: vLLM's own answer
    assert plain.status_code == 200 and "x-inferscale-facts" not in plain.headers
    assert plain.json()["usage"]["input_tokens"] < answer["usage"]["input_tokens"]


def test_a_streamed_response_under_recompute_auto_is_whole_and_says_which_attempt(served, ines):
    streamed = respond(served, ines, {"input": QUESTION, "stream": True,
                                      "inferscale": {"k": 2, "recompute": "auto"}})
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["x-inferscale-recompute-auto"] in ("kept", "recomputed", "text")
    events = [block.split("\n") for block in streamed.text.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    payloads = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert all(p.get("logprobs") in (None, []) for p in payloads)  # none asked, none given
    completed = payloads[-1]["response"]
    deltas = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    assert deltas == output_text(completed) and deltas
    whole = respond(served, ines, {"input": QUESTION, "inferscale": {"k": 2, "recompute": "auto"},
                                   "include": ["message.output_text.logprobs"],
                                   "top_logprobs": 1})
    assert whole.status_code == 200, whole.text
    entries = whole.json()["output"][-1]["content"][0]["logprobs"]
    assert entries and all(len(e["top_logprobs"]) == 1 for e in entries)  # as asked


def test_instructions_and_previous_response_id_keep_working(served, ines):
    first = respond(served, ines, {"input": "Hello, I am Ines.", "instructions": "Be brief.",
                                   "inferscale": {"k": 2}})
    assert first.status_code == 200, first.text
    alone = respond(served, ines, {"input": QUESTION, "inferscale": {"k": 2}})
    followed = respond(served, ines, {"input": QUESTION, "inferscale": {"k": 2},
                                      "previous_response_id": first.json()["id"]})
    assert followed.status_code == 200, followed.text
    assert followed.headers["x-inferscale-fact-ids"] == alone.headers["x-inferscale-fact-ids"]
    history = int(followed.headers["x-inferscale-prompt-tokens"]) - int(
        alone.headers["x-inferscale-prompt-tokens"])
    assert history > 0  # the first exchange is in the prompt, as vLLM renders it
    assert followed.json()["previous_response_id"] == first.json()["id"]
    unknown = respond(served, ines, {"input": QUESTION, "previous_response_id": "resp_nope"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"].startswith("previous response")


def test_hostile_responses_requests_are_refused_by_name(served, ines):
    for body, status in (({"input": 7}, 400),
                         ({"input": [{"type": "no_such_item"}]}, 400),
                         ({"input": [{"role": "user", "content": [
                             {"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}]},
                          400),
                         ({"input": "hi", "inferscale": {"k": -1}}, 400),
                         ({"input": "hi", "kv_transfer_params": {"x": 1}}, 400)):
        refused = respond(served, ines, body)
        assert refused.status_code == status, (body, refused.text)
        assert not any(h.startswith("x-inferscale-fact") for h in refused.headers)
    unkeyed = httpx.post(f"{served.url}/v1/responses", timeout=60, json={
        "model": "inferscale", "input": QUESTION, "user": ines, "max_output_tokens": 4})
    assert unkeyed.status_code == 401
    body = json.dumps({"model": "inferscale", "input": QUESTION, "user": ines,
                       "max_output_tokens": 4})
    for headers, status in (({"content-type": "text/plain"}, 415),
                            ({"content-type": "application/json",
                              "origin": "http://evil.example"}, 403),
                            ({"content-type": "application/json", "host": "evil.example"}, 403),
                            ({"content-type": "application/json"}, 200)):  # the right key
        answered = httpx.post(f"{served.url}/v1/responses", content=body, timeout=60,
                              headers={**AUTH, **headers})
        assert answered.status_code == status, (headers, answered.text)


async def test_the_agents_sdk_gets_memory_unchanged_and_records_the_exchange(served, ines):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's servers
    client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key=SUITE_KEY)
    request_id = f"agent-{uuid.uuid4().hex[:8]}"

    def agent(headers: dict[str, str]) -> Agent:
        return Agent(name="assistant", instructions="Answer in one short sentence.",
                     model=OpenAIResponsesModel(model="inferscale", openai_client=client),
                     model_settings=ModelSettings(max_tokens=160, temperature=0,
                                                  extra_headers=headers))

    before = metric(served, "inferscale_memory_requests_total")
    recorded = metric(served, "inferscale_recorded_turns_total", outcome="published")
    remembered = await Runner.run(agent({"X-InferScale-User": ines,
                                         "X-InferScale-Record": "true",
                                         "X-Request-Id": request_id}), QUESTION)
    assert metric(served, "inferscale_memory_requests_total") > before
    assert isinstance(remembered.final_output, str) and remembered.final_output
    plain = await Runner.run(agent({}), QUESTION)
    assert (remembered.context_wrapper.usage.input_tokens
            > plain.context_wrapper.usage.input_tokens)  # the facts are in its prompt
    streamed = Runner.run_streamed(agent({"X-InferScale-User": ines}), QUESTION)
    async for _ in streamed.stream_events():
        pass
    assert isinstance(streamed.final_output, str) and streamed.final_output
    for _ in range(100):  # published in the background, after the answer
        if metric(served, "inferscale_recorded_turns_total", outcome="published") >= recorded + 2:
            break
        await asyncio.sleep(0.1)
    assert metric(served, "inferscale_recorded_turns_total", outcome="published") == recorded + 2
