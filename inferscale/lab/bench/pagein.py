"""Page-in latency of one request's blobs by KV format at rest: host tier vs local directory vs
the S3 bucket the settings name (``INFERSCALE_KV_URL=s3://...``, if any), one at a time vs
concurrently, read into fresh buffers vs the host arena (new chunks, or blocks that evicted
blobs gave back), and cold on a warm server (blobs it never read, hashed to verify them, into
arena blocks given back), from the OS page cache and, for a local directory, from the disk
itself (for a local directory also with every blob read and checked on the threads, the baseline
of reads in batches checked on the caller's thread); and the fused CPU write
of the paged-in blobs into a paged cache (where coded blobs are dequantised), for a
sliding-window model also as it would be with only the blocks inside each local layer's
window."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Generator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from inferscale.contracts.blob_name import BlobName, FactId, fact_blob
from inferscale.contracts.kv_format import FORMATS, RAW
from inferscale.core.settings import Settings
from inferscale.kv import fused
from inferscale.kv.chain import SKIP, LayerSlots
from inferscale.kv.durable import Alloc, Durable, LocalDir, Read, S3Objects
from inferscale.kv.fused import LAYOUTS, FusedCpuWriter
from inferscale.kv.model_family import attention_shape
from inferscale.kv.rope import ChunkedRope, model_head_dim
from inferscale.kv.store import KVStore
from inferscale.lab.bench.common import print_table, write_report

TOKENS_PER_FACT = 44  # LoCoMo turn facts with SmolLM2's tokenizer, on average
REPEATS = 5
FINGERPRINT = "b" * 64


def _write_blobs(durable: Durable, shape: tuple[int, int, int], dtype: torch.dtype,
                 n: int, kv_format: str) -> tuple[list[BlobName], int]:
    """``n`` blobs of random K/V stored in ``kv_format``: their names and mean bytes."""
    store = KVStore(durable, FINGERPRINT, host_bytes=0)
    layers, heads, dim = shape
    g = torch.Generator().manual_seed(0)
    names = [fact_blob(FactId(uuid.uuid4().int >> 65)) for _ in range(n)]  # unused ids
    nbytes = 0
    for name in names:
        k, v = (torch.randn((layers, TOKENS_PER_FACT, heads, dim), generator=g).to(dtype)
                for _ in range(2))
        nbytes += store.put(name, k, v, list(range(TOKENS_PER_FACT)), window=0,
                            kv_format=kv_format).nbytes
    return names, nbytes // n


def _timed_ms(write: Callable[[], None]) -> float:
    samples = []
    for _ in range(REPEATS + 1):  # the first warms the caches up
        began = time.perf_counter()
        write()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples[1:]) * 1e3


def _write_ms(config: PretrainedConfig, store: KVStore, names: list[BlobName]
              ) -> tuple[float | None, float | None]:
    """Median ms of the fused CPU write (rotate, scale, dequantise, store) of these blobs into
    a paged cache of vLLM's "vec" layout, and (models with sliding windows) of the write the
    connector does under vLLM's hybrid KV cache manager: every token in full-attention layers,
    none before the last ``window`` in sliding ones (``chain.LayerSlots``,
    ``docs/results/models.md``). None where the kernel is not built or the model has no
    windows."""
    if not fused.available():
        return None, None
    rope = ChunkedRope(config, torch.bfloat16)
    blobs = store.load_many(names, [None] * len(names))
    layers, _, heads, dim = blobs[0].shape
    tokens = sum(blob.tokens for blob in blobs)
    block = 32
    caches = [torch.zeros(tokens // block + 1, heads, block, 2 * dim, dtype=torch.bfloat16)
              for _ in range(layers)]
    positions = torch.arange(tokens)
    pieces = [blob.piece() for blob in blobs]
    writer = FusedCpuWriter(LAYOUTS["vec"], rope)
    whole = _timed_ms(lambda: writer.write(pieces, positions, positions, None, caches))
    windows = attention_shape(config).windows
    window = max((w for w in windows if w is not None), default=None)
    if window is None:
        return whole, None
    in_window = torch.where(positions < tokens - window, SKIP, positions)
    slots = LayerSlots(torch.stack([positions, in_window]),
                       torch.tensor([int(w is not None) for w in windows]))
    return whole, _timed_ms(lambda: writer.write(pieces, positions, slots, None, caches))


def _page_in_s(store: KVStore, names: list[BlobName], concurrent: bool) -> float:
    """Seconds to page these blobs in: concurrently (as the connector does) or one by one."""
    began = time.perf_counter()
    if concurrent:
        store.load_many(names, [None] * len(names))
    else:
        for name in names:
            store.load(name)
    return time.perf_counter() - began


def _request_ms(durable: Durable, names: list[BlobName], concurrent: bool, memory: str) -> float:
    """Median ms to page one request's blobs in. ``memory``: ``warm`` (host-tier hits),
    ``arena`` (a new store each time: its arena maps new chunks), ``fresh`` (a new store
    without an arena) or ``reused`` (one store whose host tier evicted the blobs: their arena
    blocks, already faulted in, take the next page-ins)."""
    samples = []
    kept = KVStore(durable, FINGERPRINT, host_bytes=1 << 34)
    kept.load_many(names, [None] * len(names))
    locations = [kept.location_for(name) for name in names]
    for _ in range(REPEATS):
        if memory == "reused":
            kept.evict(locations)
        store = kept if memory in ("warm", "reused") else KVStore(
            durable, FINGERPRINT, host_bytes=1 << 34, arena_bytes=0 if memory == "fresh" else None)
        samples.append(_page_in_s(store, names, concurrent))
    return statistics.median(samples) * 1e3


def _drop_from_page_cache(durable: LocalDir, locations: list[str]) -> None:
    """Make the next reads of these (fsynced, so clean) files come from the disk."""
    for location in locations:
        fd = os.open(durable.root / location, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _OnThreads(LocalDir):
    """A local directory whose page-ins are each read and checked on the threads, readahead of
    all of them asked for first: the page-in before reads in batches (the baseline)."""

    def read_many(self, locations: list[str], alloc: Alloc | None = None,
                  pool: Executor | None = None) -> Generator[Read | None, None, None]:
        for location in locations:
            with contextlib.suppress(OSError):
                fd = os.open(self.root / location, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
        yield from [None] * len(locations)


def _cold_ms(durable: Durable, shape: tuple[int, int, int], dtype: torch.dtype, k: int,
             kv_format: str, concurrent: bool, from_disk: bool = False) -> float:
    """Median ms to page in k blobs a running server has never read (hashed to verify them)
    into arena blocks that earlier page-ins faulted in and gave back: a warm server's page-in
    of another user's memory. Each repeat reads blobs of its own, from the OS page cache (they
    were just written) or, ``from_disk`` (a local directory), from the disk."""
    sets = [_write_blobs(durable, shape, dtype, k, kv_format)[0] for _ in range(REPEATS + 1)]
    store = KVStore(durable, FINGERPRINT, host_bytes=1 << 34)
    samples = []
    for names in sets:  # the first set warms the arena and the threads up
        if from_disk and isinstance(durable, LocalDir):
            _drop_from_page_cache(durable, [store.location_for(name) for name in names])
        samples.append(_page_in_s(store, names, concurrent))
        store.evict([store.location_for(name) for name in names])
    store.delete([store.location_for(name) for names in sets for name in names])
    return statistics.median(samples[1:]) * 1e3


def _request_floor_ms(durable: Durable, k: int) -> dict[str, float]:
    """Median ms to read k one-byte objects, one by one and concurrently (on the threads a
    store uses): what a page-in's requests cost with no bytes to move, the floor under every
    format's page-in from this tier; and the CPU this process spent on them (the client's
    share of the floor where the endpoint is another process)."""
    locations = [f"request-floor/{uuid.uuid4().hex[:2]}/{i}" for i in range(k)]
    for location in locations:
        durable.write(location, b"x")
    floor = {}
    with ThreadPoolExecutor(durable.read_threads) as pool:
        for mode, read_all in (("sequential", lambda: [durable.read(at) for at in locations]),
                               ("concurrent", lambda: list(pool.map(durable.read, locations)))):
            samples, cpu = [], []
            for _ in range(REPEATS + 1):  # the first warms connections and threads up
                began, began_cpu = time.perf_counter(), time.process_time()
                read_all()
                samples.append(time.perf_counter() - began)
                cpu.append(time.process_time() - began_cpu)
            floor[f"request_floor_{mode}_ms"] = statistics.median(samples[1:]) * 1e3
            floor[f"request_floor_{mode}_client_cpu_ms"] = statistics.median(cpu[1:]) * 1e3
    durable.delete_many(locations)
    return floor


def run(settings: Settings, model_path: Path, out_dir: Path,
        ks: tuple[int, ...] = (20, 50), formats: tuple[str, ...] = tuple(FORMATS)) -> dict:
    """Write max(ks) blobs of the serving model's shape (bf16) in each format to each durable
    tier; time page-ins of k of them and their fused write. Local reads come from the OS page
    cache (the blobs were just written): what is measured is the read path, decode and
    verification, not the disk, except in the "disk" columns."""
    ks = tuple(k for k in ks if k > 0)
    if not ks:
        raise ValueError("pagein needs some k > 0")
    config = AutoConfig.from_pretrained(model_path)
    shape = (config.num_hidden_layers, config.num_key_value_heads, model_head_dim(config))
    dtype = torch.bfloat16  # as vLLM serves on CPU
    # What was allocated before is left out of garbage collections, as vLLM's engine core
    # does once it has started (a full collection of it took ~80 ms, inside one page-in).
    gc.collect()
    gc.freeze()
    with contextlib.ExitStack() as undo, tempfile.TemporaryDirectory() as tmp:
        undo.callback(gc.unfreeze)
        tiers: list[tuple[str, Durable]] = [("local directory", LocalDir(Path(tmp)))]
        if (bucket := settings.kv_bucket) is not None:
            tiers.append((f"s3://{bucket.bucket}", S3Objects(bucket.bucket, bucket.prefix)))
        results: list[dict[str, Any]] = []
        for tier, durable in tiers:
            floors = {k: _request_floor_ms(durable, k) for k in ks
                      if not isinstance(durable, LocalDir)}
            for kv_format in formats:
                names, blob_bytes = _write_blobs(durable, shape, dtype, max(ks), kv_format)
                for k in ks:
                    results.append({
                        "tier": tier, "format": kv_format, "k": k, "blob_bytes": blob_bytes,
                        "host_tier_ms": _request_ms(durable, names[:k], True, "warm"),
                        "cold_sequential_ms": _cold_ms(durable, shape, dtype, k, kv_format,
                                                       False),
                        "cold_concurrent_ms": _cold_ms(durable, shape, dtype, k, kv_format,
                                                       True),
                        **({"cold_concurrent_on_threads_ms": _cold_ms(
                                _OnThreads(durable.root), shape, dtype, k, kv_format, True)}
                           if isinstance(durable, LocalDir) else {}),
                        **({"disk_sequential_ms": _cold_ms(durable, shape, dtype, k, kv_format,
                                                           False, from_disk=True),
                            "disk_concurrent_ms": _cold_ms(durable, shape, dtype, k, kv_format,
                                                           True, from_disk=True),
                            "disk_concurrent_on_threads_ms": _cold_ms(
                                _OnThreads(durable.root), shape, dtype, k, kv_format, True,
                                from_disk=True)}
                           if isinstance(durable, LocalDir) else {}),
                        "sequential_ms": _request_ms(durable, names[:k], False, "arena"),
                        "fresh_buffers_ms": _request_ms(durable, names[:k], True, "fresh"),
                        "concurrent_ms": _request_ms(durable, names[:k], True, "arena"),
                        "reused_ms": _request_ms(durable, names[:k], True, "reused"),
                        **floors.get(k, {}),
                        **dict(zip(("fused_write_ms", "fused_write_windows_ms"), _write_ms(
                            config, KVStore(durable, FINGERPRINT, host_bytes=1 << 34),
                            names[:k]), strict=True))})
                cleaner = KVStore(durable, FINGERPRINT, host_bytes=0)
                cleaner.delete([cleaner.location_for(name) for name in names])
    for row in results:  # against raw blobs of the same tier and k, in this run
        raw = next((r for r in results if r["format"] == RAW and r["tier"] == row["tier"]
                    and r["k"] == row["k"]), None)
        for mode in ("concurrent", "cold_sequential", "cold_concurrent",
                     "cold_concurrent_on_threads", "disk_sequential", "disk_concurrent",
                     "disk_concurrent_on_threads", "reused"):
            row[f"{mode}_speedup_vs_raw"] = (raw[f"{mode}_ms"] / row[f"{mode}_ms"]
                                             if raw and f"{mode}_ms" in row else None)
    print_table(["durable tier", "format", "k", "blob KB", "host tier ms", "cold, one by one ms",
                 "cold, concurrent ms", "cold, concurrent, all on threads ms",
                 "x raw (cold, one by one)", "x raw (cold, concurrent)",
                 "disk, one by one ms", "disk, concurrent ms", "x raw (disk, one by one)",
                 "x raw (disk, concurrent)", "disk, concurrent, all on threads ms",
                 "one by one ms", "concurrent, fresh buffers ms", "concurrent, arena ms",
                 "concurrent, arena reused ms", "x raw (arena)", "x raw (reused)",
                 "request floor, one by one ms", "request floor, concurrent ms",
                 "client CPU of the floor, one by one ms", "client CPU of the floor, concurrent ms",
                 "fused write ms", "write in windows ms"],
                [[r["tier"], r["format"], r["k"], r["blob_bytes"] / 1e3, r["host_tier_ms"],
                  r["cold_sequential_ms"], r["cold_concurrent_ms"],
                  r.get("cold_concurrent_on_threads_ms"), r["cold_sequential_speedup_vs_raw"],
                  r["cold_concurrent_speedup_vs_raw"],
                  r.get("disk_sequential_ms"), r.get("disk_concurrent_ms"),
                  r["disk_sequential_speedup_vs_raw"], r["disk_concurrent_speedup_vs_raw"],
                  r.get("disk_concurrent_on_threads_ms"),
                  r["sequential_ms"], r["fresh_buffers_ms"], r["concurrent_ms"],
                  r["reused_ms"], r["concurrent_speedup_vs_raw"], r["reused_speedup_vs_raw"],
                  r.get("request_floor_sequential_ms"), r.get("request_floor_concurrent_ms"),
                  r.get("request_floor_sequential_client_cpu_ms"),
                  r.get("request_floor_concurrent_client_cpu_ms"), r["fused_write_ms"],
                  r["fused_write_windows_ms"]]
                 for r in results])
    report = {"tokens_per_fact": TOKENS_PER_FACT, "repeats": REPEATS, "results": results}
    write_report(out_dir, "pagein", report)
    return report
