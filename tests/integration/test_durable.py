"""The durable KV tier's contract, over both backends: a directory and an S3 bucket (moto_server
speaking the real S3 protocol); the kv_url setting that picks one."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvrows import set_kv
from pydantic import ValidationError
from sqlalchemy import insert

from conftest import BUCKET
from inferscale.contracts import blob as blob_format
from inferscale.contracts.blob_name import PREAMBLE, BlobName, fact_blob
from inferscale.core import failpoints
from inferscale.core.procs import process_cpus
from inferscale.core.settings import S3Url, Settings, settings_env
from inferscale.db.tables import facts
from inferscale.kv import durable as durable_module
from inferscale.kv.durable import Durable, LocalDir, S3Objects, open_durable, valid_location
from inferscale.kv.store import (
    BlobMissing,
    ChecksumMismatch,
    FingerprintMismatch,
    KVStore,
)
from inferscale.serving.forget import forget_user
from inferscale.workers.maintenance import sweep_orphan_blobs

FP_A, FP_B = "a" * 64, "b" * 64
HOSTILE_LOCATIONS = ["../x", "../../etc/passwd", "/etc/passwd", "a/../../x", "a//b", "a/./b",
                     ".hidden/x", "a/b/", "", "a\\..\\b", "a/b\0c", "a/b/.c.safetensors.1.2.tmp"]


@pytest.fixture(params=["local", "s3"])
def kv_settings(request, tmp_path) -> Settings:
    """Settings naming a fresh durable tier: a directory, or a fresh prefix in the bucket."""
    if request.param == "local":
        return Settings(data_dir=tmp_path, kv_url=str(tmp_path / "kv"))
    request.getfixturevalue("s3_endpoint")
    return Settings(data_dir=tmp_path, kv_url=f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/kv")


@pytest.fixture
def store(kv_settings) -> KVStore:
    return KVStore.from_settings(kv_settings, FP_A, host_bytes=1 << 20)


def _kv(tokens=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (3, tokens, 2, 16)
    return (torch.randn(shape, generator=g).to(torch.bfloat16),
            torch.randn(shape, generator=g).to(torch.bfloat16))


def _everything(durable: Durable) -> list[str]:
    """Every file or object around the tier (temp and hidden ones too), relative to the
    directory's parent or the prefix's parent: what a write that escaped would show up in."""
    if isinstance(durable, LocalDir):
        return sorted(p.relative_to(durable.root.parent).as_posix()
                      for p in durable.root.parent.rglob("*") if p.is_file())
    import boto3

    parent = durable.prefix.rstrip("/").rpartition("/")[0] + "/"
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                          Prefix=parent)
    return sorted(item["Key"][len(parent):] for page in pages for item in page.get("Contents", []))


def test_round_trip_through_the_tiers(store):
    k, v = _kv()
    assert not store.exists(fact_blob(42))
    stored = store.put(fact_blob(42), k, v, [1, 2, 3, 4, 5], window=5)
    assert stored.location == f"{FP_A[:16]}/{stored.location.split('/')[1]}/42.safetensors"
    assert store.exists(fact_blob(42)) and not store.exists(fact_blob(43))
    assert list(store.durable.list()) == [stored.location]
    assert _everything(store.durable) == [f"kv/{stored.location}"]  # no temp file left
    fresh = KVStore(store.durable, FP_A, host_bytes=1 << 20)
    blob = fresh.get(stored.location, stored.checksum)
    assert torch.equal(blob.k, k) and torch.equal(blob.v, v) and blob.k.dtype == torch.bfloat16
    assert blob.token_ids == [1, 2, 3, 4, 5] and blob.window == 5
    assert fresh.get(stored.location) is blob  # served from the host tier
    assert torch.equal(fresh.load(fact_blob(42), stored.checksum).v, v)


def _counting_hashes(monkeypatch) -> list[int]:
    """How many times blob contents get hashed from now on (one list item per hash)."""
    hashes, hash_ = [], blob_format._digest  # what every blob checksum runs through

    def counting(*args, **kwargs):
        hashes.append(1)
        return hash_(*args, **kwargs)

    monkeypatch.setattr(blob_format, "_digest", counting)
    return hashes


def _settle() -> None:
    """Let the last change of a file get older than RACY_S (shortened by the caller)."""
    time.sleep(durable_module.RACY_S * 2)


def _short_racy_s(folder: Path) -> float:
    """A RACY_S of 50 ms for tests, where file times here are finer than that (a file system
    with whole-second times needs the default 2 s): skips the test otherwise."""
    probe = folder / "probe"
    for _ in range(3):
        probe.write_bytes(b"x")
        if probe.stat().st_ctime_ns % 1_000_000_000:
            return 0.05
    pytest.skip("file times in whole seconds here")


def test_a_settled_blob_is_hashed_once_per_version_of_its_file(store, monkeypatch, tmp_path):
    """Re-reading a file version already verified hashes nothing (local files; a bucket's
    objects are hashed at every read); any change to the file is hashed again and caught."""
    monkeypatch.setattr(durable_module, "RACY_S", _short_racy_s(tmp_path))
    hashes = _counting_hashes(monkeypatch)
    stored = store.put(fact_blob(8), *_kv(seed=1), [1, 2, 3, 4, 5], window=0)
    _settle()
    reader = KVStore(store.durable, FP_A, host_bytes=0)  # no host tier: every get pages in
    hashes.clear()  # the write's own
    first = [reader.get(stored.location, stored.checksum) for _ in range(3)]
    local = isinstance(store.durable, LocalDir)
    assert len(hashes) == (1 if local else 3)
    assert all(torch.equal(blob.k, first[0].k) for blob in first)
    if local:  # changed in place, same size and inode: caught at once and once settled
        with (store.durable.root / stored.location).open("r+b") as f:
            f.seek(-3, os.SEEK_END)
            last = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        with pytest.raises(ChecksumMismatch):
            reader.get(stored.location)
        _settle()
        with pytest.raises(ChecksumMismatch):
            reader.get(stored.location)
    k, v = _kv(seed=2)
    again = store.put(fact_blob(8), k, v, [1, 2, 3, 4, 5], window=0)  # replaced: a new version
    _settle()
    hashes.clear()
    assert torch.equal(reader.get(again.location, again.checksum).k, k)
    assert torch.equal(reader.get(again.location, again.checksum).v, v)
    assert len(hashes) == (1 if local else 2)


@settings(max_examples=20, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["none", "rewrite", "flip", "truncate"]),
                                st.booleans()), min_size=1, max_size=4))
def test_a_read_never_serves_what_the_file_no_longer_holds(tmp_path_factory, steps):
    """Whatever happens to a blob's file between reads (rewritten, damaged in place, cut short,
    settled or not), a read gives the file's current content or refuses it."""
    folder = tmp_path_factory.mktemp("kv")
    durable_module.RACY_S, racy = _short_racy_s(folder), durable_module.RACY_S
    try:
        store = KVStore(LocalDir(folder), FP_A, host_bytes=0)
        seed = 0
        stored = store.put(fact_blob(5), *_kv(seed=seed), [1, 2, 3, 4, 5], window=0)
        path = store.durable.root / stored.location
        for step, settle in [("none", True), *steps]:  # each step: a change, a wait, a read
            if step == "rewrite":
                seed += 1
                store.put(fact_blob(5), *_kv(seed=seed), [1, 2, 3, 4, 5], window=0)
            elif step == "flip":
                with path.open("r+b") as f:
                    f.seek(-3, os.SEEK_END)
                    last = f.read(1)
                    f.seek(-3, os.SEEK_END)
                    f.write(bytes([last[0] ^ 0xFF]))
            elif step == "truncate":
                os.truncate(path, path.stat().st_size - 1)
            if settle:
                _settle()
            try:  # the oracle: the file's bytes verified afresh, no store involved
                now, checksum = blob_format.decode_blob(path.read_bytes())
            except ValueError:
                checksum = None
            if checksum is not None:
                assert torch.equal(store.get(stored.location).k, now.k)
            else:
                with pytest.raises(ChecksumMismatch):
                    store.get(stored.location)
    finally:
        durable_module.RACY_S = racy


def test_a_file_changed_within_racy_s_is_hashed_at_every_read(tmp_path, monkeypatch):
    hashes = _counting_hashes(monkeypatch)
    store = KVStore(LocalDir(tmp_path), FP_A, host_bytes=0)
    stored = store.put(fact_blob(9), *_kv(), [1, 2, 3, 4, 5], window=0)
    hashes.clear()  # the write's own
    for _ in range(3):
        store.get(stored.location, stored.checksum)
    assert len(hashes) == 3
    assert store.durable.read_versioned(stored.location)[1] is None
    monkeypatch.setattr(durable_module, "RACY_S", 0.0)
    versions = {store.durable.read_versioned(stored.location)[1] for _ in range(2)}
    assert len(versions) == 1 and None not in versions


def test_damaged_foreign_and_missing_blobs_are_refused(store):
    stored = store.put(fact_blob(7), *_kv(), [1, 2, 3, 4, 5], window=0)
    raw = bytearray(store.durable.read(stored.location))
    raw[-3] ^= 0xFF
    store.durable.write(stored.location, bytes(raw))
    with pytest.raises(ChecksumMismatch):
        KVStore(store.durable, FP_A, host_bytes=0).get(stored.location)
    store.durable.write(stored.location, b"garbage")
    with pytest.raises(ChecksumMismatch):
        KVStore(store.durable, FP_A, host_bytes=0).get(stored.location)
    other = store.put(fact_blob(8), *_kv(), [1] * 5, window=0)
    with pytest.raises(ChecksumMismatch):  # intact, but not the blob the caller recorded
        KVStore(store.durable, FP_A, host_bytes=0).get(other.location, "0" * 64)
    with pytest.raises(FingerprintMismatch):
        KVStore(store.durable, FP_B, host_bytes=0).get(other.location)
    with pytest.raises(BlobMissing):
        store.get("nope/xx/1.safetensors")
    with pytest.raises(BlobMissing):
        store.load(fact_blob(404))


def test_delete_removes_every_tier_and_counts_what_was_there(store):
    kept = store.put(fact_blob(1), *_kv(), [1] * 5, window=0)
    gone = store.put(fact_blob(2), *_kv(seed=1), [1] * 5, window=0)
    store.get(gone.location)
    assert gone.location in store.host
    assert store.delete([gone.location, gone.location, "absent/xx/3.safetensors"]) == 1
    assert gone.location not in store.host and not store.exists(fact_blob(2))
    assert list(store.durable.list()) == [kept.location]
    assert not store.durable.delete(gone.location)


def test_deletes_go_in_batches_and_count_each_blob_once(store, monkeypatch):
    monkeypatch.setattr("inferscale.kv.durable.S3_DELETE_BATCH", 2)  # S3: 3 DeleteObjects requests
    blobs = [store.put(fact_blob(n), *_kv(seed=n), [1] * 5, window=0).location for n in range(5)]
    kept = store.put(fact_blob(9), *_kv(), [1] * 5, window=0).location
    asked = [*blobs, blobs[0], "absent/xx/7.safetensors", *HOSTILE_LOCATIONS]
    assert store.delete(asked) == 5
    assert list(store.durable.list()) == [kept]


def test_a_missing_bucket_fails_at_open(s3_endpoint, tmp_path):
    with pytest.raises(OSError, match="no such bucket") as raised:
        open_durable(Settings(data_dir=tmp_path, kv_url="s3://no-such-bucket/kv"))
    assert raised.value.errno == errno.ENOENT


async def test_liveness_of_more_ids_than_a_query_takes_parameters(engine):
    from inferscale.db.deletion import blobs_owned

    async with engine.connect() as conn:
        assert await blobs_owned(conn, range(10**15, 10**15 + 40_000)) == set()


def test_listing_every_model_and_fact(store):
    other_model = KVStore(store.durable, FP_B, host_bytes=0)
    a1 = store.put(fact_blob(1), *_kv(), [1] * 5, window=0).location
    a2 = store.put(fact_blob(2), *_kv(), [1] * 5, window=0).location
    store.put(PREAMBLE, *_kv(), [1] * 5, window=0)
    b1 = other_model.put(fact_blob(1), *_kv(), [1] * 5, window=0).location
    assert sorted(store.durable.folders()) == [FP_A[:16], FP_B[:16]]
    assert sorted(store.locations_of([fact_blob(1)])) == sorted([a1, b1])
    assert sorted(store.fact_blobs()) == sorted([(1, a1), (1, b1), (2, a2)])
    assert sorted(store.durable.list(f"{FP_B[:16]}/")) == [b1]


@pytest.mark.parametrize("point", ["kv.mid_write", "kv.before_rename"])
def test_a_failed_write_leaves_nothing_visible(store, point):
    failpoints.arm(f"{point}=error:ENOSPC")
    try:
        with pytest.raises(OSError) as failure:
            store.put(fact_blob(5), *_kv(), [1] * 5, window=0)
    finally:
        failpoints.arm("")
    assert failure.value.errno == errno.ENOSPC
    assert not store.exists(fact_blob(5)) and _everything(store.durable) == []
    assert store.sweep_temp() == 0
    store.put(fact_blob(5), *_kv(), [1] * 5, window=0)
    assert store.exists(fact_blob(5))


def test_sweep_removes_temp_files_of_dead_writers_only(tmp_path):
    durable = LocalDir(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    shard = tmp_path / "fp" / "00"
    shard.mkdir(parents=True)
    (shard / f".1.safetensors.{dead.pid}.7.tmp").write_bytes(b"half")
    (shard / f".2.safetensors.{os.getpid()}.7.tmp").write_bytes(b"ours, in flight")
    assert durable.sweep_temp() == 1
    assert [p.name for p in shard.iterdir()] == [f".2.safetensors.{os.getpid()}.7.tmp"]
    assert list(durable.list()) == []  # temp files are never blobs


def test_local_blobs_are_for_this_account_only(tmp_path):
    """A blob is an owner's memory: 0600 on the local tier, whatever the umask lets through."""
    durable = LocalDir(tmp_path)
    previous = os.umask(0)
    try:
        durable.write("fp/00/1.safetensors", b"kv")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "fp" / "00" / "1.safetensors").stat().st_mode) == 0o600


def test_get_many_pages_misses_in_concurrently_in_order(store, monkeypatch):
    stored = [store.put(fact_blob(i), *_kv(seed=i), [i] * 5, window=0) for i in range(4)]
    locations = [s.location for s in stored]
    checksums = [s.checksum for s in stored]
    expected = [KVStore(store.durable, FP_A, host_bytes=0).get(loc) for loc in locations]
    monkeypatch.setattr(store.durable, "read_threads", 3)
    # as if the storage could not read blobs in batches: every one is read on the threads
    monkeypatch.setattr(store.durable, "read_many",
                        lambda locations, alloc=None, pool=None: (None for _ in locations))
    fresh = KVStore(store.durable, FP_A, host_bytes=1 << 20)
    warm = fresh.get(locations[1])
    barrier = threading.Barrier(3, timeout=10)  # the 3 misses: read one by one, it would break
    readers, read = set(), fresh.durable.read_versioned

    def concurrent_read(location: str, alloc=None):
        readers.add(threading.get_ident())
        barrier.wait()
        return read(location, alloc)

    monkeypatch.setattr(fresh.durable, "read_versioned", concurrent_read)
    blobs = fresh.get_many(locations + [locations[0]], checksums + [checksums[0]])
    assert len(readers) == 3 and threading.get_ident() not in readers
    assert blobs[1] is warm and blobs[4] is blobs[0]
    for blob, want in zip(blobs, expected + expected[:1], strict=True):
        assert torch.equal(blob.k, want.k) and blob.token_ids == want.token_ids
    monkeypatch.setattr(fresh.durable, "read_versioned", read)
    assert fresh.get_many([], []) == []
    with pytest.raises(BlobMissing):
        fresh.get_many([locations[0], "fp/xx/9.safetensors"], [None, None])
    with pytest.raises(ChecksumMismatch):  # the first failing blob's error, as get raises it
        KVStore(store.durable, FP_A, host_bytes=0).get_many(
            [locations[2], "fp/xx/9.safetensors", locations[3]], ["0" * 64, None, None])
    with pytest.raises(ValueError):
        fresh.get_many(locations, checksums[:1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_page_ins_run_on_every_cpu_of_the_process_when_the_caller_is_pinned(tmp_path,
                                                                             monkeypatch):
    """vLLM's CPU worker runs pinned to one CPU (libgomp's binding): its page-ins from the
    storage (here: each on the threads) may not be."""
    store = KVStore(LocalDir(tmp_path), FP_A, host_bytes=0)
    monkeypatch.setattr(store.durable, "read_many",
                        lambda locations, alloc=None, pool=None: (None for _ in locations))
    stored = store.put(fact_blob(1), *_kv(), [1] * 5, window=0)
    assert store.durable.read_threads == len(process_cpus())
    seen: list[set[int]] = []
    read = store.durable.read_versioned

    def recording_read(location: str, alloc=None):
        seen.append(os.sched_getaffinity(0))
        return read(location, alloc)

    monkeypatch.setattr(store.durable, "read_versioned", recording_read)
    everywhere = os.sched_getaffinity(0)

    def pinned_caller() -> None:
        os.sched_setaffinity(0, {min(everywhere)})
        pinned = KVStore(store.durable, FP_A, host_bytes=0)
        pinned.get_many([stored.location], [stored.checksum])

    caller = threading.Thread(target=pinned_caller)
    caller.start()
    caller.join()
    assert seen == [everywhere]


def test_hostile_locations_name_no_blob_and_reach_nothing_outside(store):
    store.put(fact_blob(1), *_kv(), [1] * 5, window=0)
    before = _everything(store.durable)
    for location in HOSTILE_LOCATIONS:
        with pytest.raises(BlobMissing):
            store.get(location)
        assert not store.durable.exists(location)
        assert not store.durable.delete(location)
        with pytest.raises(ValueError):
            store.durable.write(location, b"x")
    for name in ["../x", "../../../x", "", ".hidden", "x\\y"]:
        assert BlobName.parse(name) is None  # no blob name reaches a path outside its folder
    assert store.delete(HOSTILE_LOCATIONS) == 0
    assert _everything(store.durable) == before


@given(st.text(st.sampled_from("ab./\\\0~"), max_size=12))
def test_a_valid_location_stays_inside_the_directory(location):
    root = "/srv/kv"
    if valid_location(location):
        resolved = os.path.normpath(f"{root}/{location}")  # lexically: no symlinks consulted
        assert resolved.startswith(f"{root}/")


def test_s3_prefixes_do_not_overlap_and_storage_failures_are_os_errors(s3_endpoint):
    top = uuid.uuid4().hex[:8]
    short, long = S3Objects(BUCKET, f"{top}/a"), S3Objects(BUCKET, f"/{top}/ab/")
    long.write("m/00/1.safetensors", b"x")
    assert list(short.list()) == [] and list(short.folders()) == []
    assert not short.exists("m/00/1.safetensors")
    assert list(long.list()) == ["m/00/1.safetensors"] and list(long.folders()) == ["m"]
    import boto3

    gone = f"gone-{top}"  # a bucket removed after the tier was opened
    boto3.client("s3").create_bucket(Bucket=gone)
    nowhere = S3Objects(gone, "kv")
    boto3.client("s3").delete_bucket(Bucket=gone)
    for action in (lambda: nowhere.read("m/00/1.safetensors"),
                   lambda: nowhere.write("m/00/1.safetensors", b"x"),
                   lambda: list(nowhere.folders())):
        with pytest.raises(OSError) as failure:
            action()
        assert failure.value.errno == errno.EIO and "NoSuchBucket" in str(failure.value)
    assert nowhere.sweep_temp() == 0


async def test_forget_and_orphan_sweep_on_the_backend(kv_settings, engine):
    user = f"durable-{uuid.uuid4().hex[:8]}"
    rows = [{"user_id": user, "conversation_id": user, "turn_ids": ["t"], "ordinal": n,
             "extractor": "turn", "text": "x", "ts": datetime.now(UTC), "embedding": [0.0] * 384}
            for n in range(2)]
    async with engine.begin() as conn:
        ids = (await conn.execute(insert(facts).returning(facts.c.id), rows)).scalars().all()
    model_a = KVStore.from_settings(kv_settings, FP_A, host_bytes=1 << 20)
    model_b = KVStore.from_settings(kv_settings, FP_B, host_bytes=0)
    recorded = [model_a.put(fact_blob(fact_id), *_kv(), [1] * 5, window=0) for fact_id in ids]
    unrecorded = model_b.put(fact_blob(ids[0]), *_kv(), [1] * 5, window=0)  # another model's blob
    model_a.get(recorded[0].location)
    orphan = model_a.put(fact_blob(10**15 + ids[0]), *_kv(), [1] * 5, window=0)
    model_a.put(PREAMBLE, *_kv(), [1] * 5, window=0)
    async with engine.begin() as conn:
        await set_kv(conn, FP_A, [ids[0]], kv_location=recorded[0].location)
    cli_store = KVStore.from_settings(kv_settings, fingerprint="", host_bytes=0)  # as cli does
    forgotten = await forget_user(engine, cli_store, user)
    assert forgotten.facts == 2 and forgotten.blobs == 3
    assert set(forgotten.locations) >= {r.location for r in recorded} | {unrecorded.location}
    assert model_a.evict(forgotten.locations) == 1  # what a server's invalidation does
    assert await sweep_orphan_blobs(engine, cli_store) == 1
    assert not model_a.durable.exists(orphan.location)
    assert list(model_a.durable.list()) == [model_a.location_for(PREAMBLE)]


def test_kv_url_picks_the_backend(tmp_path, s3_endpoint, monkeypatch):
    assert Settings(data_dir=tmp_path).kv_bucket is None
    assert open_durable(Settings(data_dir=tmp_path)).root == tmp_path / "kv"
    assert open_durable(Settings(data_dir=tmp_path, kv_dir=tmp_path / "d")).root == tmp_path / "d"
    for url, root in [(str(tmp_path / "u"), tmp_path / "u"), ("rel/kv", Path("rel/kv")),
                      (f"file://{tmp_path}/u%20v", tmp_path / "u v"),
                      (f"file://localhost{tmp_path}/w", tmp_path / "w"), ("", tmp_path / "kv")]:
        durable = open_durable(Settings(data_dir=tmp_path, kv_url=url))
        assert isinstance(durable, LocalDir) and durable.root == root, url
    for url, target in [("s3://my.bucket-1", S3Url("my.bucket-1", "")),
                        ("s3://abc/", S3Url("abc", "")),
                        ("s3://abc/team/kv/", S3Url("abc", "team/kv"))]:
        assert Settings(kv_url=url).kv_bucket == target
    s3 = open_durable(Settings(kv_url=f"s3://{BUCKET}/team/kv"))
    assert isinstance(s3, S3Objects) and (s3.bucket, s3.prefix) == (BUCKET, "team/kv/")
    # The setting travels to child processes.
    child = settings_env(Settings(kv_url="s3://abc/team/kv"))
    assert child["INFERSCALE_KV_URL"] == "s3://abc/team/kv"
    for name, value in child.items():
        if name.startswith("INFERSCALE_"):
            monkeypatch.setenv(name, value)
    assert Settings().kv_bucket == S3Url("abc", "team/kv")


@pytest.mark.parametrize("url", [
    "s3://", "s3:///prefix", "s3:bucket", "s3://ab", "s3://Bucket", "s3://bucket_x", "s3://-abc",
    f"s3://{'a' * 64}", "s3://user:pw@bucket/x", "s3://bucket:9000/x", "s3://bucket/a/../b",
    "s3://bucket/a//b", "s3://bucket/./b", "s3://bucket/a\\b", "s3://bucket/x?versionId=1",
    "s3://bucket/x#f", "s3://[::1", "ftp://x", "http://host/kv", "https://bucket.s3.aws/kv",
    "gs://bucket/kv", "file://host/kv", "file:relative", "kv:backup", "S3X://bucket",
])
def test_kv_url_refuses_what_it_cannot_mean(url, monkeypatch):
    with pytest.raises(ValidationError, match="kv_url"):
        Settings(kv_url=url)
    monkeypatch.setenv("INFERSCALE_KV_URL", url)
    with pytest.raises(ValidationError, match="kv_url"):
        Settings()


def test_listing_a_folder_outside_the_tier_lists_nothing(store):
    store.put(fact_blob(1), *_kv(), [1] * 5, window=0)
    for prefix in ("../", "/", "a/../../", ".hidden/", "no-slash", "a\\b/"):
        assert list(store.durable.list(prefix)) == []
    assert len(list(store.durable.list())) == 1
