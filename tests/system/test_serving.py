"""The query path through the real vLLM CPU engine: SmolLM2 + connector + memory front end."""

import asyncio
import random
import uuid

import httpx
import pytest
from kvrows import with_kv
from sqlalchemy import delete, select, update

from conftest import AUTH
from helpers import ingest_and_encode, metric, sample_turns, turn
from inferscale.contracts.blob_name import PREAMBLE, fact_blob
from inferscale.core import failpoints
from inferscale.db.encode_queue import register_model
from inferscale.db.tables import fact_kv, facts, kv_models
from inferscale.db.turns import count_user_rows
from inferscale.devstack.stack import wait_encoded, worker_process
from inferscale.kv.durable import LocalDir
from inferscale.kv.store import KVStore
from inferscale.pipeline.kafka import ensure_topics, publish_turns
from inferscale.workers.encode import EncodeWorker

pytestmark = pytest.mark.slow


@pytest.fixture
def cfg(served, settings):
    """Per-test topics with the server's model, KV directory and window."""
    return settings.model_copy(update={k: getattr(served.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "window", "top_k")})


async def _memory_tokens(engine, user: str, encoder, model: str) -> int:
    """The tokens of the user's memory (the preamble and every fact, as encoded for model)."""
    async with engine.connect() as conn:
        counts = (await conn.execute(with_kv(model, fact_kv.c.token_count).where(
            facts.c.user_id == user))).scalars().all()
    return len(encoder.layout.preamble_ids) + sum(counts)


async def test_stored_fact_answers_with_injected_kv(served, smol, cfg, engine, embedder):
    encoder, store = smol
    turns = sample_turns()
    user = turns[0].user_id
    await ingest_and_encode(cfg, engine, embedder, turns, encoder, store)
    # The KV is written by the fused CPU writer where it is built and passed its probe in the
    # engine (it does not on a CPU whose vLLM rotary rounds otherwise), else by vLLM's chain.
    stages = [f'inferscale_stage_seconds_count{{stage="{stage}"}}' for stage in (
        "compose", "sign", "plan_check", "gather", "fused_write", "rope", "cache_write")]
    before = [metric(served, stage) for stage in stages]
    response = served.chat(user, "What is the name of Sam's octopus at the aquarium?", k=5)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]
    assert "Pickles" in answer
    # Every stage of the request was timed (the bench's per-stage breakdown reads these).
    timed = [metric(served, stage) > was for stage, was in zip(stages, before, strict=True)]
    assert all(timed[:4]) and (timed[4] or all(timed[5:]))  # which writer: test_fused_cpu
    h = response.headers
    assert h["x-inferscale-mode"] == "inject" and h["x-inferscale-facts-injected"] == "5"
    injected, prefilled = int(h["x-inferscale-injected-tokens"]), int(
        h["x-inferscale-prefilled-tokens"])
    assert response.json()["kv_transfer_params"]["injected_tokens"] == injected
    assert injected + prefilled == response.json()["usage"]["prompt_tokens"]
    # With every fact retrieved, exactly the memory (preamble + all facts) is injected.
    everything = served.chat(user, "Tell me about Sam.", k=50, max_tokens=4)
    memory = await _memory_tokens(engine, user, encoder, store.fingerprint)
    assert int(everything.headers["x-inferscale-injected-tokens"]) == memory
    assert everything.json()["kv_transfer_params"]["injected_tokens"] == memory
    assert int(everything.headers["x-inferscale-prefilled-tokens"]) < memory
    # The same facts prefilled as text give the same answer; no memory does not know it.
    text = served.chat(user, "What is the name of Sam's octopus at the aquarium?", mode="text")
    assert "Pickles" in text.json()["choices"][0]["message"]["content"]
    assert text.headers["x-inferscale-injected-tokens"] == "0"
    assert text.json()["usage"]["prompt_tokens"] == injected + prefilled
    # Streaming works with memory exactly as without it.
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", timeout=120, headers=AUTH,
                      json={
            "model": "inferscale", "user": user, "stream": True, "max_tokens": 12,
            "temperature": 0, "messages": [{"role": "user", "content":
                                            "What is the name of Sam's octopus?"}]}) as stream:
        chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert len(chunks) > 2 and stream.headers["x-inferscale-mode"] == "inject"


async def test_tail_recompute_prefills_the_best_facts_after_the_injected(served, smol, cfg,
                                                                          engine, embedder):
    encoder, store = smol
    turns = sample_turns()
    user = turns[0].user_id
    await ingest_and_encode(cfg, engine, embedder, turns, encoder, store)
    question = "What is the name of Sam's octopus at the aquarium?"
    injected = served.chat(user, question, k=5)
    tail = served.chat(user, question, k=5, recompute=2)
    text = served.chat(user, question, k=5, mode="text")
    for response in (injected, tail, text):
        assert response.status_code == 200, response.text
    h, t = injected.headers, tail.headers
    # Same facts in the same prompt order (best last); the best two are now prefilled.
    assert t["x-inferscale-fact-ids"] == h["x-inferscale-fact-ids"] == text.headers[
        "x-inferscale-fact-ids"]
    assert t["x-inferscale-facts-injected"] == "3"
    assert t["x-inferscale-prompt-tokens"] == h["x-inferscale-prompt-tokens"]
    async with engine.connect() as conn:
        counts = dict((await conn.execute(with_kv(
            store.fingerprint, facts.c.id, fact_kv.c.token_count).where(
            facts.c.user_id == user))).all())
    best_two = [int(i) for i in h["x-inferscale-fact-ids"].split(",")[-2:]]
    assert int(t["x-inferscale-injected-tokens"]) == int(h["x-inferscale-injected-tokens"]) - sum(
        counts[i] for i in best_two)
    assert tail.json()["kv_transfer_params"]["injected_tokens"] == int(
        t["x-inferscale-injected-tokens"])
    assert "Pickles" in tail.json()["choices"][0]["message"]["content"]
    # Stored (conversation) order: the same facts, oldest first; the last m still recomputed.
    timed = served.chat(user, question, k=5, recompute=1, order="time")
    timed_ids = [int(i) for i in timed.headers["x-inferscale-fact-ids"].split(",")]
    assert timed_ids == sorted(int(i) for i in h["x-inferscale-fact-ids"].split(","))
    assert timed.headers["x-inferscale-facts-injected"] == "4"
    # Recomputing more facts than were retrieved prefills them all; only the preamble is KV.
    everything = served.chat(user, question, k=3, recompute=50)
    assert everything.headers["x-inferscale-facts-injected"] == "0"
    assert int(everything.headers["x-inferscale-injected-tokens"]) == len(
        encoder.layout.preamble_ids)


async def test_users_get_only_their_own_facts(served, smol, cfg, engine, embedder):
    encoder, store = smol
    a, b = (f"{n}-{uuid.uuid4().hex[:6]}" for n in ("ann", "bob"))
    await ingest_and_encode(cfg, engine, embedder, [
        turn(a, "t1", "Alex", "My favourite colour is green, like fresh grass."),
        turn(a, "t2", "Alex", "I live in Oslo with my two cats."),
        turn(b, "t1", "Alex", "My favourite colour is purple, like lavender."),
        turn(b, "t2", "Alex", "I live in Madrid with my parrot."),
    ], encoder, store)
    question = "What is Alex's favourite colour?"
    assert "green" in served.chat(a, question).json()["choices"][0]["message"]["content"].lower()
    assert "purple" in served.chat(b, question).json()["choices"][0]["message"]["content"].lower()

    from inferscale.serving.compose import MemoryRuntime, compose
    from inferscale.serving.request_options import MemoryOptions

    rt = MemoryRuntime(served.settings)
    owners: dict[int, str] = {}
    async with engine.connect() as conn:
        for fid, owner in (await conn.execute(select(facts.c.id, facts.c.user_id))).all():
            owners[fid] = owner
    users = sorted(set(owners.values()))
    rng = random.Random(7)
    queries = ["colour", "where do I live", "pets", "job", "octopus", "music", "food", "city"]
    foreign = 0
    for _ in range(300):
        user = rng.choice(users)
        prompt = await compose(rt, user, MemoryOptions(mode="inject", k=rng.choice([1, 5, 20])), [
            {"role": "user", "content": rng.choice(queries)}], rng.choice(queries))
        foreign += sum(owners[s.name.fact_id] != user
                       for s in prompt.plan.segments[1:])
    await rt.engine.dispose()
    assert foreign == 0


async def test_facts_without_kv_are_served_as_text_until_encoded(served, smol, cfg, engine,
                                                                 embedder):
    """The durable tier is full: encoding fails with the reason recorded, queries meanwhile get
    the facts as text; once the disk has room the retry stores the KV and it is injected."""
    encoder, store = smol
    cfg = cfg.model_copy(update={"encode_retry_base_s": 0.5})
    user = f"full-{uuid.uuid4().hex[:6]}"
    question = "What is the name of Cleo's sister?"
    failpoints.arm("kv.mid_write=error:ENOSPC")
    try:
        await ingest_and_encode(cfg, engine, embedder, [
            turn(user, "t1", "Cleo", "My sister's name is Rosalind and she lives in Dublin."),
            turn(user, "t2", "Cleo", "I drive a blue tram for a living.")], encoder, store)
    finally:
        failpoints.arm("")
    async with engine.connect() as conn:
        errors = (await conn.execute(with_kv(store.fingerprint, fact_kv.c.encode_error).where(
            facts.c.user_id == user))).scalars().all()
    assert len(errors) == 2 and all("No space left on device" in e for e in errors)
    response = served.chat(user, question, k=2)
    assert response.status_code == 200
    assert response.headers["x-inferscale-facts"] == "2"
    assert response.headers["x-inferscale-facts-injected"] == "0"
    assert "Rosalind" in response.json()["choices"][0]["message"]["content"]
    await asyncio.sleep(1.0)  # the retry backoff
    await EncodeWorker(cfg, engine, encoder, store).run(drain=True)
    healed = served.chat(user, question, k=2)
    assert healed.headers["x-inferscale-facts-injected"] == "2"
    assert "Rosalind" in healed.json()["choices"][0]["message"]["content"]


def _names_the_dog(response) -> bool:
    answer = response.json()["choices"][0]["message"]["content"]
    return "Waffles" in answer or "beagle" in answer


async def test_bad_blobs_are_recomputed_never_served(served, smol, cfg, engine, embedder):
    encoder, store = smol
    user = f"bad-{uuid.uuid4().hex[:6]}"
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, "t1", "Dana", "My dog is called Waffles and he is a beagle."),
        turn(user, "t2", "Dana", "I work as a florist in Bruges.")], encoder, store)
    question = "What is the name of Dana's dog?"
    async with engine.connect() as conn:
        rows = (await conn.execute(with_kv(store.fingerprint, facts.c.id, fact_kv.c.kv_location)
                                   .where(facts.c.user_id == user))).all()
    for row in rows:  # corrupt one blob's bytes, replace the other with another model's blob
        path = store.durable.root / row.kv_location
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0x55
        path.write_bytes(bytes(raw))
        break
    other = KVStore(LocalDir(store.durable.root / "other"), "0" * 64, host_bytes=0)
    blob = store.load(PREAMBLE)
    moved = other.put(fact_blob(rows[1].id), blob.k, blob.v, blob.token_ids, window=0)
    store.durable.write(rows[1].kv_location, other.durable.read(moved.location))
    failures_before = metric(served, "inferscale_kv_load_failures_total")
    response = served.chat(user, question)
    assert response.status_code == 200
    assert response.headers["x-inferscale-facts-injected"] == "2"  # planned, then refused
    # Contract: the refused KV is recomputed, never served, and the answer draws on the fact
    # (its wording is not a contract: another numeric path or CPU answered "Dana's dog is a
    # beagle." instead of naming Waffles; both words are in the fact only).
    assert metric(served, "inferscale_kv_load_failures_total") == failures_before + 1
    assert _names_the_dog(response)
    # A fact encoded for another model is not even planned for injection: the user's KV rows
    # become another model's, and the served model has none.
    other_model = "f" * 64
    mine = select(facts.c.id).where(facts.c.user_id == user).scalar_subquery()
    async with engine.begin() as conn:
        await register_model(conn, other_model)
        await conn.execute(delete(fact_kv).where(fact_kv.c.model_fingerprint == other_model,
                                                 fact_kv.c.fact_id.in_(mine)))
        moved_rows = await conn.execute(update(fact_kv).where(
            fact_kv.c.model_fingerprint == store.fingerprint, fact_kv.c.fact_id.in_(mine))
            .values(model_fingerprint=other_model))
        assert moved_rows.rowcount == len(rows)
    refused = served.chat(user, question)
    assert refused.headers["x-inferscale-facts-injected"] == "0"
    assert metric(served, "inferscale_kv_load_failures_total") == failures_before + 1
    assert _names_the_dog(refused)
    async with engine.begin() as conn:  # no facts of the module's later tests wait for it
        await conn.execute(delete(kv_models).where(kv_models.c.fingerprint == other_model))


async def test_plain_request_never_reuses_injected_blocks(served, smol, cfg, engine, embedder):
    encoder, store = smol
    user = f"salt-{uuid.uuid4().hex[:6]}"
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, f"t{i}", "Eve", f"On day {i} I planted {i} tulips in the north garden bed.")
        for i in range(1, 9)], encoder, store)
    question = "How many tulips did I plant on day 3?"
    first = served.chat(user, question, k=8)
    assert int(first.headers["x-inferscale-injected-tokens"]) > 64
    again = served.chat(user, question, k=8)  # same user and memory: may reuse its own blocks
    assert again.status_code == 200
    assert again.json()["usage"]["prompt_tokens"] == first.json()["usage"]["prompt_tokens"]
    text = served.chat(user, question, k=8, mode="text")  # same token ids, no salt
    details = text.json()["usage"]["prompt_tokens_details"] or {}
    assert (details.get("cached_tokens") or 0) == 0
    assert text.json()["usage"]["prompt_tokens"] == first.json()["usage"]["prompt_tokens"]


async def test_memory_encoded_after_start_is_used(served, smol, cfg, engine, embedder):
    encoder, store = smol
    user = f"live-{uuid.uuid4().hex[:6]}"
    before = served.chat(user, "What is Finn's favourite number?")
    assert before.headers["x-inferscale-facts"] == "0"
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, "t1", "Finn", "My favourite number is forty-two.")], encoder, store)
    after = served.chat(user, "What is Finn's favourite number?")
    assert after.headers["x-inferscale-facts-injected"] == "1"
    assert "42" in after.json()["choices"][0]["message"]["content"] or "forty" in after.json()[
        "choices"][0]["message"]["content"].lower()


def test_bad_requests_get_4xx_with_a_message(served):
    assert served.chat("u", "hi", mode="telepathy").status_code == 400
    assert "mode" in served.chat("u", "hi", mode="x").json()["error"]["message"]
    assert served.chat("u", "hi", k=-1).status_code == 400
    for recompute in (-1, "two", 10**30, [1]):
        refused = served.chat("u", "hi", recompute=recompute)
        assert refused.status_code == 400 and "recompute" in refused.json()["error"]["message"]
    for order in ("random", 3, {"by": "time"}):
        refused = served.chat("u", "hi", order=order)
        assert refused.status_code == 400 and "order" in refused.json()["error"]["message"]
    for lead in ("sometimes", 2, [True], {"on": 1}, "yes"):
        refused = served.chat("u", "hi", lead=lead)
        assert refused.status_code == 400 and "lead" in refused.json()["error"]["message"]
    refused = served.chat("u", "hi", headers={"X-InferScale-Lead": "maybe"})
    assert refused.status_code == 400 and "lead" in refused.json()["error"]["message"]
    for scaled in ("half", 1.5, -0.1, "nan", "1e999", 10**400, [0.9], {"layer": 1}, None):
        refused = served.chat("u", "hi", key_scales=scaled) if scaled is not None else (
            served.chat("u", "hi", headers={"X-InferScale-Key-Scales": "2"}))
        assert refused.status_code == 400 and "key_scales" in refused.json()["error"]["message"]
    forged = httpx.post(f"{served.url}/v1/chat/completions", timeout=30, headers=AUTH, json={
        "model": "inferscale", "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {"inferscale": {"segments": []}}})
    assert forged.status_code == 400 and "reserved" in forged.json()["error"]["message"]
    plain = served.chat(None, "Say hello.", max_tokens=4)
    assert plain.status_code == 200 and "x-inferscale-mode" not in plain.headers
    assert served.chat("u", "hi", max_tokens=1).status_code == 200  # a memory request counts
    metrics = httpx.get(f"{served.url}/metrics", timeout=30).text
    assert "inferscale_memory_requests_total" in metrics
    assert "inferscale_kv_page_in_seconds_count" in metrics


async def test_server_restart_while_ingesting_loses_no_fact(served, cfg, engine, tmp_path):
    """The vLLM server restarts while a worker process ingests and encodes: afterwards every
    fact of the user is retrieved and injected."""
    user = f"restart-{uuid.uuid4().hex[:6]}"
    said = [turn(user, f"t{i}", "Ada", f"My locker number {i} holds a {thing}.", day=1 + i)
            for i, thing in enumerate(["violin", "kite", "lamp", "globe", "drum", "map",
                                       "clock", "fern", "quilt", "sled"])]
    await ensure_topics(cfg.kafka_bootstrap, [cfg.turns_topic])
    with worker_process(cfg, tmp_path / "worker.log"):
        await publish_turns(cfg.kafka_bootstrap, cfg.turns_topic, said[:5], progress=False)
        await asyncio.to_thread(served.stop)
        await publish_turns(cfg.kafka_bootstrap, cfg.turns_topic, said[5:], progress=False)
        await asyncio.to_thread(served.start)
        await wait_encoded(engine, user, len(said), cfg, timeout_s=300, progress=False)
    response = served.chat(user, "What does Ada keep in her lockers?", k=len(said))
    assert response.status_code == 200
    assert response.headers["x-inferscale-facts"] == str(len(said))
    assert response.headers["x-inferscale-facts-injected"] == str(len(said))


async def test_forget_reaches_every_tier_and_backlog_stays_forgotten(served, smol, cfg, engine,
                                                                      embedder):
    """POST /v1/memory/forget: rows, blobs, the worker's host tier and the prefix cache; turns
    of the user still in the topic's backlog (published before the forget) stay forgotten."""
    from inferscale.workers.ingest import IngestWorker

    encoder, store = smol
    user = f"forget-{uuid.uuid4().hex[:6]}"
    said = [turn(user, "t1", "Gus", "My bank PIN hint is the colour of my first bicycle, teal."),
            turn(user, "t2", "Gus", "I keep bees on the roof of my flat in Ghent.")]
    await ingest_and_encode(cfg, engine, embedder, said, encoder, store)
    question = "What colour was Gus's first bicycle?"
    assert served.chat(user, question, k=2).headers["x-inferscale-facts-injected"] == "2"
    backlog = [turn(user, "t3", "Gus", "My locker code is 4471.")]
    await publish_turns(cfg.kafka_bootstrap, cfg.turns_topic, backlog + said, progress=False)
    for bad in (5, "", "a\0b", "tab\tuser", "u" * 257):
        refused = httpx.post(f"{served.url}/v1/memory/forget", json={"user": bad}, timeout=60,
                             headers=AUTH)
        assert refused.status_code == 400, (bad, refused.text)  # refused by the route's schema
    response = httpx.post(f"{served.url}/v1/memory/forget", json={"user": user}, timeout=120,
                          headers=AUTH)
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["facts_deleted"] == 2
    assert report["blobs_deleted"] == 3  # and the lead blob of the second (encoded after the first)
    assert report["purged_from_memory"] == 2  # the worker's host tier held both blobs
    after = served.chat(user, question, k=2)
    assert after.headers["x-inferscale-facts"] == "0"
    await IngestWorker(cfg, cfg.kafka_bootstrap, engine).run(drain=True)
    async with engine.connect() as conn:
        assert await count_user_rows(conn, user) == (0, 0)  # the backlog stayed forgotten
    later = turn(user, "t4", "Gus", "I just adopted a tortoise named Pebble.", day=2)
    await ingest_and_encode(cfg, engine, embedder, [later], encoder, store)
    async with engine.connect() as conn:
        assert await count_user_rows(conn, user) == (1, 1)  # a new memory starts after it


async def test_forget_from_the_cli_reaches_the_running_server(served, smol, cfg, engine,
                                                              embedder):
    """`inferscale forget` (no --server) publishes an invalidation that the server consumes:
    the blobs leave its workers' host tier."""
    import subprocess
    import sys

    from inferscale.core.settings import settings_env

    encoder, store = smol
    user = f"cli-forget-{uuid.uuid4().hex[:6]}"
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, "t1", "Hal", "My telescope is a ten inch Dobsonian."),
        turn(user, "t2", "Hal", "I photograph the Orion nebula every winter.")], encoder, store)
    assert served.chat(user, "What telescope does Hal use?", k=2).headers[
        "x-inferscale-facts-injected"] == "2"  # both blobs now sit in the host tier
    purged_before = metric(served, "inferscale_purged_blobs_total")
    done = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "inferscale.cli", "forget", "--user", user],
        env=settings_env(cfg), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 facts, 3 KV blobs" in done.stdout  # and the second fact's lead blob
    for _ in range(120):
        if metric(served, "inferscale_purged_blobs_total") >= purged_before + 2:
            break
        await asyncio.sleep(0.5)
    assert metric(served, "inferscale_purged_blobs_total") == purged_before + 2
    assert served.chat(user, "What telescope does Hal use?").headers["x-inferscale-facts"] == "0"


async def test_memory_that_changes_is_served_as_it_is_now(served, smol, cfg, engine, embedder):
    """Ana's city changes twice (the update step decides UPDATE, scripted here as the llm
    extractor's decider would answer): each answer injects only the current fact, and each
    replaced fact's KV leaves the durable tier and the server's memory tiers (purged through
    the invalidation topic, as a forget's are)."""
    from helpers import extract_all
    from inferscale.pipeline.invalidation import publish_invalidation
    from inferscale.pipeline.updates import Decision
    from inferscale.workers.ingest import IngestWorker

    encoder, store = smol
    user = f"moves-{uuid.uuid4().hex[:6]}"

    def decide(items):
        return [Decision("UPDATE", 0) if "moved" in new else Decision("ADD") for new, _ in items]

    async def invalidate(owner, locations):
        await publish_invalidation(cfg.kafka_bootstrap, cfg.invalidation_topic, owner, locations)

    async def say(turn_id: str, text: str, day: int) -> tuple[int, str]:
        await ensure_topics(cfg.kafka_bootstrap, [cfg.turns_topic])
        await publish_turns(cfg.kafka_bootstrap, cfg.turns_topic,
                            [turn(user, turn_id, "Ana", text, day=day)], progress=False)
        await IngestWorker(cfg, cfg.kafka_bootstrap, engine).run(drain=True)
        await extract_all(cfg, engine, embedder, decide=decide, store=store,
                          invalidate=invalidate)
        await EncodeWorker(cfg, engine, encoder, store).run(drain=True)
        async with engine.connect() as conn:
            row = (await conn.execute(with_kv(
                store.fingerprint, facts.c.id, fact_kv.c.kv_location).where(
                facts.c.user_id == user, facts.c.deleted_at.is_(None)))).one()
        return row.id, row.kv_location

    question = "Which city does Ana live in?"
    history = [await say("t1", "I live in Paris, near the Louvre.", 1)]
    for turn_id, text, day in (("t2", "I moved to Lisbon, by the river.", 2),
                               ("t3", "I moved again, to Porto.", 3)):
        served_now = served.chat(user, question, k=3)
        assert served_now.headers["x-inferscale-fact-ids"] == str(history[-1][0])
        assert served_now.headers["x-inferscale-facts-injected"] == "1"  # now in the host tier
        purged_before = metric(served, "inferscale_purged_blobs_total")
        history.append(await say(turn_id, text, day))
        assert not (store.durable.root / history[-2][1]).exists()  # the durable blob is gone
        for _ in range(120):
            if metric(served, "inferscale_purged_blobs_total") > purged_before:
                break
            await asyncio.sleep(0.5)
        assert metric(served, "inferscale_purged_blobs_total") == purged_before + 1
    final = served.chat(user, question, k=3)
    assert final.headers["x-inferscale-fact-ids"] == str(history[-1][0])
    async with engine.connect() as conn:
        chain = dict((await conn.execute(select(facts.c.id, facts.c.superseded_by).where(
            facts.c.user_id == user))).all())
    assert chain == {history[0][0]: history[1][0], history[1][0]: history[2][0],
                     history[2][0]: None}


async def test_a_fact_holding_a_lead_blob_is_served_first_in_every_mode(served, smol, cfg,
                                                                         engine, embedder):
    """Only some facts hold a lead blob; a request serves first the least relevant retrieved
    fact that holds one, outside the tail a recompute may prefill (the rest best last, as
    ranked), in the same order injected or prefilled as text, and that fact is injected from
    its lead blob."""
    encoder, store = smol
    turns = sample_turns()
    user = turns[0].user_id
    await ingest_and_encode(cfg.model_copy(update={"lead_share": 0.0, "encode_backfill": False}),
                            engine, embedder, turns, encoder, store)
    async with engine.connect() as conn:
        rows = (await conn.execute(with_kv(
            store.fingerprint, facts.c.id, fact_kv.c.kv_lead_checksum).where(
            facts.c.user_id == user))).all()
    leads = {r.id for r in rows if r.kv_lead_checksum}
    assert leads and len(leads) < len(rows)  # the first facts (encoded after < window) only
    question = "What is the name of Sam's octopus at the aquarium?"
    hits = httpx.post(f"{served.url}/v1/memory/users/{user}/search", timeout=60, headers=AUTH,
                      json={"query": question, "k": len(rows)}).json()["hits"]
    best_last = [h["id"] for h in hits][::-1]
    tail = served.settings.recompute_auto_tail  # never moved: a recompute may prefill them
    leader = next(i for i in best_last[:-tail] if i in leads)
    expected = [leader] + [i for i in best_last if i != leader]
    assert expected != best_last  # the least relevant fact holds no lead: the order moved
    for mode, leading in (("inject", 1), ("text", 0)):
        before = metric(served, "inferscale_memory_facts_total", how="lead")
        response = served.chat(user, question, mode=mode, k=len(rows), recompute=0,
                               max_tokens=2)
        assert response.status_code == 200, response.text
        assert [int(i) for i in response.headers["x-inferscale-fact-ids"].split(",")] == expected
        assert metric(served, "inferscale_memory_facts_total", how="lead") == before + leading


async def test_recompute_auto_keeps_a_sure_answer_and_recomputes_an_unsure_one(served, smol, cfg,
                                                                               engine, embedder):
    """Under ``"recompute": "auto"`` a request gets exactly the answer of every fact injected
    (m = 0) where its first token is sure, exactly the tail-recomputed answer (m = 2)
    otherwise, and exactly text prefill's where that one is unsure too; streamed or not; the
    client never sees logprobs it did not ask for, nor a token of an abandoned attempt (the
    stream holds one answer, whole)."""
    from inferscale.devstack.chat_client import stream_chat

    encoder, store = smol
    turns = sample_turns()
    user = turns[0].user_id
    await ingest_and_encode(cfg, engine, embedder, turns, encoder, store)
    question = "What is the name of Sam's octopus at the aquarium?"
    # Every request under its own cache salt: each computes its prompt whole, the same way
    # (no prefix-cache hit computes a shorter tail), so equal answers are exact by construction.
    plain = {m: served.chat(user, question, k=5, recompute=m, max_tokens=8,
                            cache_salt=uuid.uuid4().hex).json() for m in (0, 2)}
    plain["text"] = served.chat(user, question, k=5, mode="text", recompute=2, max_tokens=8,
                                cache_salt=uuid.uuid4().hex).json()
    decided = metric(served, "inferscale_recompute_auto_total")
    for margin, text_margin, decision, m in ((0.0, 1e3, "kept", 0), (1e3, 0.0, "recomputed", 2),
                                             (1e3, 1e3, "text", "text")):
        options = {"recompute": "auto", "recompute_margin": margin,
                   "recompute_text_margin": text_margin}
        response = served.chat(user, question, max_tokens=8, inferscale={"k": 5, **options},
                               cache_salt=uuid.uuid4().hex)
        assert response.status_code == 200, response.text
        assert response.headers["x-inferscale-recompute-auto"] == decision
        assert response.headers["x-inferscale-mode"] == ("text" if m == "text" else "inject")
        assert response.headers["x-inferscale-recompute"] == str(2 if m == "text" else m)
        assert float(response.headers["x-inferscale-first-margin"]) >= 0
        assert ("x-inferscale-tail-margin" in response.headers) == (m == "text")
        choice = response.json()["choices"][0]
        assert choice["message"]["content"] == plain[m]["choices"][0]["message"]["content"]
        assert choice["logprobs"] is None
        async with httpx.AsyncClient(timeout=120) as client:
            streamed = await stream_chat(client, served.url, user, question, "inject", 5,
                                         max_tokens=8, options=options)
            with_logprobs = await stream_chat(client, served.url, user, question, "inject", 5,
                                              max_tokens=8, options=options, top_logprobs=1)
        assert streamed.headers["x-inferscale-recompute-auto"] == decision
        assert streamed.text == plain[m]["choices"][0]["message"]["content"]
        assert with_logprobs.text == streamed.text and len(with_logprobs.first_top) == 1
    # The default path: the tail attempt behind a gate of its own, released unless it is a tie.
    gated = served.chat(user, question, max_tokens=8, cache_salt=uuid.uuid4().hex, inferscale={
        "k": 5, "recompute": "auto", "recompute_margin": 1e3, "recompute_text_margin": 1e-9})
    assert gated.status_code == 200, gated.text
    outcome, tail_margin = (gated.headers["x-inferscale-recompute-auto"],
                            float(gated.headers["x-inferscale-tail-margin"]))
    assert (outcome, tail_margin >= 1e-9) in (("recomputed", True), ("text", False))
    expected = plain[2 if outcome == "recomputed" else "text"]["choices"][0]["message"]
    assert gated.json()["choices"][0]["message"]["content"] == expected["content"]
    assert gated.json()["choices"][0]["logprobs"] is None
    assert sum(metric(served, "inferscale_recompute_auto_total", decision=outcome)
               for outcome in ("kept", "recomputed", "text")) == decided + 10
    # An abandoned stream is aborted in the engine, not generated to its end: here the first
    # attempt would go on for 64 tokens (no end of sequence), the answer has 64.
    generated = metric(served, "vllm:generation_tokens_total")
    body = {"model": "inferscale", "user": user, "stream": True, "max_tokens": 64,
            "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": question}],
            "inferscale": {"k": 5, "recompute": "auto", "recompute_margin": 1e3,
                           "recompute_text_margin": 0}}
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as client, client.stream(
            "POST", f"{served.url}/v1/chat/completions", json=body) as response:
        assert response.headers["x-inferscale-recompute-auto"] == "recomputed"
        chunks = [line async for line in response.aiter_lines() if line.startswith("data: {")]
    assert len(chunks) > 32
    assert metric(served, "vllm:generation_tokens_total") - generated - 64 < 16
    # Non-streamed, the abandoned attempt is a one-token probe, not a 64-token answer.
    generated = metric(served, "vllm:generation_tokens_total")
    whole = httpx.post(f"{served.url}/v1/chat/completions", json={**body, "stream": False},
                       headers=AUTH, timeout=120)
    assert whole.headers["x-inferscale-recompute-auto"] == "recomputed"
    assert whole.json()["usage"]["completion_tokens"] == 64
    assert metric(served, "vllm:generation_tokens_total") - generated - 64 < 16
    kept = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        **body, "stream": False, "inferscale": {"k": 5, "recompute": "auto",
                                                "recompute_margin": 0}})
    assert kept.headers["x-inferscale-recompute-auto"] == "kept"
    assert kept.json()["usage"]["completion_tokens"] == 64
    assert kept.json()["choices"][0]["logprobs"] is None  # the probe's logprobs stay ours
    refused = served.chat(user, question, inferscale={"recompute": "auto",
                                                      "recompute_margin": -1})
    assert refused.status_code == 400
