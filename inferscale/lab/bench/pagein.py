"""Page-in latency of one request's blobs: host tier vs local directory vs the S3 bucket the
settings name (``INFERSCALE_KV_URL=s3://...``, if any), one at a time vs concurrently, and read
into fresh buffers vs the host arena (new chunks, or blocks that evicted blobs gave back)."""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
from transformers import AutoConfig

from inferscale.kv.durable import Durable, LocalDir, S3Objects
from inferscale.kv.rope import model_head_dim
from inferscale.kv.store import KVStore
from inferscale.lab.bench.common import print_table, write_report
from inferscale.platform.settings import Settings

TOKENS_PER_FACT = 44  # LoCoMo turn facts with SmolLM2's tokenizer, on average
REPEATS = 5
FINGERPRINT = "b" * 64


def _write_blobs(durable: Durable, shape: tuple[int, int, int], dtype: torch.dtype,
                 n: int) -> list[str]:
    store = KVStore(durable, FINGERPRINT, host_bytes=0)
    layers, heads, dim = shape
    g = torch.Generator().manual_seed(0)
    names = [f"bench-{uuid.uuid4().hex[:8]}" for _ in range(n)]
    for name in names:
        k, v = (torch.randn((layers, TOKENS_PER_FACT, heads, dim), generator=g).to(dtype)
                for _ in range(2))
        store.put(name, k, v, list(range(TOKENS_PER_FACT)), window=0)
    return names


def _request_ms(durable: Durable, names: list[str], concurrent: bool, memory: str) -> float:
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
        began = time.perf_counter()
        if concurrent:
            store.load_many(names, [None] * len(names))
        else:
            for name in names:
                store.load(name)
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e3


def run(settings: Settings, model_path: Path, out_dir: Path,
        ks: tuple[int, ...] = (20, 50)) -> dict:
    """Write max(ks) blobs of the serving model's shape (bf16) to each durable tier; time
    page-ins of k of them. Local reads come from the OS page cache (the blobs were just
    written): what is measured is the read path, decode and verification, not the disk."""
    ks = tuple(k for k in ks if k > 0)
    if not ks:
        raise ValueError("pagein needs some k > 0")
    config = AutoConfig.from_pretrained(model_path)
    shape = (config.num_hidden_layers, config.num_key_value_heads, model_head_dim(config))
    dtype = torch.bfloat16  # as vLLM serves on CPU
    with tempfile.TemporaryDirectory() as tmp:
        tiers: list[tuple[str, Durable]] = [("local directory", LocalDir(Path(tmp)))]
        if (bucket := settings.kv_bucket) is not None:
            tiers.append((f"s3://{bucket.bucket}", S3Objects(bucket.bucket, bucket.prefix)))
        results = []
        for tier, durable in tiers:
            names = _write_blobs(durable, shape, dtype, max(ks))
            for k in ks:
                row = {"tier": tier, "k": k,
                       "host_tier_ms": _request_ms(durable, names[:k], True, "warm"),
                       "sequential_ms": _request_ms(durable, names[:k], False, "arena"),
                       "fresh_buffers_ms": _request_ms(durable, names[:k], True, "fresh"),
                       "concurrent_ms": _request_ms(durable, names[:k], True, "arena"),
                       "reused_ms": _request_ms(durable, names[:k], True, "reused")}
                results.append(row)
            cleaner = KVStore(durable, FINGERPRINT, host_bytes=0)
            cleaner.delete([cleaner.location_for(name) for name in names])
    blob_mb = 2 * shape[0] * TOKENS_PER_FACT * shape[1] * shape[2] * dtype.itemsize / 1e6
    print_table(["durable tier", "k", "host tier ms", "one by one ms",
                 "concurrent, fresh buffers ms", "concurrent, arena ms",
                 "concurrent, arena reused ms"],
                [[r["tier"], r["k"], r["host_tier_ms"], r["sequential_ms"], r["fresh_buffers_ms"],
                  r["concurrent_ms"], r["reused_ms"]] for r in results])
    report = {"blob_mb": blob_mb, "tokens_per_fact": TOKENS_PER_FACT, "repeats": REPEATS,
              "results": results}
    write_report(out_dir, "pagein", report)
    return report
