"""Encode throughput: Context-Window Encoding of LoCoMo facts at several window sizes, and what
the lead encoding (each fact after the preamble alone, a second blob) adds."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from inferscale.contracts.blob_name import BlobName, FactId
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.kv.durable import LocalDir
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.store import KVStore
from inferscale.lab.bench.common import print_table, write_report
from inferscale.pipeline.extraction import turn_fact
from inferscale.pipeline.sources import read_turns


def run(model_path: Path, data: Path, out_dir: Path, facts: int = 64,
        windows: tuple[int, ...] = (0, 5, 10, 20), batch_size: int = 8) -> dict:
    """Encode ``facts`` facts of the first conversation per window; print and save figures."""
    turns = list(read_turns(data))
    texts = [f for t in turns if (f := turn_fact(t.speaker, t.text, t.timestamp))]
    encoder = FactEncoder(model_path)
    rows, results = [], []
    for window in windows:
        start = max(window, len(texts) // 4)
        items = [encoder.fact_item(texts[i], texts[max(0, i - window):i])
                 for i in range(start, start + facts)]
        encoder.encode(items[:2])  # warm-up
        with tempfile.TemporaryDirectory() as tmp:
            store = KVStore(LocalDir(Path(tmp)), model_fingerprint(model_path), host_bytes=0)
            forward_s, write_s, nbytes = _encode_and_write(encoder, store, items, batch_size,
                                                           window)
            lead_s = 0.0
            if window:
                leads = [encoder.fact_item(texts[i], []) for i in range(start, start + facts)]
                lead_s = sum(_encode_and_write(encoder, store, leads, batch_size, 0, lead=True)[:2])
        total = forward_s + write_s
        fact_tokens = sum(len(i.span_ids) for i in items)
        all_tokens = sum(len(i.prefix_ids) + len(i.span_ids) for i in items)
        result = {
            "window": window, "facts": len(items), "facts_per_s": len(items) / total,
            "fact_tokens_per_s": fact_tokens / total, "forward_tokens_per_s": all_tokens / total,
            "avg_fact_tokens": fact_tokens / len(items), "avg_seq_tokens": all_tokens / len(items),
            "kv_bytes_per_fact": nbytes / len(items), "host_gib_per_10k_facts":
                nbytes / len(items) * 10_000 / 2**30,
            "forward_share": forward_s / total,
            "facts_per_s_with_lead": len(items) / (total + lead_s),
        }
        results.append(result)
        rows.append([window, result["facts_per_s"], result["fact_tokens_per_s"],
                     result["forward_tokens_per_s"], int(result["avg_seq_tokens"]),
                     int(result["kv_bytes_per_fact"]), result["host_gib_per_10k_facts"],
                     f"{100 * result['forward_share']:.0f}%", result["facts_per_s_with_lead"]])
    print(f"model {model_path.name} on {encoder.device}, compute {encoder.dtype}, "
          f"KV {encoder.kv_dtype}, batch {batch_size}")
    print_table(["w", "facts/s", "fact tok/s", "fwd tok/s", "seq tok", "KV B/fact",
                 "GiB/10k facts", "forward share", "facts/s with lead"], rows)
    report = {"model": str(model_path), "device": str(encoder.device),
              "dtype": str(encoder.dtype), "batch_size": batch_size, "results": results}
    write_report(out_dir, "encode", report)
    return report


def _encode_and_write(encoder: FactEncoder, store: KVStore, items: list, batch_size: int,
                      window: int, lead: bool = False) -> tuple[float, float, int]:
    """Encode ``items`` in batches and write their blobs: (forward s, write s, bytes)."""
    forward_s = write_s = 0.0
    nbytes = 0
    for b in range(0, len(items), batch_size):
        t0 = time.perf_counter()
        spans = encoder.encode(items[b:b + batch_size])
        t1 = time.perf_counter()
        for n, span in enumerate(spans):
            nbytes += store.put(BlobName(FactId(b + n), lead), span.k, span.v, span.token_ids,
                                window).nbytes
        write_s += time.perf_counter() - t1
        forward_s += t1 - t0
    return forward_s, write_s, nbytes
