"""The real ``mem0ai`` client (pinned, telemetry off) against the live server (the suite's shared
``served``): ``MemoryClient`` and ``AsyncMemoryClient`` work unchanged for add (a string or
messages, scopes, metadata, infer false and true), get, get_all and search (filters, top_k,
pages), update (text and / or metadata), delete, delete_all, history, batch update and delete,
users / delete_users and reset; what has no meaning here is a 4xx naming it; hostile requests
to Mem0's routes are refused and change nothing."""

import os
import tempfile
import time
import uuid

os.environ["MEM0_TELEMETRY"] = "False"  # before mem0 is imported: no events leave the suite
os.environ.setdefault("MEM0_DIR", tempfile.mkdtemp(prefix="mem0-"))

import httpx  # noqa: E402
import pytest  # noqa: E402
from mem0 import AsyncMemoryClient, MemoryClient  # noqa: E402
from mem0.exceptions import MemoryNotFoundError, ValidationError  # noqa: E402

from conftest import AUTH, SUITE_KEY  # noqa: E402
from helpers import ingest_and_encode  # noqa: E402
from inferscale.client import MemoryClient as NativeClient  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def mem0(served):
    return MemoryClient(host=served.url, api_key=SUITE_KEY)


def _ids(page: dict) -> list[str]:
    return [m["id"] for m in page["results"]]


def _served_ids(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [i for i in response.headers["x-inferscale-fact-ids"].split(",") if i]


def test_the_mem0_client_adds_reads_searches_edits_and_deletes(served, mem0):
    user = f"mem0-{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    horse = mem0.add("My horse is called Biscuit.", user_id=user, agent_id="tutor",
                     metadata={"topic": "pets", "year": 2019}, infer=False)
    add_ms = (time.perf_counter() - started) * 1000
    assert horse["status"] == "SUCCEEDED" and horse["results"][0]["event"] == "ADD"
    horse_id = horse["results"][0]["id"]
    more = mem0.add([{"role": "user", "content": "I teach chemistry in Porto."},
                     {"role": "user", "content": "My sister Clara lives in Montreal."}],
                    user_id=user, metadata={"topic": "life", "year": 2023}, infer=False)
    porto, clara = (r["id"] for r in more["results"])
    # Read your writes: the fact is served at once, as text.
    assert horse_id in _served_ids(served.chat(user, "What is my horse called?", k=1))

    got = mem0.get(horse_id)
    assert (got["memory"], got["user_id"], got["agent_id"], got["metadata"]) == (
        "My horse is called Biscuit.", user, "tutor", {"topic": "pets", "year": 2019})
    everything = mem0.get_all(filters={"user_id": user})
    assert everything["count"] == 3 and _ids(everything) == [horse_id, porto, clara]
    first = mem0.get_all(filters={"user_id": user}, page=1, page_size=2)
    second = mem0.get_all(filters={"user_id": user}, page=2, page_size=2)
    assert _ids(first) + _ids(second) == _ids(everything) and second["next"] is None
    assert first["next"] and first["previous"] is None
    assert _ids(mem0.get_all(filters={"AND": [{"user_id": user}, {"agent_id": "tutor"}]})) == [
        horse_id]
    assert _ids(mem0.get_all(filters={"AND": [
        {"user_id": user}, {"metadata": {"year": {"gte": 2020}}},
        {"created_at": {"gte": "2020-01-01"}}]})) == [porto, clara]
    assert _ids(mem0.get_all(filters={"user_id": user, "NOT": {"topic": "life"}})) == [horse_id]

    started = time.perf_counter()
    found = mem0.search("Where does Clara live?", filters={"user_id": user}, top_k=2)
    search_ms = (time.perf_counter() - started) * 1000
    assert [m["id"] for m in found["results"]][0] == clara
    assert found["results"][0]["score"] >= found["results"][1]["score"]
    life = mem0.search("Where does Clara live?", filters={"user_id": user, "topic": "pets"})
    assert [m["id"] for m in life["results"]] == [horse_id]

    updated = mem0.update(horse_id, text="My horse is called Pickles.",
                          metadata={"topic": "pets", "year": 2024})
    assert updated["id"] != horse_id and updated["memory"] == "My horse is called Pickles."
    assert mem0.get(horse_id)["id"] == updated["id"]  # the old id follows its newest version
    relabelled = mem0.update(horse_id, metadata={"topic": "animals"})  # metadata alone
    assert (relabelled["memory"], relabelled["metadata"]) == (
        "My horse is called Pickles.", {"topic": "animals"})
    events = mem0.history(horse_id)
    assert [e["event"] for e in events] == ["ADD", "UPDATE", "UPDATE"]
    assert events[1]["old_memory"] == "My horse is called Biscuit."
    assert events[1]["new_memory"] == "My horse is called Pickles."
    answer = served.chat(user, "What is my horse called?", k=1)
    assert _served_ids(answer) == [relabelled["id"]]  # never the old version

    mem0.batch_update([{"memory_id": porto, "text": "I teach physics in Porto."},
                       {"memory_id": clara, "metadata": {"topic": "family"}}])
    texts = {m["memory"]: m["metadata"] for m in mem0.get_all(filters={"user_id": user})[
        "results"]}
    assert texts["I teach physics in Porto."] == {"topic": "life", "year": 2023}
    assert texts["My sister Clara lives in Montreal."] == {"topic": "family"}
    mem0.delete(clara)
    with pytest.raises(MemoryNotFoundError):
        mem0.get(clara)
    mem0.batch_delete([{"memory_id": porto}])
    assert _ids(mem0.get_all(filters={"user_id": user})) == [relabelled["id"]]
    mem0.delete_all(user_id=user, agent_id="tutor")
    assert mem0.get_all(filters={"user_id": user})["count"] == 0
    print(f"\nmem0 add (infer=False, one fact) {add_ms:.1f} ms; search {search_ms:.1f} ms")


async def test_the_async_client_infer_true_goes_through_extraction(served, smol, settings,
                                                                    engine, embedder):
    user = f"mem0-{uuid.uuid4().hex[:6]}"
    memory = AsyncMemoryClient(host=served.url, api_key=SUITE_KEY)
    queued = await memory.add([{"role": "user", "content": "My cat Tiger is nine years old."}],
                              user_id=user, run_id="s1", metadata={"topic": "pets"})
    assert queued["status"] == "PENDING" and queued["results"] == []
    drain = settings.model_copy(update={
        "turns_topic": served.settings.turns_topic,
        "consumer_group": f"mem0-{uuid.uuid4().hex[:6]}",
        **{k: getattr(served.settings, k) for k in ("model_path", "kv_dir", "window")}})
    await ingest_and_encode(drain, engine, embedder, [])
    page = await memory.get_all(filters={"AND": [{"user_id": user}, {"run_id": "s1"}]})
    assert page["count"] == 1 and "Tiger" in page["results"][0]["memory"]
    assert page["results"][0]["metadata"] == {"topic": "pets"}  # the turn's, kept by its fact
    # the add's event: extracted into that memory (no encoder ran here)
    event = NativeClient(served.url, api_key=SUITE_KEY).event(user, queued["event_id"])
    assert event.stage == "extracted" and [str(f.id) for f in event.facts] == [
        page["results"][0]["id"]]
    hits = await memory.search("How old is the cat?", filters={"user_id": user})
    assert hits["results"][0]["id"] == page["results"][0]["id"]
    assert {"id": user, "name": user, "type": "user", "total_memories": 1} in (
        await memory.users())["results"]
    await memory.delete_users(user_id=user)
    assert (await memory.get_all(filters={"user_id": user}))["count"] == 0


def test_an_expiration_date_ends_a_memory_after_that_day(served, mem0):
    user = f"mem0-{uuid.uuid4().hex[:6]}"
    lasting = mem0.add("I keep bees.", user_id=user, infer=False,
                       expiration_date="2999-12-31")["results"][0]["id"]
    mem0.add("I lived in Ghent.", user_id=user, infer=False, expiration_date="2020-01-01")
    listed = mem0.get_all(filters={"user_id": user})["results"]
    assert [(m["id"], m["expiration_date"]) for m in listed] == [(lasting, "2999-12-31")]
    assert [m["id"] for m in mem0.search("Where did I live?", filters={"user_id": user})[
        "results"]] == [lasting]
    assert mem0.get(lasting)["expiration_date"] == "2999-12-31"
    sooner = mem0.update(lasting, expiration_date="2998-01-31")  # a new version, new expiry
    assert sooner["expiration_date"] == "2998-01-31" and sooner["memory"] == "I keep bees."
    cleared = mem0.update(lasting, expiration_date=None)  # never expires
    assert cleared["expiration_date"] is None
    expired = mem0.update(lasting, expiration_date="2020-01-01")  # ended: never served again
    assert mem0.get_all(filters={"user_id": user})["results"] == []
    assert expired["id"] != cleared["id"]


def test_what_has_no_meaning_here_is_a_4xx_naming_it(served, mem0):
    user = f"mem0-{uuid.uuid4().hex[:6]}"
    for call, named in [
        (lambda: mem0.add("x", user_id=user, app_id="a", infer=False), "app_id"),
        (lambda: mem0.add("x", user_id=user, infer=False, custom_categories=[{"a": "b"}]),
         "custom_categories"),
        (lambda: mem0.add("x", user_id=user, expiration_date="2030-01-01"),  # infer=True
         "expiration_date"),
        (lambda: mem0.search("x", filters={"user_id": user}, rerank=True), "rerank"),
        (lambda: mem0.search("x", filters={"user_id": user, "categories": {"in": ["a"]}}),
         "categories"),
        (lambda: mem0.get_all(filters={"agent_id": "a"}), "user_id"),
        (lambda: mem0.delete_users(agent_id="a"), "agent"),
    ]:
        with pytest.raises(ValidationError) as refused:
            call()
        assert named in str(refused.value), (named, refused.value)


def test_hostile_requests_to_mem0_routes_are_refused_and_change_nothing(served, mem0):
    user = f"mem0-{uuid.uuid4().hex[:6]}"
    kept = mem0.add("I keep bees.", user_id=user, infer=False)["results"][0]["id"]
    with pytest.raises(ValueError):  # the client checks its key at start: 401
        MemoryClient(host=served.url, api_key="not-a-key")
    token = {"authorization": f"Token {SUITE_KEY}"}
    deep: dict = {"a": 1}
    for _ in range(9):  # past the filter's bound (8)
        deep = {"NOT": deep}
    http = httpx.Client(base_url=served.url, timeout=60)
    add = "/v3/memories/add/"
    body = {"messages": [{"role": "user", "content": "I moved."}], "user_id": user,
            "infer": False}
    refused = {
        "no key": (http.post(add, json=body), 401),
        "wrong key": (http.post(add, json=body, headers={"authorization": "Token nope"}), 401),
        "basic": (http.post(add, json=body, headers={"authorization": f"Basic {SUITE_KEY}"}),
                  401),
        "foreign host": (http.post(add, json=body, headers={**token, "host": "evil.example"}),
                         403),
        "foreign origin": (http.post(add, json=body, headers={
            **token, "origin": "https://evil.example"}), 403),
        "text/plain": (http.post(add, content=b'{"messages": []}', headers={
            **token, "content-type": "text/plain"}), 415),
        "bad json": (http.post(add, content=b"{nope", headers={
            **token, "content-type": "application/json"}), 400),
        "wrong types": (http.post(add, json={**body, "messages": "x", "infer": "maybe"},
                                  headers=token), 400),
        "huge top_k": (http.post("/v3/memories/search/", json={
            "query": "bees", "filters": {"user_id": user}, "top_k": 10**9}, headers=token), 400),
        "control characters": (http.post(add, json={**body, "user_id": "a\x07b"},
                                         headers=token), 400),
        "huge metadata": (http.post(add, json={**body, "metadata": {"k": "x" * 10_000}},
                                    headers=token), 400),
        "deep filter": (http.post("/v3/memories/", json={"filters": {"user_id": user, **deep}},
                                  headers=token), 400),
        "huge page": (http.post("/v3/memories/", json={"filters": {"user_id": user}},
                                params={"page_size": 10**6}, headers=token), 400),
        "not an id": (http.get("/v1/memories/abc/", headers=token), 404),
        "a huge id": (http.get(f"/v1/memories/{10**30}/", headers=token), 404),
        "empty update": (http.put(f"/v1/memories/{kept}/", json={}, headers=token), 400),
        "not an event": (http.get("/v1/event/nope/", headers=token), 404),
        "an unknown event": (http.get(f"/v1/event/{uuid.uuid4().hex}/", headers=token), 404),
        "an event no key": (http.get(f"/v1/event/{uuid.uuid4().hex}/"), 401),
        "huge batch": (http.request("DELETE", "/v1/batch/", json={"memories": [
            {"memory_id": kept}] * 1001}, headers=token), 400),
    }
    for name, (response, status) in refused.items():
        assert response.status_code == status, (name, response.text)
        assert "error" in response.json() or "detail" in response.json(), name
    bearer = httpx.get(f"{served.url}/v1/memories/{kept}/", headers=AUTH)  # Bearer works too
    assert bearer.status_code == 200 and bearer.json()["memory"] == "I keep bees."
    assert _ids(mem0.get_all(filters={"user_id": user})) == [kept]  # nothing changed


async def test_an_adds_event_says_how_far_it_has_come(served, mem0, smol, base_settings,
                                                      engine, embedder):
    """Mem0's event route: the ``event_id`` of an add is ``RUNNING`` until its memory is
    encoded, then ``SUCCEEDED``, with the memory it produced."""
    user = f"mem0-{uuid.uuid4().hex[:6]}"
    added = mem0.add("I keep bees.", user_id=user, infer=False)
    memory_id, event_id = added["results"][0]["id"], added["event_id"]
    token = {"authorization": f"Token {SUITE_KEY}"}

    def event() -> dict:
        answered = httpx.get(f"{served.url}/v1/event/{event_id}/", headers=token, timeout=30)
        assert answered.status_code == 200, answered.text
        return answered.json()

    stored = event()
    assert (stored["id"], stored["event_type"], stored["status"]) == (event_id, "ADD",
                                                                      "RUNNING")
    assert [(r["id"], r["user_id"], r["encoded"]) for r in stored["results"]] == [
        (memory_id, user, False)]
    encoder, store = smol
    drain = base_settings.model_copy(update={
        "turns_topic": served.settings.turns_topic, "consumer_group": f"ev-{user}",
        **{k: getattr(served.settings, k) for k in ("model_path", "kv_dir", "window")}})
    await ingest_and_encode(drain, engine, embedder, [], encoder, store)
    encoded = event()
    assert encoded["status"] == "SUCCEEDED" and encoded["results"][0]["encoded"] is True


def test_reset_forgets_every_owner_the_key_may_act_for(served, mem0):
    users = [f"mem0-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    for user in users:
        mem0.add("I like tea.", user_id=user, infer=False)
    assert mem0.reset()["message"].startswith("Client reset successful")
    for user in users:
        assert mem0.get_all(filters={"user_id": user})["count"] == 0
