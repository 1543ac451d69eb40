"""The server's "served" bookkeeping: each fact is stamped at most every ``SERVED_STAMP_S``, and
a miss is always written, naming only the facts missed; requests' stamps are written together,
off the request's path."""

import asyncio
import contextlib

from cachetools import TTLCache

import inferscale.db.kv_budget as kv_budget
from inferscale.serving.compose import SERVED_STAMP_S, MemoryRuntime


class _Conn:
    async def execution_options(self, **options):
        return self

    async def commit(self):
        pass


class _Engine:
    @contextlib.asynccontextmanager
    async def connect(self):
        yield _Conn()


async def test_facts_are_stamped_once_a_while_and_misses_name_only_the_facts_missed(
        monkeypatch):
    written = []

    async def note_served(conn, owner, fingerprint, served, missed):
        written.append((owner, fingerprint, served, missed))
        return 0

    monkeypatch.setattr(kv_budget, "note_served", note_served)
    rt = MemoryRuntime.__new__(MemoryRuntime)  # no model: only the bookkeeping
    rt.engine, rt.fingerprint = _Engine(), "f" * 64
    rt._served, rt._unwritten, rt._writing = TTLCache(maxsize=16, ttl=SERVED_STAMP_S), {}, None

    async def serve(served, missed):
        rt.note_served("ana", served, missed)
        await rt.write_served()

    await serve([1, 2, 3], [])
    await serve([3, 2, 1], [])  # stamped within the minute: nothing written
    await serve([2, 4], [2])  # a miss is written; 4 is new
    await serve([1, 4], [])
    assert [(served, missed) for _, _, served, missed in written] == [
        ([1, 2, 3], []), ([2, 4], [2])]
    assert {(owner, fingerprint) for owner, fingerprint, _, _ in written} == {("ana", "f" * 64)}


async def test_requests_of_a_batch_are_written_once_per_owner_after_the_batch_time(monkeypatch):
    written = []

    async def note_served(conn, owner, fingerprint, served, missed):
        written.append((owner, sorted(served), sorted(missed)))
        return 0

    monkeypatch.setattr(kv_budget, "note_served", note_served)
    monkeypatch.setattr("inferscale.serving.compose.STAMP_BATCH_S", 0.05)
    rt = MemoryRuntime.__new__(MemoryRuntime)
    rt.engine, rt.fingerprint = _Engine(), "f" * 64
    rt._served, rt._unwritten, rt._writing = TTLCache(maxsize=16, ttl=SERVED_STAMP_S), {}, None
    rt.note_served("ana", [1, 2], [])
    rt.note_served("bo", [7], [7])
    rt.note_served("ana", [2, 3], [3])
    assert written == []  # not on the request's path
    await asyncio.sleep(0.2)
    assert sorted(written) == [("ana", [1, 2, 3], [3]), ("bo", [7], [7])]
