"""Prometheus metrics of the KV path: the store's tiers, page-ins and the connector's writes
(read by the KV store and by the serving stage that drives it)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram


@dataclass(frozen=True)
class _KVMetrics:
    cache_lookups: Counter
    evictions: Counter
    page_in_bytes: Counter
    page_in_seconds: Histogram
    page_in_checks: Counter
    load_failures: Counter
    injected_tokens: Counter
    window_skipped_rows: Counter
    inject_seconds: Histogram
    stage_seconds: Histogram
    hook_errors: Counter


KV_METRICS = _KVMetrics(
    cache_lookups=Counter("inferscale_kv_cache_lookups", "KV cache lookups", ["tier", "result"]),
    evictions=Counter("inferscale_kv_cache_evictions", "KV cache evictions", ["tier"]),
    page_in_bytes=Counter("inferscale_kv_page_in_bytes", "Bytes paged in from the durable tier"),
    page_in_seconds=Histogram("inferscale_kv_page_in_seconds", "Durable page-in latency"),
    page_in_checks=Counter("inferscale_kv_page_in_checks",
                           "Durable page-ins by checksum check: content hashed, or a file "
                           "version already hashed", ["check"]),
    load_failures=Counter("inferscale_kv_load_failures",
                          "Injections refused and recomputed by vLLM", ["reason"]),
    injected_tokens=Counter("inferscale_kv_injected_tokens", "Tokens written into vLLM's cache"),
    window_skipped_rows=Counter("inferscale_kv_window_skipped_rows",
                                "Injected K/V rows (a token of a layer) not written: before the "
                                "window of a sliding-window layer, which vLLM keeps no block for"),
    inject_seconds=Histogram("inferscale_kv_inject_seconds", "Connector load time per step",
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1)),
    stage_seconds=Histogram(
        "inferscale_stage_seconds", "Host time per request stage: compose, sign (front end), "
        "plan_check (scheduler), gather, then rope and cache_write or fused_write (worker)",
        ["stage"],
        buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25)),
    hook_errors=Counter("inferscale_connector_hook_errors",
                        "Unexpected errors caught in connector hooks (answered by a fallback)",
                        ["hook"]),
)
