"""The memory API on the real server (vLLM CPU engine + connector + front end), through the
Python client: an owner's facts listed page by page with provenance and KV status, read,
searched as the server retrieves, edited (the next answer serves the new version as text, then
as KV once encoded, never the old one), deleted and traced through their history; hostile
requests get a 4xx and change nothing."""

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

import httpx
import pytest

from conftest import AUTH
from helpers import ingest_and_encode, turn
from inferscale.client import AsyncMemoryClient, Deleted, MemoryAPIError, MemoryClient
from inferscale.contracts.blob_name import fact_blob
from inferscale.workers.encode import EncodeWorker

pytestmark = pytest.mark.slow
FACTS = ["My horse is called Biscuit and she is twelve years old.",
         "I teach chemistry at a school in Porto.",
         "My sister Clara lives in Montreal with two cats."]


@pytest.fixture
def cfg(served, settings):
    return settings.model_copy(update={k: getattr(served.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "window", "top_k")})


async def _user_with_facts(cfg, engine, embedder, smol) -> str:
    encoder, store = smol
    user = f"api-{uuid.uuid4().hex[:6]}"
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, f"t{i}", "Ines", text, day=i + 1) for i, text in enumerate(FACTS)],
        encoder, store)
    return user


def _served_ids(response) -> list[int]:
    assert response.status_code == 200, response.text
    return [int(i) for i in response.headers["x-inferscale-fact-ids"].split(",") if i]


async def test_list_read_search_edit_delete_and_history(served, smol, cfg, engine, embedder):
    encoder, store = smol
    user = await _user_with_facts(cfg, engine, embedder, smol)
    memory = MemoryClient(served.url)
    first = memory.list_facts(user, limit=2)
    rest = memory.list_facts(user, limit=2, cursor=first["next_cursor"])
    assert rest["next_cursor"] is None
    listed = first["facts"] + rest["facts"]
    assert [f["id"] for f in listed] == sorted(f["id"] for f in listed)
    assert all(any(text in f["text"] for text in FACTS) for f in listed)
    assert len(listed) == 3 and all(f["kv"]["encoded"] and f["kv"]["tokens"] > 0
                                    and f["turn_ids"] for f in listed)
    assert list(memory.iter_facts(user, page=1)) == listed
    horse = next(f for f in listed if "horse" in f["text"])
    assert memory.get_fact(user, horse["id"]) == horse
    hits = memory.search(user, "What is the name of Ines's horse?", k=3)
    assert hits[0]["id"] == horse["id"] and hits[0]["score"] >= hits[-1]["score"]

    question = "What is the name of Ines's horse?"
    assert horse["kv"]["tiers"][0] == "durable"
    assert horse["id"] in _served_ids(served.chat(user, question, k=1))
    assert memory.get_fact(user, horse["id"])["kv"]["tiers"] == ["durable", "host"]  # paged in
    edited = memory.edit_fact(user, horse["id"], "My horse is called Pickles; she is twelve.")
    assert edited["replaces"] == horse["id"] and not edited["kv"]["encoded"]
    after = served.chat(user, question, k=1)  # at once: the new version, as text
    assert _served_ids(after) == [edited["id"]]
    assert after.headers["x-inferscale-facts-injected"] == "0"
    assert not (store.durable.root / store.location_for(fact_blob(horse["id"]))).exists()
    with pytest.raises(MemoryAPIError) as gone:
        memory.get_fact(user, horse["id"])
    assert gone.value.status == 404
    versions = memory.history(user, edited["id"])
    assert [v["id"] for v in versions] == [horse["id"], edited["id"]]
    assert versions[0]["superseded_by"] == edited["id"] and versions[0]["deleted_at"]
    await EncodeWorker(cfg, engine, encoder, store).run(drain=True)  # the new version's KV
    encoded = served.chat(user, question, k=1)
    assert _served_ids(encoded) == [edited["id"]]
    assert encoded.headers["x-inferscale-facts-injected"] == "1"

    assert memory.delete_fact(user, edited["id"]) == Deleted(id=edited["id"], deleted=True)
    assert edited["id"] not in _served_ids(served.chat(user, question, k=3))
    assert [f["id"] for f in memory.list_facts(user)["facts"]] == [
        f["id"] for f in listed if f["id"] != horse["id"]]
    assert [v["id"] for v in memory.history(user, horse["id"])] == [horse["id"], edited["id"]]


async def test_an_owner_exported_and_imported_elsewhere_is_served_alike(served, smol, cfg,
                                                                       engine, embedder):
    user = await _user_with_facts(cfg, engine, embedder, smol)
    memory = MemoryClient(served.url)
    horse = next(f for f in memory.list_facts(user)["facts"] if "horse" in f["text"])
    memory.edit_fact(user, horse["id"], "My horse is called Pickles; she is twelve.")
    records = list(memory.export(user))
    assert records[0]["user_id"] == user and len(records) == 1 + len(FACTS) + 1
    other = f"api-{uuid.uuid4().hex[:6]}"
    [imported] = memory.import_records(other, records)
    assert len(imported.imported) == len(FACTS) + 1 and imported.skipped == 0
    [again] = memory.import_records(other, records)  # idempotent
    assert again.imported == [] and again.skipped == len(FACTS) + 1
    theirs = memory.list_facts(other)["facts"]
    assert sorted(f["text"] for f in theirs) == sorted(
        f["text"] for f in memory.list_facts(user)["facts"])
    pickles = next(f for f in theirs if "Pickles" in f["text"])
    assert _served_ids(served.chat(other, "What is the name of Ines's horse?", k=1)) == [
        pickles["id"]]  # served at once, as text
    assert [v["text"] for v in memory.history(other, pickles["id"])] == [
        horse["text"], pickles["text"]]
    response = httpx.get(f"{served.url}/v1/memory/users/{user}/export", headers=AUTH,
                         timeout=60)
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert len(response.text.splitlines()) == len(records)


async def test_the_async_client_adds_and_reads_its_own_writes(served, smol, cfg, engine,
                                                               embedder):
    encoder, store = smol
    user = f"api-{uuid.uuid4().hex[:6]}"
    async with AsyncMemoryClient(served.url) as memory:
        added = await memory.add_fact(user, "Ines's favourite colour is teal.",
                                      metadata={"topic": "colours"})
        assert added["extractor"] == "operator" and not added["kv"]["encoded"]
        assert added.metadata == {"topic": "colours"}
        assert [h.id for h in await memory.search(user, "colour", filters={"topic": "colours"})
                ] == [added.id]
        assert await memory.search(user, "colour", filters={"topic": "cars"}) == []
        for topic, served_ids in (("colours", [added.id]), ("cars", [])):  # filters on chat
            assert _served_ids(served.chat(user, "What is Ines's favourite colour?",
                                           inferscale={"k": 2, "filters": {"topic": topic}})
                               ) == served_ids
        # A fact with an expiry is served until then, never after (no worker needs to run).
        fleeting = await memory.add_fact(user, "Ines is in Lisbon this week.",
                                         expires_at=datetime.now(UTC) + timedelta(seconds=15))
        question = "Where is Ines this week?"
        assert fleeting.id in _served_ids(served.chat(user, question, k=2))
        await asyncio.sleep(max(0.0, (fleeting.expires_at - datetime.now(UTC)).total_seconds()))
        assert fleeting.id not in _served_ids(served.chat(user, question, k=2))
        assert fleeting.id not in [h.id for h in await memory.search(user, question, k=5)]
        assert [f.id async for f in memory.iter_facts(user)] == [added.id]
        direct = await memory.event(user, added.event_id)
        assert direct.stage == "extracted" and [f.id for f in direct.facts] == [added["id"]]
        assert _served_ids(served.chat(user, "What is Ines's favourite colour?", k=1)) == [
            added["id"]]  # read-your-writes: served as text at once
        listed = [f async for f in memory.iter_facts(user)]
        assert [f["id"] for f in listed] == [added["id"]]
        result = await memory.add_turns(user, [
            {"conversation_id": "c1", "turn_id": "t1", "speaker": "Ines",
             "text": "I bought a red bicycle.", "timestamp": "2025-05-01T12:00:00Z"},
            {"conversation_id": "c1", "turn_id": "t2", "speaker": "Ines"},  # no text
            {"user_id": "someone-else", "conversation_id": "c1", "turn_id": "t3",
             "speaker": "Ines", "text": "x", "timestamp": "2025-05-01T12:00:00Z"}])
        assert result["accepted"] == ["t1"]
        assert [r["index"] for r in result["refused"]] == [1, 2]
        queued = await memory.event(user, result.event_id)  # no worker has run yet
        assert (queued.stage, queued.turns, queued.facts) == ("queued", 1, [])
        # Read your writes: a read that waits answers once the workers have done their part.
        waiting = asyncio.create_task(memory.event(user, result.event_id, wait=60))
        drain = cfg.model_copy(update={"turns_topic": served.settings.turns_topic,
                                       "consumer_group": f"api-{uuid.uuid4().hex[:6]}"})
        await ingest_and_encode(drain, engine, embedder, [], encoder, store)
        ready = await waiting
        assert ready.stage == "encoded" and ready.turns_extracted == 1
        assert ready.facts and all(f.encoded and f.live for f in ready.facts)
        bicycle = await memory.get_fact(user, ready.facts[0].id)
        assert "bicycle" in bicycle["text"] and bicycle["turn_ids"] == ["t1"]
        assert (await memory.event(user, added.event_id)).stage == "encoded"
        with pytest.raises(MemoryAPIError) as theirs:  # an event is its owner's only
            await memory.event("someone-else", result.event_id)
        assert theirs.value.status == 404
        forgotten = await memory.forget(user)
        assert forgotten["facts_deleted"] == 3
        assert (await memory.list_facts(user))["facts"] == []
        with pytest.raises(MemoryAPIError) as gone:  # forgotten with its owner
            await memory.event(user, result.event_id)
        assert gone.value.status == 404


async def test_hostile_memory_api_requests_get_4xx_and_change_nothing(served, smol, cfg,
                                                                      engine, embedder):
    user = await _user_with_facts(cfg, engine, embedder, smol)
    other = await _user_with_facts(cfg, engine, embedder, smol)
    memory = MemoryClient(served.url)
    before = memory.list_facts(user)["facts"]
    theirs = memory.list_facts(other)["facts"][0]["id"]
    base = f"{served.url}/v1/memory/users/{user}"
    http = httpx.Client(headers=AUTH, timeout=60)
    refused = [
        http.get(f"{base}/facts/{theirs}"),  # another owner's fact
        http.patch(f"{base}/facts/{theirs}", json={"text": "mine now"}),
        http.delete(f"{base}/facts/{theirs}"),
        http.get(f"{base}/facts/{theirs}/history"),
        http.get(f"{base}/facts", params={"limit": 10**9}),  # huge page
        http.get(f"{base}/facts", params={"limit": 0}),
        http.get(f"{base}/facts", params={"cursor": "not a cursor"}),
        http.get(f"{base}/facts", params={"cursor": "YWZ0ZXI6LTE="}),  # after:-1
        http.get(f"{base}/facts/abc"),
        http.get(f"{base}/facts/{2**70}"),
        http.patch(f"{base}/facts/{before[0]['id']}", json={"text": ""}),
        http.patch(f"{base}/facts/{before[0]['id']}", json={"text": "x" * 5000}),
        http.patch(f"{base}/facts/{before[0]['id']}", json={"text": "ok", "user": "x"}),
        http.patch(f"{base}/facts/{before[0]['id']}", content=b"{not json"),
        http.post(f"{base}/search", json={"query": "horse", "k": 10**6}),
        http.post(f"{base}/search", json={"query": ""}),
        http.post(f"{base}/turns", json={"turns": []}),
        http.get(f"{served.url}/v1/memory/users/{'u' * 300}/facts"),
        *(http.get(f"{served.url}/v1/memory/users/{quote(bad, safe='')}/facts")
          for bad in ("a\0b", "tab\tuser", "bell\x07", "del\x7f")),  # control characters
    ]
    for response in refused:  # refused for what they ask, not for who asks
        assert 400 <= response.status_code < 500, (response.request.url, response.text)
        assert response.status_code not in (401, 403), (response.request.url, response.text)
    assert memory.list_facts(user)["facts"] == before
    assert memory.get_fact(other, theirs)["id"] == theirs


async def test_scopes_never_leak_across_agents_runs_or_users(served, smol, cfg, engine,
                                                            embedder):
    """Turns added through the API under agents and runs (turn event v2) give facts of those
    scopes; listing, search and chat requests filtered by an agent or run see only its facts,
    never another scope's or another user's of the same agent; bad scope values are a 4xx."""
    encoder, store = smol
    user, other = (f"scope-{uuid.uuid4().hex[:6]}" for _ in range(2))
    memory = MemoryClient(served.url)

    def said(turn_id: str, text: str, **scope) -> dict:
        return {"conversation_id": "c1", "turn_id": turn_id, "speaker": "Ines", "text": text,
                "timestamp": "2025-05-01T12:00:00Z", **scope}

    accepted = memory.add_turns(user, [
        said("t1", "My horse is called Biscuit."),
        said("t2", "I teach chemistry in Porto."),
        said("t3", "My sister Clara lives in Montreal.", agent_id="family", run_id="s1")],
        agent_id="tutor")
    assert accepted["accepted"] == ["t1", "t2", "t3"]
    memory.add_turns(other, [said("t1", "My horse is called Thunder.")], agent_id="tutor")
    drain = cfg.model_copy(update={"turns_topic": served.settings.turns_topic,
                                   "consumer_group": f"scopes-{uuid.uuid4().hex[:6]}"})
    await ingest_and_encode(drain, engine, embedder, [], encoder, store)

    listed = memory.list_facts(user)["facts"]
    scope_of = {f["turn_ids"][0]: (f["agent_id"], f["run_id"]) for f in listed}
    assert scope_of == {"t1": ("tutor", None), "t2": ("tutor", None), "t3": ("family", "s1")}
    ids = {f["turn_ids"][0]: f["id"] for f in listed}
    tutor = {ids["t1"], ids["t2"]}
    assert {f["id"] for f in memory.list_facts(user, agent_id="tutor")["facts"]} == tutor
    assert [f["id"] for f in memory.list_facts(user, run_id="s1")["facts"]] == [ids["t3"]]
    assert memory.list_facts(user, agent_id="family", run_id="nope")["facts"] == []
    question = "What is the name of Ines's horse?"
    assert {h["id"] for h in memory.search(user, question, k=5, agent_id="tutor")} == tutor
    assert [h["id"] for h in memory.search(user, question, k=5, agent_id="family")] == [
        ids["t3"]]
    assert set(_served_ids(served.chat(user, question, k=5,
                                       headers={"x-inferscale-agent-id": "tutor"}))) == tutor
    family = served.chat(user, question, inferscale={"k": 5, "agent_id": "family", "run_id": "s1"})
    assert _served_ids(family) == [ids["t3"]]
    assert set(_served_ids(served.chat(user, question, k=5))) == set(ids.values())

    base = f"{served.url}/v1/memory/users/{user}"
    http = httpx.Client(headers=AUTH, timeout=60)
    for response in [http.get(f"{base}/facts", params={"agent_id": ""}),
                     http.get(f"{base}/facts", params={"run_id": "r" * 300}),
                     http.post(f"{base}/search", json={"query": "horse", "agent_id": 5}),
                     http.post(f"{base}/search", json={"query": "horse", "run_id": "a\0b"}),
                     http.post(f"{base}/turns", json={"turns": [said("t9", "x")],
                                                       "agent_id": ""}),
                     served.chat(user, question, headers={"x-inferscale-run-id": "a" * 257})]:
        assert 400 <= response.status_code < 500, (response.request.url, response.text)
        assert response.status_code not in (401, 403), (response.request.url, response.text)
    assert [(f["id"], f["text"]) for f in memory.list_facts(user)["facts"]] == [
        (f["id"], f["text"]) for f in listed]  # the chats paged KV in: tiers moved, not facts


PINNED = ["Ines is vegetarian: she has not eaten meat or fish since she was sixteen, and she "
          "cooks lentil curries, mushroom risotto and chickpea stews for her friends.",
          "Ines prefers short answers in plain words, without lists, and she likes to be "
          "reminded of the dates of her sister's visits from Montreal well in advance.",
          "Ines was born in Braga in 1988, studied chemistry at the University of Porto and "
          "has taught at the same secondary school near the river since 2015.",
          "Ines rides her horse every Saturday morning at a stable outside the city, and on "
          "Sundays she plays the cello in an amateur orchestra that rehearses downtown."]


async def test_pinned_facts_are_in_every_prompt_first_and_come_exact_from_the_prefix_cache(
        served, smol, cfg, engine, embedder):
    """Pinned facts lead every memory prompt of their owner, in id order, besides the k
    retrieved; the first request of a session prefills them (nothing injected), the next ones
    read their whole blocks from vLLM's prefix cache and inject only the rest; unpinning is
    an edit, served at once; an owner at pinned_max gets a 409."""
    encoder, store = smol
    user = await _user_with_facts(cfg, engine, embedder, smol)
    memory = MemoryClient(served.url)
    pins = [memory.add_fact(user, text, pinned=True) for text in PINNED]
    assert all(p.pinned for p in pins) and [f.pinned for f in memory.list_facts(user)[
        "facts"]] == [False] * len(FACTS) + [True] * len(PINNED)
    await EncodeWorker(cfg, engine, encoder, store).run(drain=True)
    pinned_ids = [p.id for p in pins]

    first = served.chat(user, "What is the name of Ines's horse?", k=1, recompute=0)
    assert _served_ids(first)[:len(PINNED)] == pinned_ids and len(_served_ids(first)) == 5
    assert first.headers["x-inferscale-facts-pinned"] == str(len(PINNED))
    assert "horse" in memory.get_fact(user, _served_ids(first)[-1])["text"]
    planned = int(first.headers["x-inferscale-injected-tokens"])
    assert planned > 128  # the pinned facts fill at least one of the CPU engine's blocks
    assert first.json()["kv_transfer_params"]["injected_tokens"] == 0  # prefilled, exact
    second = served.chat(user, "Where does Clara live?", k=1, recompute=0)
    assert _served_ids(second)[:len(PINNED)] == pinned_ids
    injected = second.json()["kv_transfer_params"]["injected_tokens"]
    assert 0 < injected <= int(second.headers["x-inferscale-injected-tokens"]) - 128
    text = served.chat(user, "Where does Clara live?", k=1, mode="text")
    assert _served_ids(text)[:len(PINNED)] == pinned_ids  # pinned in every mode
    assert text.headers["x-inferscale-injected-tokens"] == "0"
    assert text.headers["x-inferscale-facts-injected"] == "0"
    assert not (text.json().get("kv_transfer_params") or {}).get("injected_tokens")

    unpinned = memory.edit_fact(user, pinned_ids[0], pinned=False)
    assert not unpinned.pinned and unpinned.replaces == pinned_ids[0]
    after = served.chat(user, "What is the name of Ines's horse?", k=1, recompute=0)
    assert _served_ids(after)[:3] == pinned_ids[1:] and pinned_ids[0] not in _served_ids(after)
    with pytest.raises(MemoryAPIError) as full:
        for i in range(served.settings.pinned_max):
            memory.add_fact(user, f"Ines's standing instruction number {i}.", pinned=True)
    assert full.value.status == 409 and "pinned_max" in str(full.value)
    assert sum(f.pinned for f in memory.iter_facts(user)) == served.settings.pinned_max
