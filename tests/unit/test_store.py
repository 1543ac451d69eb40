"""Tiered KV store: round trip, corruption, fingerprint, LRU budget, delete."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile import open_under, tried
from inferscale.contracts.blob import KVBlob
from inferscale.contracts.blob_name import fact_blob, lead_blob
from inferscale.kv.durable import READ_BATCH, LocalDir
from inferscale.kv.store import (
    BlobMissing,
    ByteLRU,
    ChecksumMismatch,
    FingerprintMismatch,
    KVBlobError,
    KVStore,
)


def _kv(tokens=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (3, tokens, 2, 16)
    return (torch.randn(shape, generator=g).to(torch.bfloat16),
            torch.randn(shape, generator=g).to(torch.bfloat16))


def test_round_trip_and_tiers(tmp_path):
    store = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20)
    k, v = _kv()
    assert not store.exists(fact_blob(42))
    stored = store.put(fact_blob(42), k, v, [1, 2, 3, 4, 5], window=5)
    assert store.exists(fact_blob(42)) and not store.exists(fact_blob(43))
    assert torch.equal(store.load(fact_blob(42), stored.checksum).v, v)  # by name, via the tiers
    assert (tmp_path / stored.location).exists() and stored.nbytes > k.nbytes + v.nbytes
    assert not list(tmp_path.rglob("*.tmp"))
    fresh = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20)
    blob = fresh.get(stored.location, stored.checksum)
    assert torch.equal(blob.k, k) and torch.equal(blob.v, v) and blob.k.dtype == torch.bfloat16
    assert blob.token_ids == [1, 2, 3, 4, 5] and blob.window == 5
    assert stored.location in fresh.host
    assert fresh.get(stored.location) is blob  # served from the host tier


def test_corrupted_blob_raises_checksum_error(tmp_path):
    store = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20)
    stored = store.put(fact_blob(7), *_kv(), [1, 2, 3, 4, 5], window=0)
    path = tmp_path / stored.location
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatch):
        KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20).get(stored.location)
    path.write_bytes(b"garbage")
    with pytest.raises(ChecksumMismatch):
        KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20).get(stored.location)
    with pytest.raises(BlobMissing):
        store.get("nope/xx/1.safetensors")


def test_fingerprint_mismatch_is_refused(tmp_path):
    made_for_a = KVStore(LocalDir(tmp_path), "a" * 64, host_bytes=1 << 20)
    stored = made_for_a.put(fact_blob(1), *_kv(), [1] * 5, window=0)
    with pytest.raises(FingerprintMismatch):
        KVStore(LocalDir(tmp_path), "b" * 64, host_bytes=1 << 20).get(stored.location)


def test_lru_keeps_within_byte_budget():
    k, v = _kv(tokens=4)
    blob = KVBlob(k=k, v=v, token_ids=[1] * 4, fingerprint="x", window=0)
    lru = ByteLRU(budget_bytes=3 * blob.nbytes, tier="host")
    for i in range(10):
        lru.put(str(i), blob)
        assert lru.used <= lru.budget
        if i == 8:
            assert lru.get("6") is blob  # refresh 6: 7 becomes the least recently used
    assert len(lru) == 3 and {"6", "8", "9"} == {k for k in map(str, range(10)) if k in lru}


def test_delete_removes_every_tier(tmp_path):
    store = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20)
    stored = store.put(fact_blob(9), *_kv(), [1] * 5, window=0)
    store.get(stored.location)
    assert store.delete([stored.location]) == 1
    assert stored.location not in store.host and not (tmp_path / stored.location).exists()


def test_a_batch_of_page_ins_reads_what_a_single_get_reads(tmp_path):
    """Whatever the locations name (nothing, a folder), a batch reports the missing blob as a
    single ``get`` would."""
    durable = LocalDir(tmp_path)
    writer = KVStore(durable, "f" * 64, host_bytes=0)
    stored = [writer.put(fact_blob(i), *_kv(seed=i), [i] * 5, window=0) for i in range(4)]
    (tmp_path / "ffffffffffffffff" / "folder.safetensors").mkdir()
    reader = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20)
    locations = [s.location for s in stored]
    blobs = reader.get_many(locations + locations[:1], [s.checksum for s in stored] + [None])
    for blob, i in zip(blobs, [0, 1, 2, 3, 0], strict=True):
        assert torch.equal(blob.k, _kv(seed=i)[0]) and blob.token_ids == [i] * 5
    with pytest.raises(BlobMissing):
        KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=0).get_many(
            [locations[0], "ffffffffffffffff/folder.safetensors",
             "ffffffffffffffff/00/gone.safetensors"], [None] * 3)


class _SlowOdd(LocalDir):
    """A directory whose odd-numbered blobs are not read in batches (they take the threads'
    reads, as a blob that changed while it was read would), counting the reads of each kind."""

    def __init__(self, root):
        super().__init__(root)
        self.batched, self.slow = [], []

    def read_many(self, locations, alloc=None, pool=None):
        for location, read in zip(locations, super().read_many(locations, alloc, pool),
                                  strict=True):
            if int(location.rsplit("/", 1)[1].split(".")[0]) % 2:
                read = None
            if read is not None:
                self.batched.append(location)
            yield read

    def read_versioned(self, location, alloc=None):
        self.slow.append(location)
        return super().read_versioned(location, alloc)


def test_page_ins_read_in_batches_are_checked_as_any_other(tmp_path):
    """Blobs are read in batches (on the caller's thread and the threads) and checked on the
    caller's thread, or read and checked on the threads: both give what ``get`` gives, and both
    refuse a damaged or unexpected blob."""
    writer = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=0)
    n = 2 * READ_BATCH + 3
    stored = [writer.put(fact_blob(i), *_kv(seed=i), [i] * 5, window=0) for i in range(n)]
    big = writer.put(fact_blob(n), *_kv(tokens=4200, seed=n), [n] * 4200, window=0)
    durable = LocalDir(tmp_path)
    hostile = ["ffffffffffffffff/00/gone.safetensors", "ffffffffffffffff/folder.safetensors",
               "..", "a/../../etc/passwd", "", "\0", "/abs"]
    (tmp_path / "ffffffffffffffff" / "folder.safetensors").mkdir()
    read = list(durable.read_many([s.location for s in stored[:3]] + hostile))
    assert read[3:] == [None] * len(hostile)
    for s, (buffer, version) in zip(stored, read[:3], strict=False):
        raw, raw_version = durable.read_versioned(s.location)
        assert bytes(buffer) == bytes(raw) and version == raw_version
    split = _SlowOdd(tmp_path)
    reader = KVStore(split, "f" * 64, host_bytes=1 << 20)
    locations = [s.location for s in stored]
    blobs = reader.get_many(locations + [big.location], [s.checksum for s in [*stored, big]])
    assert not open_under(tmp_path)  # every file read is closed
    for blob, i in zip(blobs[:-1], range(n), strict=True):
        assert torch.equal(blob.k, _kv(seed=i)[0]) and torch.equal(blob.v, _kv(seed=i)[1])
    assert torch.equal(blobs[-1].k, _kv(tokens=4200, seed=n)[0]) and blobs[-1].tokens == 4200
    locations.append(big.location)
    assert set(locations[1::2]) <= set(split.slow)  # each blob read once, one way or the other
    assert sorted(split.batched + split.slow) == sorted(locations)
    rewritten = writer.put(fact_blob(2), *_kv(seed=9), [9] * 5, window=0)
    with pytest.raises(ChecksumMismatch):  # a batched read of a blob not the one expected
        KVStore(_SlowOdd(tmp_path), "f" * 64, host_bytes=0).get_many(
            [locations[2], locations[1]], [stored[2].checksum, stored[1].checksum])
    path = tmp_path / rewritten.location
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatch):  # damaged in place
        KVStore(_SlowOdd(tmp_path), "f" * 64, host_bytes=0).get_many(
            [locations[1], locations[2]], [None, None])


def test_a_lead_blob_lives_and_dies_with_its_fact(tmp_path):
    store = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20)
    fact = store.put(fact_blob(9), *_kv(), [1] * 5, window=2)
    lead = store.put(lead_blob(9), *_kv(), [1] * 5, window=0)
    other = store.put(fact_blob(19), *_kv(), [1] * 5, window=2)
    assert lead.location.rsplit("/", 1)[0] == fact.location.rsplit("/", 1)[0]
    assert sorted(store.fact_blobs()) == sorted([(9, fact.location), (9, lead.location),
                                                 (19, other.location)])
    store.get(lead.location)
    assert store.memory_tiers([fact.location, other.location]) == [["host"], []]  # by its lead
    assert store.evict([fact.location]) == 1  # the fact counts once, whichever blob was held
    assert store.memory_tiers([fact.location]) == [[]]
    assert lead.location not in store.host
    store.get(lead.location)
    assert store.delete([fact.location, other.location]) == 3
    assert lead.location not in store.host and not list(tmp_path.rglob("*.safetensors"))
    assert store.delete([lead.location]) == 0  # an orphan lead alone: nothing else named


@settings(max_examples=300, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
                      min_size=1, max_size=4), cut=st.none() | st.integers(0, 10**6))
def test_damaged_blobs_are_refused_with_a_blob_error_only(tmp_path, edits, cut):
    """The blob loader under byte edits and truncation: the intact blob or KVBlobError."""
    store = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=0)
    k = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).reshape(2, 3, 2, 4)
    stored = store.put(fact_blob(3), k, -k, [5, 6, 7], window=1)
    path = tmp_path / stored.location
    raw = bytearray(path.read_bytes())
    for offset, patch in edits:
        offset %= len(raw)
        raw[offset:offset + len(patch)] = patch
    path.write_bytes(bytes(raw[:cut % (len(raw) + 1)] if cut is not None else raw))
    tried("KV blob loader")
    try:
        blob = store.get(stored.location, stored.checksum)
    except KVBlobError:
        return
    assert torch.equal(blob.k, k) and torch.equal(blob.v, -k) and blob.token_ids == [5, 6, 7]


def test_a_rewritten_blob_is_served_only_under_the_checksum_expected(tmp_path):
    """A fact encoded again keeps its name: a memory copy of the old version never answers a
    reader that expects the new checksum, and a reader of the old one is refused once the
    durable blob is the new one."""
    server = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20)
    worker = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=0)
    old = worker.put(fact_blob(7), *_kv(seed=1), [1] * 5, window=2)
    assert torch.equal(server.get(old.location, old.checksum).k, _kv(seed=1)[0])  # held now
    new = worker.put(fact_blob(7), *_kv(seed=2), [1] * 5, window=2)
    assert new.location == old.location and new.checksum != old.checksum
    assert torch.equal(server.load_many([fact_blob(7)], [new.checksum])[0].k, _kv(seed=2)[0])
    assert server.host.get(new.location).checksum == new.checksum  # the new copy replaced it
    assert torch.equal(server.get(new.location).k, _kv(seed=2)[0])  # no expectation: any copy
    with pytest.raises(ChecksumMismatch):
        server.get(old.location, old.checksum)


def test_a_store_without_host_tier_reuses_page_in_memory(tmp_path):
    """No host tier: nothing is kept, but a page-in reads into the arena, and the next one
    reuses the block once the last blob is gone (no fresh memory to fault in per request)."""
    store = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=0)
    k, v = _kv(tokens=300)
    stored = store.put(fact_blob(7), k, v, list(range(300)), window=5)
    first = store.get(stored.location, stored.checksum)
    assert len(store.host) == 0 and torch.equal(first.k, k)
    address = first.k.data_ptr()
    del first
    again = store.get(stored.location, stored.checksum)
    assert again.k.data_ptr() == address and torch.equal(again.v, v)
    assert KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=0, arena_bytes=0).arena is None


def test_one_store_serves_blobs_of_every_format_and_keeps_them_coded(tmp_path):
    """Blobs record their format: a store reads raw and coded blobs side by side (a format
    change applies to facts encoded after it), and its host tier holds the coded bytes."""
    from typing import get_args

    from inferscale.contracts.kv_format import FORMATS
    from inferscale.core.settings import KVFormat

    assert set(get_args(KVFormat)) == set(FORMATS)  # the setting names every format
    store = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20)
    k, v = _kv(tokens=8)
    stored = {f: store.put(fact_blob(10 + n), k, v, list(range(8)), window=0, kv_format=f)
              for n, f in enumerate(FORMATS)}
    for n, (kv_format, blob_info) in enumerate(stored.items()):
        blob = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=1 << 20).load(
            fact_blob(10 + n), blob_info.checksum)
        assert blob.shape == tuple(k.shape) and blob.dtype == torch.bfloat16
        got_k, got_v = blob.dequantized()
        tolerance = {"raw": 0.0, "int8": 0.05, "fp8": 0.25, "int4": 0.6, "int2": 2.5}[kv_format]
        assert (got_k.float() - k.float()).abs().max() <= tolerance
        assert (got_v.float() - v.float()).abs().max() <= tolerance
    raw_bytes = store.load(fact_blob(10)).nbytes
    assert store.load(fact_blob(12)).nbytes < raw_bytes / 2  # int4 (and its params), held


@pytest.mark.parametrize(("name", "value"), [
    ("INFERSCALE_KV_FORMAT", "int3"), ("INFERSCALE_KV_FORMAT", "fp4"),
    ("INFERSCALE_KV_FORMAT", ""), ("INFERSCALE_LEAD_KV_FORMAT", "INT4"),
    ("INFERSCALE_KV_BUDGET_BYTES", "-1"), ("INFERSCALE_KV_BUDGET_BYTES", "lots"),
    ("INFERSCALE_KV_USER_BUDGET_BYTES", "1.5"), ("INFERSCALE_KV_BUDGET_HEADROOM", "1"),
    ("INFERSCALE_KV_BUDGET_HEADROOM", "nan"), ("INFERSCALE_KV_EVICT_GRACE_S", "-1"),
    ("INFERSCALE_KV_EVICT_INTERVAL_S", "0"), ("INFERSCALE_KV_EVICT_INTERVAL_S", "inf"),
])
def test_kv_format_and_budget_settings_refuse_bad_values(monkeypatch, name, value):
    from pydantic import ValidationError

    from inferscale.core.settings import Settings

    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=name.removeprefix("INFERSCALE_").lower()):
        Settings()
