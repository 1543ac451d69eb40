"""Prometheus metrics of the memory front end and retrieval (the KV path's are in
``kv/kv_metrics.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram


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
    recorded_turns: Counter


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
    recorded_turns=Counter("inferscale_recorded_turns",
                           "Turns of conversations recorded (\"record\": true), by outcome",
                           ["outcome"]),
    auto_recompute=Counter("inferscale_recompute_auto",
                           "Requests under recompute auto by the attempt that answered: kept "
                           "(every fact injected), recomputed (the tail), text (every fact)",
                           ["decision"]),
)
