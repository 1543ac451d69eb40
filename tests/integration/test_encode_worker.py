"""Encode stage on the real Postgres: every ingested fact gets verified pre-RoPE KV, once."""

import asyncio
import errno
import os
import signal
import subprocess
import uuid
from itertools import pairwise

import pytest
import torch
from kvrows import KV_COLUMNS, with_kv
from sqlalchemy import select, text

from helpers import extract_all, ingest_and_encode, sample_turns, turn
from inferscale.contracts.blob_name import fact_blob, holds_lead, lead_blob
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core import failpoints
from inferscale.core.settings import Settings
from inferscale.db.encode_queue import (
    PendingFact,
    claim_backfill_facts,
    claim_pending_facts,
    count_backfill_facts,
    count_pending_facts,
    mark_backfill_due,
    quarantine_crashed_facts,
    record_encode_failure,
    register_model,
)
from inferscale.db.tables import fact_kv, facts
from inferscale.db.turns import count_user_rows
from inferscale.devstack.stack import worker_process
from inferscale.kv.durable import LocalDir
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.store import KVStore
from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns
from inferscale.serving.forget import forget_user
from inferscale.workers.encode import EncodeWorker
from inferscale.workers.ingest import IngestWorker
from inferscale.workers.maintenance import MaintenanceWorker


@pytest.fixture(autouse=True)
async def one_test_one_memory(engine):
    """Each test starts from no facts and no registered models: a worker registering a model
    enrols every live fact for it, so one test's facts would become the next one's work."""
    yield
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM facts"))
        await conn.execute(text("DELETE FROM kv_models"))


@pytest.fixture(scope="module")
def llama(tiny_models) -> str:
    """The tiny Llama's fingerprint: the model most tests encode for."""
    return model_fingerprint(tiny_models["llama"])


def _cosine_distance(a, b) -> float:
    a, b = torch.tensor(list(a)), torch.tensor(list(b))
    return 1.0 - float(torch.nn.functional.cosine_similarity(a, b, dim=0))


async def _user_facts(engine, user, model: str | None = None):
    """The user's facts, oldest first, each with its KV for ``model`` (None: for each model
    registered, one row per model)."""
    query = with_kv(model) if model is not None else select(facts, *KV_COLUMNS).select_from(
        facts.outerjoin(fact_kv, fact_kv.c.fact_id == facts.c.id))
    async with engine.connect() as conn:
        return (await conn.execute(query.where(facts.c.user_id == user).order_by(
            facts.c.ts, fact_kv.c.model_fingerprint))).all()


async def test_ingested_facts_get_verified_kv_once(settings, engine, embedder, tiny_encoder,
                                                   llama, tmp_path):
    settings = settings.model_copy(update={"window": 3, "encode_batch_size": 6})
    turns = sample_turns()
    user = turns[0].user_id
    await ingest_and_encode(settings, engine, embedder, turns)
    async with engine.begin() as conn:
        await register_model(conn, llama)
    async with engine.begin() as conn:  # context = the 3 preceding facts, oldest first
        claimed = {f.id: f for f in await claim_pending_facts(conn, llama, 1000, 3, 3, 60, 3)}
        rows = await _user_facts(engine, user)
        fifth = claimed[rows[4].id]
        assert fifth.context == [r.text for r in rows[1:4]]
        await conn.rollback()
    async with engine.begin() as conn:  # neighbours: the 3 most similar earlier, nearest last
        claimed = {f.id: f for f in await claim_pending_facts(conn, llama, 1000, 3, 3, 60, 3,
                                                               "neighbours")}
        assert claimed[rows[0].id].context == []
        last = rows[-1]
        distance = {r.text: _cosine_distance(r.embedding, last.embedding) for r in rows[:-1]}
        context = claimed[last.id].context
        assert len(context) == 3 and set(context) <= set(distance)
        chosen = [distance[text] for text in context]
        assert all(a >= b - 1e-5 for a, b in pairwise(chosen))  # nearest last
        others = [d for text, d in distance.items() if text not in context]
        assert min(others) >= max(chosen) - 1e-5  # no earlier fact nearer than those chosen
        await conn.rollback()
    store = KVStore(LocalDir(tmp_path / "kv"), llama, host_bytes=1 << 30)
    stats = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert stats.encoded >= len(turns) and stats.failed == 0
    rows = await _user_facts(engine, user)
    assert len(rows) == len(turns)
    fresh = KVStore(store.durable, store.fingerprint, host_bytes=1 << 30)
    for row in rows:
        assert row.kv_location and row.window == 3 and row.model_fingerprint == store.fingerprint
        assert row.token_ids == tiny_encoder.layout.fact_segment(row.text)
        assert row.token_count == len(row.token_ids)
        blob = fresh.get(row.kv_location, row.kv_checksum)  # verifies checksum + fingerprint
        assert blob.token_ids == row.token_ids
        assert blob.k.shape[:2] == (tiny_encoder.config.num_hidden_layers, len(row.token_ids))
    blobs_before = sorted(p.name for p in store.durable.root.rglob("*.safetensors"))
    # Redelivery: a replay of the topic creates no new facts and nothing to encode.
    replay = settings.model_copy(update={"consumer_group": settings.consumer_group + "-r"})
    await IngestWorker(replay, replay.kafka_bootstrap, engine).run(drain=True)
    again = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert again.encoded == 0
    assert sorted(p.name for p in store.durable.root.rglob("*.safetensors")) == blobs_before
    assert [r.kv_checksum for r in await _user_facts(engine, user)] == [
        r.kv_checksum for r in rows]


async def test_lead_encodings_are_the_facts_after_the_preamble_alone(settings, engine, embedder,
                                                                   tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 2, "kv_format": "raw", "lead_share": 1.0})
    user, plain = (f"{name}-{uuid.uuid4().hex[:6]}" for name in ("lead", "plain"))
    await ingest_and_encode(settings, engine, embedder, sample_turns(user)[:4])
    store = KVStore(LocalDir(tmp_path / "kv"), "e" * 64, host_bytes=1 << 30)
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    rows = await _user_facts(engine, user)
    assert rows[0].kv_lead_checksum is None  # no context: its one encoding is the lead one
    for row in rows[1:]:
        lead = store.load(lead_blob(row.id), row.kv_lead_checksum)
        alone = tiny_encoder.encode([tiny_encoder.fact_item(row.text, [])])[0]
        assert lead.token_ids == row.token_ids and lead.window == 0
        assert torch.allclose(lead.k.float(), alone.k.float(), atol=1e-5)
        assert torch.allclose(lead.v.float(), alone.v.float(), atol=1e-5)
        assert not torch.allclose(store.get(row.kv_location).k.float(), alone.k.float(),
                                  atol=1e-3)  # the fact's own encoding had context
    forgotten = await forget_user(engine, store, user)
    assert (forgotten.facts, forgotten.blobs) == (4, 4 + 3)
    assert not list((tmp_path / "kv").rglob(f"{rows[1].id}*.safetensors"))
    assert store.location_for(lead_blob(rows[1].id)) not in store.host
    # Switched off, the worker writes one blob per fact.
    off = settings.model_copy(update={"lead_encoding": False})
    await ingest_and_encode(off, engine, embedder, sample_turns(plain)[:3])
    await EncodeWorker(off, engine, tiny_encoder, store).run(drain=True)
    assert [r.kv_lead_checksum for r in await _user_facts(engine, plain)] == [None] * 3
    assert not list((tmp_path / "kv").rglob("*.lead.safetensors"))


async def test_lead_blobs_go_to_small_memories_and_a_share_of_the_rest(settings, engine,
                                                                      embedder, tiny_encoder,
                                                                      tmp_path):
    """A fact encoded after fewer than ``window`` others gets a lead blob; of the others, those
    whose id hashes into ``lead_share``; a fact with no context needs none."""
    settings = settings.model_copy(update={"window": 2, "lead_share": 0.5,
                                           "encode_backfill": False})
    turns = sample_turns(f"need-{uuid.uuid4().hex[:6]}")[:8]
    await ingest_and_encode(settings, engine, embedder, turns)
    store = KVStore(LocalDir(tmp_path / "kv"), "e" * 64, host_bytes=1 << 30)
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    rows = await _user_facts(engine, turns[0].user_id)
    assert [r.context_facts for r in rows] == [0, 1] + [2] * 6
    wanted = [False, True] + [holds_lead(r.id, 0.5) for r in rows[2:]]
    assert [r.kv_lead_checksum is not None for r in rows] == wanted
    on_disk = {p.name for p in (tmp_path / "kv").rglob("*.lead.safetensors")}
    assert on_disk == {f"{lead_blob(r.id)}.safetensors" for r, w in zip(rows, wanted,
                                                                         strict=True) if w}
    for row in rows:
        if row.kv_lead_checksum:
            assert store.load(lead_blob(row.id), row.kv_lead_checksum).window == 0
        files = [p for p in (tmp_path / "kv").rglob("*.safetensors")
                 if p.name.split(".")[0] == str(row.id)]
        assert row.kv_bytes == sum(p.stat().st_size for p in files)  # what the budget counts


async def test_a_lead_blob_left_by_a_dead_claimer_goes_when_its_fact_needs_none(
        settings, engine, embedder, tiny_encoder, tmp_path):
    """A worker that died after writing a fact's lead blob, before recording it, leaves a blob
    that the next encoding may not want (the memory grew meanwhile): that encoding removes it,
    so the durable tier holds only the blobs rows name."""
    settings = settings.model_copy(update={"window": 2, "lead_share": 0.0, "encode_lease_s": 0.5,
                                           "encode_backfill": False})
    turns = sample_turns(f"dead-lead-{uuid.uuid4().hex[:6]}")[:4]
    await ingest_and_encode(settings, engine, embedder, turns)
    store = KVStore(LocalDir(tmp_path / "kv"), "e" * 64, host_bytes=0)
    async with engine.begin() as conn:  # a worker claims the facts...
        await register_model(conn, store.fingerprint)
        claimed = await claim_pending_facts(conn, store.fingerprint, 10, 2, 3,
                                            settings.encode_lease_s, 3)
    last = max(claimed, key=lambda fact: fact.id)
    stray = torch.zeros(2, 3, 1, 8, dtype=torch.bfloat16)  # ...writes a lead blob and dies
    store.put(lead_blob(last.id), stray, stray.clone(), [1, 2, 3], window=0)
    await asyncio.sleep(0.6)  # its lease runs out
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    rows = await _user_facts(engine, turns[0].user_id)
    assert all(row.kv_location for row in rows)
    # the second fact had one other before it (a small memory); the last has its window
    assert [r.kv_lead_checksum is not None for r in rows] == [False, True, False, False]
    on_disk = {p.name for p in (tmp_path / "kv").rglob("*.lead.safetensors")}
    assert on_disk == {f"{lead_blob(rows[1].id)}.safetensors"}


@pytest.mark.parametrize("error", ["ENOSPC", "EACCES"])
async def test_durable_tier_errors_are_recorded_and_retried_until_they_clear(
        error, settings, engine, embedder, tiny_encoder, tiny_models, tmp_path):
    settings = settings.model_copy(update={"encode_max_attempts": 1, "window": 0,
                                           "encode_retry_base_s": 0.5})
    turns = sample_turns()[:3]
    user = turns[0].user_id
    await ingest_and_encode(settings, engine, embedder, turns)
    store = KVStore(LocalDir(tmp_path / "kv"), model_fingerprint(tiny_models["llama"]),
                    host_bytes=0)
    failpoints.arm(f"kv.mid_write=error:{error}")  # the disk fills up in the middle of a write
    try:
        failed = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    finally:
        failpoints.arm("")
    rows = await _user_facts(engine, user)
    assert failed.failed == len(turns) and failed.encoded == 0
    reason = os.strerror(getattr(errno, error))
    assert all(r.kv_location is None and r.encode_error.startswith("storage: ")
               and reason in r.encode_error and r.retry_at is not None for r in rows)
    root = store.durable.root
    assert not list(root.rglob("*.tmp")) and not list(root.rglob("*.safetensors"))
    # Backoff: not retried at once, even past encode_max_attempts...
    assert (await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)).failed == 0
    await asyncio.sleep(1.0)
    # ...but once it is over and the disk has room again, every fact gets its KV.
    healed = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert healed.encoded == len(turns) and healed.failed == 0
    rows = await _user_facts(engine, user)
    assert all(r.kv_location and r.encode_error is None and r.retry_at is None for r in rows)
    for row in rows:
        store.get(row.kv_location, row.kv_checksum)


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB tmpfs (root with mount rights only), grown on demand."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the failpoint "
                    "tests above cover the same path")

    def grow() -> None:
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)

    yield mount, grow
    subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_real_full_disk_fails_facts_cleanly_and_they_heal(settings, engine, embedder,
                                                                tiny_encoder, tiny_models,
                                                                small_disk):
    mount, grow = small_disk
    settings = settings.model_copy(update={"window": 0, "encode_retry_base_s": 0.2,
                                           "encode_batch_size": 4})
    turns = sample_turns()
    user = turns[0].user_id
    await ingest_and_encode(settings, engine, embedder, turns)
    store = KVStore(LocalDir(mount / "kv"), model_fingerprint(tiny_models["llama"]), host_bytes=0)
    full = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    rows = await _user_facts(engine, user)
    failed = [r for r in rows if r.kv_location is None]
    assert full.failed > 0 and failed
    assert all("No space left on device" in r.encode_error for r in failed)
    assert not list(store.durable.root.rglob("*.tmp"))  # no half-written file is left behind
    for row in rows:
        if row.kv_location:
            store.get(row.kv_location, row.kv_checksum)  # what did fit is complete
    grow()
    await asyncio.sleep(1.0)
    healed = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert healed.encoded == len(failed)
    rows = await _user_facts(engine, user)
    assert all(r.kv_location and r.encode_error is None for r in rows)


class _CrashingEncoder:
    """The real encoder whose forward pass fails (a model bug, not a storage problem)."""

    def __init__(self, inner: FactEncoder):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, items):
        raise RuntimeError("forward pass failed")


async def test_encode_errors_are_retried_a_bounded_number_of_times(settings, engine, embedder,
                                                                   tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"encode_max_attempts": 2, "window": 0,
                                           "encode_retry_base_s": 0.1})
    turns = sample_turns()[:3]
    user = turns[0].user_id
    await ingest_and_encode(settings, engine, embedder, turns)
    store = KVStore(LocalDir(tmp_path / "kv"), "f" * 64, host_bytes=1 << 20)
    crashing = _CrashingEncoder(tiny_encoder)
    for _ in range(2):
        assert (await EncodeWorker(settings, engine, crashing, store).run(drain=True)).failed == 3
        await asyncio.sleep(0.5)
    rows = await _user_facts(engine, user)
    assert all(r.kv_location is None and r.encode_attempts == 2
               and r.encode_error == "encode: RuntimeError: forward pass failed" for r in rows)
    # Bounded: after max attempts the facts are no longer claimed.
    assert (await EncodeWorker(settings, engine, crashing, store).run(drain=True)).failed == 0


def _nearest_last(row, among, n):
    """The ``n`` rows of ``among`` nearest to ``row`` (ties by id), as texts, nearest last."""
    ranked = sorted((r for r in among if r.id != row.id),
                    key=lambda r: (_cosine_distance(r.embedding, row.embedding), r.id))
    return [r.text for r in ranked[:n]][::-1]


async def test_early_facts_are_encoded_again_once_their_user_has_3w_facts(
        settings, engine, embedder, tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 2, "kv_format": "raw"})
    turns, plain = sample_turns()[:6], sample_turns()[:6]
    user = turns[0].user_id
    store = KVStore(LocalDir(tmp_path / "kv"), "e" * 64, host_bytes=1 << 30)
    await ingest_and_encode(settings, engine, embedder, turns[:3])
    first = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    before = await _user_facts(engine, user)
    assert [r.context_facts for r in before] == [0, 1, 2] and first.reencoded == 0
    assert not any(r.backfill_due for r in before) and before[0].kv_lead_checksum is None
    for row in before:  # a server's memory tier holds the first versions
        store.get(row.kv_location, row.kv_checksum)
    await ingest_and_encode(settings, engine, embedder, turns[3:])
    async with engine.begin() as conn:  # 6 = 3w live facts: the two early ones are due
        assert await mark_backfill_due(conn, store.fingerprint, [user], 2) == 2
        assert await count_backfill_facts(conn, store.fingerprint, 3, user) == 2
        await conn.rollback()
    second = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert (second.encoded, second.reencoded, second.failed) == (3 + 2, 2, 0)
    rows = await _user_facts(engine, user)
    assert [r.context_facts for r in rows] == [2] * 6 and not any(r.backfill_due for r in rows)
    for old, row in zip(before, rows[:3], strict=True):
        assert row.kv_location == old.kv_location
        assert (row.kv_checksum != old.kv_checksum) == (old.context_facts < 2)
    for row in rows[:2]:  # after its 2 nearest among the user's first 6 facts, nearest last
        expected = tiny_encoder.encode([tiny_encoder.fact_item(row.text,
                                                               _nearest_last(row, rows, 2))])[0]
        served = store.load(fact_blob(row.id), row.kv_checksum)  # not the old copy held in memory
        assert torch.allclose(served.k.float(), expected.k.float(), atol=1e-4)
        assert torch.allclose(served.v.float(), expected.v.float(), atol=1e-4)
        assert store.load(lead_blob(row.id), row.kv_lead_checksum).token_ids == row.token_ids
    assert (await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)).encoded == 0
    # Facts stored after 3w are encoded after full context at once; switched off, no backfill.
    off = settings.model_copy(update={"encode_backfill": False})
    await ingest_and_encode(off, engine, embedder, plain)
    assert (await EncodeWorker(off, engine, tiny_encoder, store).run(drain=True)).reencoded == 0
    assert [r.context_facts for r in await _user_facts(engine, plain[0].user_id)] == [
        0, 1, 2, 2, 2, 2]


async def test_a_failed_reencoding_keeps_the_facts_kv_and_is_not_retried(
        settings, engine, embedder, tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 1, "encode_retry_base_s": 60})
    turns = sample_turns()[:3]
    user = turns[0].user_id
    store = KVStore(LocalDir(tmp_path / "kv"), "e" * 64, host_bytes=0)
    await ingest_and_encode(settings, engine, embedder, turns[:1])
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    (encoded,) = await _user_facts(engine, user)
    await ingest_and_encode(settings, engine, embedder, turns[1:])
    stats = await EncodeWorker(settings, engine, _CrashingEncoder(tiny_encoder), store).run(
        drain=True)
    assert stats.failed == 2 + 1  # the two new facts, then the early one's re-encoding
    row = (await _user_facts(engine, user))[0]
    assert (row.kv_location, row.kv_checksum) == (encoded.kv_location, encoded.kv_checksum)
    assert row.encode_error == "encode: RuntimeError: forward pass failed" and row.backfill_due
    assert store.get(row.kv_location, row.kv_checksum).token_ids == row.token_ids
    async with engine.connect() as conn:
        assert await count_backfill_facts(conn, store.fingerprint, 3, user) == 0
    async with engine.begin() as conn:
        assert row.id not in {f.id for f in await claim_backfill_facts(
            conn, store.fingerprint, 100, 1, 60, 3)}
        await conn.rollback()


async def test_forget_removes_user_everywhere_and_spares_others(settings, engine, embedder,
                                                                tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 2, "lead_share": 1.0})
    victim, other = (f"{name}-{uuid.uuid4().hex[:6]}" for name in ("victim", "other"))
    await ingest_and_encode(settings, engine, embedder,
                            sample_turns(victim)[:6] + sample_turns(other)[:6])
    store = KVStore(LocalDir(tmp_path / "kv"), "e" * 64, host_bytes=1 << 30)
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    victim_rows = await _user_facts(engine, victim)
    for row in victim_rows:
        store.get(row.kv_location)  # warm the host tier too
    forgotten = await forget_user(engine, store, victim)
    # and a lead blob each: with 3w facts the first one, too, is encoded after context
    assert forgotten.facts == 6 and forgotten.blobs == 6 + 6
    async with engine.connect() as conn:
        assert await count_user_rows(conn, victim) == (0, 0)
        assert await count_user_rows(conn, other) == (6, 6)
    for row in victim_rows:
        assert row.kv_location not in store.host
        assert not (store.durable.root / row.kv_location).exists()
    for row in await _user_facts(engine, other):
        assert store.get(row.kv_location, row.kv_checksum).token_ids == row.token_ids


async def test_duty_cycle_rest_scales_with_busy_time_and_yields_to_stop(settings, engine,
                                                                         tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"encode_duty_cycle": 0.25})
    worker = EncodeWorker(settings, engine, tiny_encoder, KVStore(LocalDir(tmp_path), "f" * 64, 0))
    began = asyncio.get_running_loop().time()
    await worker.after_batch(0.1)  # busy 0.1 s at a 25% duty cycle -> rest 0.3 s
    assert 0.29 <= asyncio.get_running_loop().time() - began < 2
    resting = asyncio.create_task(worker.after_batch(3600))
    await asyncio.sleep(0.05)
    worker.request_stop()
    await asyncio.wait_for(resting, 5)  # a stop ends the rest at once


async def test_claims_of_dead_workers_are_counted_and_the_fact_quarantined(
        settings, engine, embedder, tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 0, "encode_lease_s": 0.5,
                                           "encode_max_crashes": 2})
    store = KVStore(LocalDir(tmp_path / "kv"), "f" * 64, host_bytes=0)
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)  # nothing else due
    turns = sample_turns()[:3]
    await ingest_and_encode(settings, engine, embedder, turns)
    ids = [row.id for row in await _user_facts(engine, turns[0].user_id)]

    async def claim() -> list[PendingFact]:
        async with engine.begin() as conn:
            return await claim_pending_facts(conn, store.fingerprint, 10, 0, 3,
                                             settings.encode_lease_s, 2)

    dead_claim = await claim()  # a worker claims the batch, then dies while encoding it
    assert sorted(f.id for f in dead_claim) == sorted(ids)
    assert await claim() == []  # leased: nobody else takes them meanwhile
    await asyncio.sleep(0.6)
    suspect = await claim()  # the lease ran out: suspects come back one at a time
    assert [f.id for f in suspect] == [min(ids)]
    async with engine.begin() as conn:  # the first claimer's late outcome is not recorded
        await record_encode_failure(conn, store.fingerprint, dead_claim[0], "encode: late", 1.0,
                                    1.0)
    assert {r.id: r.encode_attempts for r in await _user_facts(engine, turns[0].user_id)}[
        min(ids)] == 0
    await asyncio.sleep(0.6)  # ...and this claimer died too: two deaths
    async with engine.begin() as conn:
        # Two deaths exhaust a crash budget of 2 (not one of 9): no longer pending...
        model = store.fingerprint
        assert await count_pending_facts(conn, model, 3, 2) == await count_pending_facts(
            conn, model, 3, 9) - 1
        assert await quarantine_crashed_facts(conn, model, 2) == [min(ids)]
        assert await quarantine_crashed_facts(conn, model, 2) == []
        # ...and once quarantined, not even with a larger budget.
        assert await count_pending_facts(conn, model, 3, 9) == await count_pending_facts(
            conn, model, 3, 2)
    stats = await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert (stats.encoded, stats.failed) == (len(ids) - 1, 0)
    rows = {row.id: row for row in await _user_facts(engine, turns[0].user_id)}
    assert rows[min(ids)].kv_location is None and rows[min(ids)].claimed_until is None
    assert rows[min(ids)].encode_error == "quarantined: worker died 2 times while encoding it"
    assert all(r.kv_location and r.claimed_until is None for i, r in rows.items() if i != min(ids))


class _ForgettingEncoder(_CrashingEncoder):
    """The real encoder; while it runs, the facts' user is forgotten (from the event loop)."""

    def __init__(self, inner: FactEncoder, forget):
        super().__init__(inner)
        self.forget = forget

    def encode(self, items):
        self.forget()
        return self.inner.encode(items)


async def test_a_user_forgotten_while_encoding_leaves_no_kv(settings, engine, embedder,
                                                            tiny_encoder, tmp_path):
    settings = settings.model_copy(update={"window": 0})
    store = KVStore(LocalDir(tmp_path / "kv"), "f" * 64, host_bytes=0)
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    turns = sample_turns()[:3]
    await ingest_and_encode(settings, engine, embedder, turns)
    loop = asyncio.get_running_loop()

    def forget() -> None:
        asyncio.run_coroutine_threadsafe(
            forget_user(engine, store, turns[0].user_id), loop).result(30)

    stats = await EncodeWorker(settings, engine, _ForgettingEncoder(tiny_encoder, forget),
                               store).run(drain=True)
    assert stats.encoded == 0
    assert {p.name for p in store.durable.root.rglob("*.safetensors")} == {"preamble.safetensors"}


async def test_the_maintenance_stage_sweeps_orphan_blobs_when_it_starts(
        settings, engine, embedder, tiny_encoder, tmp_path):
    store = KVStore(LocalDir(tmp_path / "kv"), "f" * 64, host_bytes=0)
    turns = sample_turns()[:2]
    await ingest_and_encode(settings, engine, embedder, turns)
    orphan = store.put(fact_blob(10**15), *_kv_like(tiny_encoder), [1], window=0)  # no such fact
    stats = await EncodeWorker(settings.model_copy(update={"window": 0}), engine, tiny_encoder,
                               store).run(drain=True)
    assert stats.encoded >= len(turns) and store.durable.exists(orphan.location)
    assert (await MaintenanceWorker(settings, engine, store).run(drain=True)).swept == 1
    assert not store.durable.exists(orphan.location)
    kept = {p.name for p in store.durable.root.rglob("*.safetensors")}
    assert "preamble.safetensors" in kept and len(kept) == stats.encoded + 1


def _kv_like(encoder) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's K and V in the shape the encoder stores."""
    span = encoder.encode([encoder.fact_item("x", [])])[0]
    return span.k[:, :1].clone(), span.v[:, :1].clone()


async def test_a_fact_that_kills_its_worker_is_quarantined_and_the_rest_encode(
        settings, engine, tiny_models, tmp_path, monkeypatch):
    user = f"poison-{uuid.uuid4().hex[:6]}"
    texts = ["I like tea.", "I live in Oslo.", "POISON pill.", "I have a cat.", "I ride a bike."]
    security = kafka_security(settings)
    await ensure_topics(settings.kafka_bootstrap, [settings.turns_topic], security=security)
    await publish_turns(settings.kafka_bootstrap, settings.turns_topic,
                        [turn(user, f"t{i}", "Kim", text) for i, text in enumerate(texts)],
                        progress=False, security=security)
    cfg = settings.model_copy(update={"model_path": tiny_models["llama"], "window": 1,
                                      "kv_dir": tmp_path / "kv", "encode_lease_s": 1.0})
    monkeypatch.setenv("INFERSCALE_FAILPOINTS", "encode.before_forward=kill@1.0~POISON")
    deaths = 0
    for _ in range(cfg.encode_max_crashes + 1):  # an orchestrator restarting the worker
        with worker_process(cfg, tmp_path / "worker.log") as proc:
            settled = await _poison_settled(engine, user, proc)
            if not settled:
                assert proc.returncode == -signal.SIGKILL
                deaths += 1
                continue
            await asyncio.sleep(3)
            assert proc.poll() is None  # the worker stays up: the fact is not claimed again
            break
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert deaths == cfg.encode_max_crashes, log[-3000:]
    # beside a server, a worker takes its share of the cores for torch (stack.sharing_cores)
    assert f"torch threads: {max(1, (os.cpu_count() or 1) // 2)}" in log
    rows = {row.text.split(": ", 1)[1]: row for row in await _user_facts(engine, user)}
    assert rows["POISON pill."].encode_error == (
        f"quarantined: worker died {cfg.encode_max_crashes} times while encoding it")
    assert all(row.kv_location for text, row in rows.items() if text != "POISON pill.")


async def _poison_settled(engine, user: str, proc, timeout_s: float = 180) -> bool:
    """Wait until the poison fact is quarantined and the others encoded (True) or the worker
    died (False)."""
    for _ in range(int(timeout_s / 0.5)):
        if proc.poll() is not None:
            return False
        rows = await _user_facts(engine, user)
        if len(rows) == 5 and all(r.kv_location or (r.encode_error or "").startswith(
                "quarantined") for r in rows):
            return True
        await asyncio.sleep(0.5)
    raise AssertionError("neither quarantined nor dead in time")


def test_a_worker_sharing_the_host_takes_its_share_of_the_cores(settings):
    from pydantic import ValidationError

    from inferscale.devstack.stack import sharing_cores

    cores = os.cpu_count() or 1
    assert sharing_cores(settings, 2).worker_threads == max(1, cores // 2)
    assert sharing_cores(settings, 1).worker_threads == cores
    assert sharing_cores(settings, 10 * cores).worker_threads == 1
    assert sharing_cores(settings, 0).worker_threads == cores
    pinned = settings.model_copy(update={"worker_threads": 3})
    assert sharing_cores(pinned, 2).worker_threads == 3  # an explicit setting wins
    for bad in (0, -2, "many", 1.5):
        with pytest.raises(ValidationError, match="worker_threads"):
            Settings(worker_threads=bad)


async def test_a_fact_edited_while_encoding_leaves_no_old_kv_and_the_edit_stays(
        settings, engine, embedder, tiny_encoder, tmp_path):
    """An edit (memory API) lands while the old version's KV is being encoded: the old blob is
    removed when the encode records it, the old version stays retired, the new version gets
    its own KV; a redelivery of every turn and a replay of the topic from the start (a new
    consumer group: the backlog) bring neither the old version nor a second fact back."""
    from inferscale.db.memory_edits import delete_fact, edit_fact

    settings = settings.model_copy(update={"window": 0})
    store = KVStore(LocalDir(tmp_path / "kv"), "f" * 64, host_bytes=0)
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    turns = sample_turns()[:3]
    user = turns[0].user_id
    await ingest_and_encode(settings, engine, embedder, turns)
    first, second, third = [row.id for row in await _user_facts(engine, user)]
    new_text = "1 March 2025 Sam: I live in Porto now."
    vector = [float(x) for x in embedder.encode([new_text])[0]]
    loop = asyncio.get_running_loop()
    edited: list[int] = []

    def edit() -> None:
        async def go() -> None:
            async with engine.begin() as conn:
                result = await edit_fact(conn, user, store.fingerprint, first, new_text,
                                         vector)
                assert result is not None
                edited.append(result[0].id)

        if not edited:  # the first batch only: the old versions are being encoded now
            asyncio.run_coroutine_threadsafe(go(), loop).result(30)

    await EncodeWorker(settings, engine, _ForgettingEncoder(tiny_encoder, edit),
                       store).run(drain=True)
    async with engine.begin() as conn:
        assert (await delete_fact(conn, user, second))[0]
    rows = {row.id: row for row in await _user_facts(engine, user)}
    assert rows[first].deleted_at is not None and rows[first].superseded_by == edited[0]
    assert not (store.durable.root / store.location_for(fact_blob(first))).exists()  # removed
    assert rows[edited[0]].kv_location
    assert (store.durable.root / rows[edited[0]].kv_location).exists()
    live_before = [(r.id, r.text) for r in (await _live_records(engine, user, store))]

    await publish_turns(settings.kafka_bootstrap, settings.turns_topic, turns, progress=False,
                        security=kafka_security(settings))
    replay = settings.model_copy(update={"consumer_group": f"replay-{uuid.uuid4().hex[:6]}"})
    for worker_settings in (settings, replay):  # the redelivery, then the whole backlog again
        await IngestWorker(worker_settings, worker_settings.kafka_bootstrap, engine).run(
            drain=True)
    await extract_all(settings, engine, embedder)
    await EncodeWorker(settings, engine, tiny_encoder, store).run(drain=True)
    assert [(r.id, r.text) for r in await _live_records(engine, user, store)] == live_before
    assert [text for _, text in live_before] == [rows[third].text, new_text]


async def _live_records(engine, user, store):
    from inferscale.db.memory_edits import list_facts

    async with engine.connect() as conn:
        return await list_facts(conn, user, store.fingerprint, 0, 100)


async def test_one_memory_gets_kv_for_two_models_and_a_fleet_moving_drops_the_old(
        settings, engine, embedder, tiny_encoder, tiny_models, tmp_path):
    """A worker of a second model enrols every live fact and encodes it for its model too: each
    model's server reads its own KV of the same facts, and the first model's stays. With
    ``encode_migrate`` the second model's workers then drop the first model's KV (rows and
    blobs) of every fact that has theirs."""
    from inferscale.db.reads import live_facts

    user = f"move-{uuid.uuid4().hex[:6]}"
    turns = sample_turns(user)[:5]
    durable = LocalDir(tmp_path / "kv")
    old = KVStore(durable, model_fingerprint(tiny_models["llama"]), host_bytes=1 << 30)
    await ingest_and_encode(settings, engine, embedder, turns)
    await EncodeWorker(settings, engine, tiny_encoder, old).run(drain=True)
    before = await _user_facts(engine, user, old.fingerprint)
    assert all(r.kv_location and r.model_fingerprint == old.fingerprint for r in before)
    new_encoder = FactEncoder(tiny_models["qwen2"], device="cpu", dtype=torch.float32)
    new = KVStore(durable, model_fingerprint(tiny_models["qwen2"]), host_bytes=1 << 30)
    both = await EncodeWorker(settings, engine, new_encoder, new).run(drain=True)
    assert both.encoded == len(before) and both.failed == 0
    assert (await MaintenanceWorker(settings, engine, new).run(drain=True)).migrated == 0
    ids = [r.id for r in before]
    async with engine.connect() as conn:
        served = {model: (await live_facts(conn, user, model, ids))[1]
                  for model in (old.fingerprint, new.fingerprint)}
    assert {i: served[old.fingerprint][i]["kv_checksum"] for i in ids} == {
        r.id: r.kv_checksum for r in before}  # the first model's KV stays
    for model, encoder in ((old.fingerprint, tiny_encoder), (new.fingerprint, new_encoder)):
        fresh = KVStore(durable, model, host_bytes=0)
        for i in ids:
            row = served[model][i]
            assert row["kv_location"].startswith(model[:16])
            blob = fresh.get(row["kv_location"], row["kv_checksum"])  # checksum + fingerprint
            assert blob.token_ids == row["token_ids"] == encoder.layout.fact_segment(
                row["text"])
    moving = settings.model_copy(update={"encode_migrate": True})
    assert (await EncodeWorker(moving, engine, new_encoder, new).run(drain=True)).encoded == 0
    assert (await MaintenanceWorker(moving, engine, new).run(drain=True)).migrated == len(before)
    after = await _user_facts(engine, user)  # every model's rows
    assert [r.id for r in after] == ids and {r.model_fingerprint for r in after} == {
        new.fingerprint}
    assert all(r.kv_checksum == served[new.fingerprint][r.id]["kv_checksum"] for r in after)
    # The old model's blobs (and lead blobs) are gone; nothing is left to migrate.
    assert not any(durable.exists(r.kv_location) for r in before)
    assert not [p for p in (tmp_path / "kv" / old.fingerprint[:16]).rglob("*.safetensors")
                if p.name.split(".")[0] in {str(i) for i in ids}]
    assert (await EncodeWorker(moving, engine, new_encoder, new).run(drain=True)).encoded == 0
    assert (await MaintenanceWorker(moving, engine, new).run(drain=True)).migrated == 0
