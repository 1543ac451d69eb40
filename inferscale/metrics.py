"""Prometheus metrics of the KV store, the connector and retrieval."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram


@dataclass(frozen=True)
class _KVMetrics:
    cache_lookups: Counter
    evictions: Counter
    page_in_bytes: Counter
    page_in_seconds: Histogram


KV_METRICS = _KVMetrics(
    cache_lookups=Counter("inferscale_kv_cache_lookups", "KV cache lookups", ["tier", "result"]),
    evictions=Counter("inferscale_kv_cache_evictions", "KV cache evictions", ["tier"]),
    page_in_bytes=Counter("inferscale_kv_page_in_bytes", "Bytes paged in from the durable tier"),
    page_in_seconds=Histogram("inferscale_kv_page_in_seconds", "Durable page-in latency"),
)
