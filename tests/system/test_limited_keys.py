"""Safe against a limited key, on a real server given keys of its own and a ``--root-path``:
routes are allowed by name as the router matches them (engine control needs an admin key under
the root path too, vLLM's dev-mode routes included), a keyless body is refused before it is
read, a filter flood by a read-only key is answered (or refused) while the server stays
responsive, an agent-scoped key learns nothing of owners outside its scope and cannot pin, and
/metrics is read as configured."""

import asyncio
import socket
import uuid
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from sqlalchemy import insert

from conftest import SUITE_KEY, running_server
from inferscale.core.settings import Settings
from inferscale.db.tables import facts

pytestmark = pytest.mark.slow

KEYS = {
    SUITE_KEY: ["*"],
    "reader": {"owners": ["*"], "read_only": True},
    "agent-a-reader": {"owners": ["*"], "agents": ["a"], "read_only": True},
    "alice-a": {"owners": ["alice"], "agents": ["a"]},
    "recorder": {"owners": ["bob"], "record": True},  # records unless a request says not to
}
ADMIN = {"authorization": f"Bearer {SUITE_KEY}"}
FLOOD_FACTS = 3000


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(base_settings, tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("limited-keys")
    settings = base_settings.model_copy(update={
        "model_path": tiny_models["llama"], "kv_dir": root / "kv", "data_dir": root,
        "window": 0, "top_k": 1, "key_scales": "off", "metrics_access": "admin",
        "api_keys": Settings(api_keys=KEYS).api_keys})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # vLLM's dev-mode routes too (/pause, ...)
        server = running_server(settings, root / "server.log",
                                ["--enforce-eager", "--dtype", "float32", "--max-model-len",
                                 "2048", "--root-path", "/api"])
        running = server.__enter__()
    try:
        yield running
    finally:
        server.__exit__(None, None, None)


def test_engine_control_needs_an_admin_key_under_the_root_path(keyed):
    """Under ``--root-path /api`` the app routes ``/reset_prefix_cache`` with the root path in
    the request's path (what an exact-path deny-list missed); a prefixed form is never
    served to a limited caller either."""
    for path in ("/reset_prefix_cache", "/pause", "/collective_rpc", "/invocations",
                 "/api/reset_prefix_cache"):
        for headers, refused in (({}, 401), (_bearer("reader"), 403),
                                 (_bearer("alice-a"), 403)):
            response = httpx.post(keyed.url + path, json={}, headers=headers, timeout=30)
            assert response.status_code in (refused, 404 if "/api/" in path else refused), (
                path, headers, response.text)
    assert httpx.post(keyed.url + "/reset_prefix_cache", headers=ADMIN,
                      timeout=30).status_code == 200
    # generation stays open under the root path (vLLM's own --api-key is not set)
    chat = httpx.post(keyed.url + "/v1/chat/completions", timeout=120, json={
        "model": "inferscale", "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text


PART = b"[" + b" " * (64 * 1024 - 1)  # the first 64 KiB of a far larger JSON body


def _status_after_partial_body(url: str, method: str, path: str, chunked: bool) -> int:
    """Send a request's head and 64 KiB of a 48 MiB body (declared, or the first of its
    chunks); the status line of the answer (the server must answer without the rest)."""
    parts = urlsplit(url)
    framing = ("Transfer-Encoding: chunked" if chunked
               else f"Content-Length: {48 * 1024**2}")
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Content-Type: application/json\r\n{framing}\r\n\r\n".encode())
        sock.sendall(f"{len(PART):x}\r\n".encode() + PART + b"\r\n" if chunked else PART)
        answer = sock.recv(4096)
    return int(answer.split(b" ", 2)[1])


def test_a_keyless_body_is_refused_before_it_is_read(keyed):
    assert _status_after_partial_body(keyed.url, "DELETE", "/v1/batch/", False) in (401, 413)
    assert _status_after_partial_body(keyed.url, "DELETE", "/v1/batch/", True) == 401
    assert _status_after_partial_body(keyed.url, "POST", "/v1/memory/users/x/search",
                                      True) == 401
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200


async def _add(url: str, owner: str, text: str, agent: str | None, key: dict,
               pinned: bool = False) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(f"{url}/v1/memory/users/{owner}/facts", headers=key,
                                 json={"text": text, "agent_id": agent, "pinned": pinned})


async def test_an_agent_scoped_key_sees_no_owner_outside_its_scope_and_cannot_pin(keyed):
    tag = uuid.uuid4().hex[:6]
    both, other = f"both-{tag}", f"other-{tag}"
    for owner, text, agent in ((both, "Kim keeps bees.", "a"), (both, "Kim's PIN is 4921.", "b"),
                               (other, "Lee's PIN is 1234.", "b")):
        assert (await _add(keyed.url, owner, text, agent, ADMIN)).status_code == 201
    for key in ("agent-a-reader", SUITE_KEY):
        listed = httpx.get(f"{keyed.url}/v1/entities/", headers=_bearer(key), timeout=30)
        assert listed.status_code == 200, listed.text
        counts = {e["id"]: e["total_memories"] for e in listed.json()["results"]}
        if key == SUITE_KEY:
            assert counts[both] == 2 and counts[other] == 1
        else:
            assert counts[both] == 1 and other not in counts
    # a key of agent a may add in its scope, never pin (a pinned fact leads every prompt)
    assert (await _add(keyed.url, "alice", "Alice swims.", "a", _bearer("alice-a"))
            ).status_code == 201
    assert (await _add(keyed.url, "alice", "Alice is X.", "a", _bearer("alice-a"), pinned=True)
            ).status_code == 403


@pytest.fixture(scope="module")
async def crowded(engine):
    """An owner with ``FLOOD_FACTS`` facts, each with metadata, stored straight to Postgres."""
    owner = f"crowded-{uuid.uuid4().hex[:6]}"
    vectors = np.random.default_rng(67).normal(size=(FLOOD_FACTS, 384)).astype(np.float32)
    now = datetime.now(UTC)
    rows = [{"user_id": owner, "conversation_id": "c", "turn_ids": [f"t{i}"], "ordinal": 0,
             "extractor": "test", "text": f"fact {i}", "ts": now,
             "embedding": vectors[i].tolist(), "metadata": {"n": i % 97, "tag": f"t{i % 7}"},
             "created_at": now} for i in range(FLOOD_FACTS)]
    async with engine.begin() as conn:
        await conn.execute(insert(facts), rows)
    return owner


async def test_a_filter_flood_by_a_read_only_key_is_bounded_and_the_server_stays_up(keyed,
                                                                                   crowded):
    """8 concurrent searches, each a 64-way OR over 3,000 facts: each is answered or refused
    as too costly (never a 5xx), and health checks keep being answered meanwhile (how fast:
    ``lab bench flood``)."""
    where = {"OR": [{"n": i} for i in range(64)]}
    async with httpx.AsyncClient(timeout=120) as client:
        async def search() -> int:
            response = await client.post(
                f"{keyed.url}/v1/memory/users/{crowded}/search", headers=_bearer("reader"),
                json={"query": "which fact?", "k": 5, "filters": where})
            return response.status_code

        async def probe(done: asyncio.Event) -> list[int]:
            statuses = []
            while not done.is_set():
                statuses.append((await client.get(f"{keyed.url}/health")).status_code)
                await asyncio.sleep(0.05)
            return statuses

        done = asyncio.Event()
        probes = asyncio.create_task(probe(done))
        searched = await asyncio.gather(*(search() for _ in range(8)))
        done.set()
        health = await probes
    assert set(searched) <= {200, 413} and searched, searched
    assert health and set(health) == {200}


def test_metrics_are_read_as_configured(keyed):
    assert httpx.get(f"{keyed.url}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{keyed.url}/metrics", headers=_bearer("reader"),
                     timeout=30).status_code == 403
    response = httpx.get(f"{keyed.url}/metrics", headers=ADMIN, timeout=30)
    assert response.status_code == 200 and "vllm" in response.text


def test_only_a_key_that_may_write_records_a_conversation(keyed):
    """``"record": true`` writes memory: a read-only key is refused, a key limited to agent a
    may record in agent a only; the refused requests are not answered."""
    def chat(key: str, agent: str | None) -> httpx.Response:
        options = {"record": True, "mode": "text", **({"agent_id": agent} if agent else {})}
        return httpx.post(keyed.url + "/v1/chat/completions", headers=_bearer(key), timeout=120,
                          json={"model": "inferscale", "user": "alice", "max_tokens": 2,
                                "inferscale": options,
                                "messages": [{"role": "user", "content": "I moved."}]})

    reader = chat("reader", None)
    assert reader.status_code == 403 and "only read" in reader.text
    elsewhere = chat("alice-a", "b")
    assert elsewhere.status_code == 403
    allowed = chat("alice-a", "a")
    assert allowed.status_code == 200, allowed.text
    assert len(allowed.headers["x-inferscale-recorded-turns"].split(",")) == 2


def test_a_keys_record_default_records_unless_the_request_says_not_to(keyed):
    """A key granted ``"record": true`` records its chats and responses without asking; a
    request's own ``"record": false`` wins; another key's requests record nothing."""
    def ask(key: str, route: str, record: bool | None) -> httpx.Response:
        options = {"mode": "text", **({"record": record} if record is not None else {})}
        body = ({"messages": [{"role": "user", "content": "I moved."}], "max_tokens": 2}
                if route == "chat/completions" else {"input": "I moved.",
                                                     "max_output_tokens": 2})
        return httpx.post(f"{keyed.url}/v1/{route}", headers=_bearer(key), timeout=120,
                          json={"model": "inferscale", "user": "bob", "inferscale": options,
                                **body})

    for route in ("chat/completions", "responses"):
        recorded = ask("recorder", route, None)
        assert recorded.status_code == 200, recorded.text
        assert len(recorded.headers["x-inferscale-recorded-turns"].split(",")) == 2
        declined = ask("recorder", route, False)
        assert declined.status_code == 200
        assert "x-inferscale-recorded-turns" not in declined.headers
        admin = ask(SUITE_KEY, route, None)
        assert admin.status_code == 200
        assert "x-inferscale-recorded-turns" not in admin.headers


def test_an_event_of_an_owner_the_key_may_not_act_for_is_not_found(keyed):
    """Mem0's event route finds an event by its id alone: a key that may not act for its owner
    gets the 404 of an unknown id, and its owner's key the event."""
    added = httpx.post(f"{keyed.url}/v1/memory/users/bob/facts", headers=ADMIN, timeout=60,
                       json={"text": "Bob keeps bees."})
    assert added.status_code == 201, added.text
    event = f"{keyed.url}/v1/event/{added.json()['event_id']}/"
    assert httpx.get(event, headers=_bearer("alice-a"), timeout=60).status_code == 404
    theirs = httpx.get(event, headers=_bearer("recorder"), timeout=60)  # bob's key
    assert theirs.status_code == 200 and theirs.json()["results"][0]["user_id"] == "bob"


def test_the_responses_route_and_langgraphs_store_honour_each_kind_of_key(keyed):
    """The new roads in with a key of each kind: admin and owner-scoped keys answer and write,
    a read-only key reads but may not record or store, a key for another owner is refused."""
    from inferscale_client.langgraph_store import InferScaleStore

    def respond(key: str, record: bool) -> httpx.Response:
        return httpx.post(f"{keyed.url}/v1/responses", headers=_bearer(key), timeout=120,
                          json={"model": "inferscale", "user": "bob", "input": "Hi",
                                "max_output_tokens": 2,
                                "inferscale": {"mode": "text", "record": record}})

    assert respond(SUITE_KEY, False).status_code == 200
    assert respond("recorder", True).status_code == 200
    assert respond("reader", False).status_code == 200
    assert respond("reader", True).status_code == 403
    assert respond("alice-a", False).status_code == 403
    for key in (SUITE_KEY, "recorder"):
        InferScaleStore(keyed.url, api_key=key).put(("bob", "notes"), key[:8], {"text": "x"})
    assert InferScaleStore(keyed.url, api_key="reader").get(("bob", "notes"), "recorder")
    with pytest.raises(Exception, match="403"):
        InferScaleStore(keyed.url, api_key="reader").put(("bob", "notes"), "k", {"text": "y"})
