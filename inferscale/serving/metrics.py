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


@dataclass(frozen=True)
class _FrontendMetrics:
    requests: Counter
    facts: Counter
    injected_tokens: Counter
    prefilled_memory_tokens: Counter
    fallbacks: Counter
    retrieval_seconds: Histogram
    reencodes_wanted: Counter
    purged_blobs: Counter
    auto_recompute: Counter


FRONTEND_METRICS = _FrontendMetrics(
    requests=Counter("inferscale_memory_requests", "Memory requests", ["mode"]),
    facts=Counter("inferscale_memory_facts",
                  "Facts placed in prompts: injected, text, lead (injected from a lead blob)",
                  ["how"]),
    injected_tokens=Counter("inferscale_injected_tokens", "Prompt tokens planned for injection"),
    prefilled_memory_tokens=Counter("inferscale_prefilled_memory_tokens",
                                    "Memory tokens prefilled as text"),
    fallbacks=Counter("inferscale_fallbacks", "Facts or requests served as text", ["reason"]),
    retrieval_seconds=Histogram("inferscale_retrieval_seconds", "Embed + top-k latency"),
    reencodes_wanted=Counter("inferscale_kv_reencodes_wanted",
                             "Served facts whose KV was evicted, marked to be encoded again"),
    purged_blobs=Counter("inferscale_purged_blobs",
                         "Invalidated blobs dropped from the workers' host/device tiers"),
    auto_recompute=Counter("inferscale_recompute_auto",
                           "Requests under recompute auto by the attempt that answered: kept "
                           "(every fact injected), recomputed (the tail), text (every fact)",
                           ["decision"]),
)
