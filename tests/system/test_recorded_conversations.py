"""Memory that records its own conversations, through the live server (the suite's shared
``served``): a chat with ``"record": true`` (streamed or not) stores the user's new message and
the answer as turns of its owner, in its scope, once; the next request of the owner is served
from what was said; a key that may not write cannot record, and a refused request records
nothing."""

import uuid

import httpx
import pytest
from sqlalchemy import text

from conftest import AUTH
from helpers import ingest_and_encode

pytestmark = pytest.mark.slow


def _chat(served, user: str, question: str, headers: dict | None = None, stream: bool = False,
          record: bool = True) -> httpx.Response:
    body = {"model": "inferscale", "user": user, "max_tokens": 8, "temperature": 0,
            "stream": stream, "messages": [{"role": "user", "content": question}],
            "inferscale": {"mode": "text", "k": 3, "record": record}}
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120,
                      headers={**AUTH, **(headers or {})})


async def _turns(engine, user: str) -> list[tuple]:
    async with engine.connect() as conn:
        rows = await conn.execute(text(
            "SELECT conversation_id, turn_id, speaker, agent_id, run_id FROM turns "
            "WHERE user_id = :u ORDER BY turn_id"), {"u": user})
        return [tuple(row) for row in rows]


async def test_a_recorded_chat_becomes_memory_once(served, settings, engine, embedder):
    user = f"rec-{uuid.uuid4().hex[:6]}"
    said = _chat(served, user, "My horse is called Biscuit.",
                 headers={"x-request-id": f"{user}-1"})
    assert said.status_code == 200, said.text
    assert said.headers["x-inferscale-recorded-turns"] == f"{user}-1.u0,{user}-1.a"
    again = _chat(served, user, "My horse is called Biscuit.",  # a retry of the same request
                  headers={"x-request-id": f"{user}-1"})
    assert again.status_code == 200
    streamed = _chat(served, user, "I teach chemistry in Porto.", stream=True,
                     headers={"x-inferscale-agent-id": "tutor"})
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    streamed_turns = streamed.headers["x-inferscale-recorded-turns"].split(",")
    drain = settings.model_copy(update={
        "turns_topic": served.settings.turns_topic,
        "consumer_group": f"rec-{uuid.uuid4().hex[:6]}",
        **{k: getattr(served.settings, k) for k in ("model_path", "kv_dir", "window")}})
    await ingest_and_encode(drain, engine, embedder, [])
    stored = await _turns(engine, user)
    assert [(c, t, s) for c, t, s, _, _ in stored if t.startswith(f"{user}-1")] == [
        ("chat", f"{user}-1.a", "assistant"), ("chat", f"{user}-1.u0", "user")]  # once
    assert sorted((t, s, a) for _, t, s, a, _ in stored if t in streamed_turns) == sorted(
        [(streamed_turns[0], "user", "tutor"), (streamed_turns[1], "assistant", "tutor")])
    answer = _chat(served, user, "What is my horse called?", record=False)
    assert answer.status_code == 200 and "x-inferscale-recorded-turns" not in answer.headers
    served_ids = [int(i) for i in answer.headers["x-inferscale-fact-ids"].split(",") if i]
    async with engine.connect() as conn:
        served_facts = (await conn.execute(text(
            "SELECT text FROM facts WHERE user_id = :u AND id = ANY(:ids)"),
            {"u": user, "ids": served_ids})).scalars().all()
    assert any("Biscuit" in fact for fact in served_facts)  # what was said is memory now


async def test_a_refused_request_records_nothing(served, engine):
    user = f"rec-{uuid.uuid4().hex[:6]}"
    bad_id = _chat(served, user, "I moved to Ghent.", headers={"x-request-id": "a b"})
    assert bad_id.status_code == 400 and "X-Request-Id" in bad_id.text
    no_key = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
        "model": "inferscale", "user": user, "max_tokens": 4, "inferscale": {"record": True},
        "messages": [{"role": "user", "content": "I moved to Ghent."}]})
    assert no_key.status_code == 401
    plain = _chat(served, user, "I moved to Ghent.", record=False)
    assert plain.status_code == 200 and "x-inferscale-recorded-turns" not in plain.headers
    assert await _turns(engine, user) == []
