"""`inferscale bench cost`: what keeping memory as KV costs, by format, and what a KV budget
does for a population of users.

Bytes (measured): the dev conversations' facts (the ``turn`` extractor's), tokenized as the
layout renders them, stored as the encode stage stores them (a blob per fact, a lead blob per
fact that gets one) in every format; K/V are random (a blob's size depends on its shape only:
nothing is entropy coded), in the served model's shape and in Llama-3.1-8B's (32 layers, 8 KV
heads, head_dim 128, bf16).

Population (a model of the budget policy of ``db/kv_budget.py`` and the encode stage, whose
SQL the integration tests pin): ``users`` users, each with the facts of a dev conversation
(drawn with replacement), all encoded at the start (as ingest leaves them). Requests arrive
Poisson at ``rate`` per second, each for a user drawn from a Zipf law. A request of a user whose
KV is held is hot: injected from the server's host tier (an LRU of ``host_bytes``) or paged in
from the durable tier; else it is cold: served as text, and the user's facts queue to be
encoded again at ``encode_rate`` facts per second. Every ``interval_s`` the least recently
served users beyond the grace period lose their KV until the tier holds ``headroom`` under the
budget. TTFT of each kind of request: the medians of a ``bench ttft`` report (inject, disk,
text at k).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferscale.contracts.blob import encode_blob
from inferscale.contracts.kv_format import FORMATS
from inferscale.core.settings import Settings
from inferscale.lab.bench.common import print_table, write_report

LLAMA_8B = (32, 8, 128)  # layers, KV heads, head_dim
HOUR = 3600.0


def blob_bytes(shape: tuple[int, int, int], tokens: int, kv_format: str) -> int:
    """Bytes of one blob of ``tokens`` tokens of a model with KV ``shape`` (layers, heads,
    head_dim) in ``kv_format``, as ``encode_blob`` writes it."""
    layers, heads, dim = shape
    k, v = torch.randn(2, layers, tokens, heads, dim).to(torch.bfloat16)
    return len(encode_blob(k, v, [0] * tokens, "0" * 64, 0, kv_format)[0])


def lead_share_of(memory_sizes: list[int], settings: Settings) -> float:
    """The share of facts the encode stage gives a lead blob (``workers/encode.py``), at most:
    every fact of a memory's first ``window`` (as if each was encoded before the next arrived),
    then ``lead_share`` of the rest."""
    w = settings.window
    leads = sum(min(n, w) + settings.lead_share * max(n - w, 0) for n in memory_sizes)
    return leads / sum(memory_sizes)


def fact_bytes(shape: tuple[int, int, int], token_counts: list[int], body: str,
               lead: str | None, lead_share: float = 1.0) -> float:
    """Mean bytes at rest per fact (its blob, and ``lead_share`` of a lead blob unless ``lead``
    is None) over facts of these token counts; exact per distinct count (a count's bytes are
    affine in it)."""
    low, high = min(token_counts), max(token_counts)
    per = {}
    for kv_format in {body, lead} - {None}:
        a, b = blob_bytes(shape, low, str(kv_format)), blob_bytes(shape, high, str(kv_format))
        slope = (b - a) / max(high - low, 1)
        per[kv_format] = statistics.mean(a + slope * (n - low) for n in token_counts)
    return per[body] + (per[lead] * lead_share if lead is not None else 0.0)


@dataclass(frozen=True)
class Policy:
    budget_bytes: float
    grace_s: float = 300.0
    interval_s: float = 30.0
    headroom: float = 0.05
    encode_rate: float = 0.7  # facts/s
    host_bytes: float = 32 * 2**30


def simulate(facts_per_user: np.ndarray, bytes_per_fact: float, policy: Policy, rate: float,
             zipf_a: float, hours: float, ttft: dict[str, float], seed: int = 0
             ) -> dict[str, Any]:
    """Run the population for ``hours``; the hit rate, re-encode load, TTFT by kind and bytes
    held over time."""
    rng = np.random.default_rng(seed)
    users = len(facts_per_user)
    size = facts_per_user * bytes_per_fact
    held = np.ones(users, dtype=bool)
    total = float(size.sum())
    last = np.full(users, -math.inf)
    weights = rng.permutation(1.0 / np.arange(1, users + 1) ** zipf_a)  # popularity by chance
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * hours * HOUR * 1.1) + 10))
    arrivals = arrivals[arrivals < hours * HOUR]
    who = rng.choice(users, size=len(arrivals), p=weights / weights.sum())
    queue: deque[int] = deque()
    queued = np.zeros(users, dtype=bool)
    busy_until = 0.0  # the encoder's current user ends then
    encoding: int | None = None
    host: OrderedDict[int, float] = OrderedDict()
    host_total = 0.0
    kinds = {"host": 0, "disk": 0, "cold": 0}
    last_hour = {"hits": 0, "requests": 0}
    reencoded_users = reencoded_facts = evicted_users = 0
    timeline = []
    next_round = policy.interval_s

    def finish_encodes(now: float) -> None:
        nonlocal busy_until, encoding, total, reencoded_users, reencoded_facts
        while True:
            if encoding is not None and busy_until <= now:
                held[encoding], queued[encoding] = True, False
                total += size[encoding]
                reencoded_users += 1
                reencoded_facts += int(facts_per_user[encoding])
                encoding = None
            if encoding is None and queue:
                encoding = queue.popleft()
                busy_until = max(busy_until, now) + facts_per_user[encoding] / policy.encode_rate
                continue
            return

    def evict(now: float) -> None:
        nonlocal total, evicted_users
        if total <= policy.budget_bytes:
            return
        target = policy.budget_bytes * (1 - policy.headroom)
        candidates = np.flatnonzero(held & (last < now - policy.grace_s))
        for u in candidates[np.argsort(last[candidates], kind="stable")]:
            if total <= target:
                break
            held[u] = False
            total -= size[u]
            evicted_users += 1

    for t, u in zip(arrivals, who, strict=True):
        while next_round <= t:
            finish_encodes(next_round)
            evict(next_round)
            timeline.append((next_round / HOUR, total, host_total))
            next_round += policy.interval_s
        finish_encodes(t)
        last[u] = t
        if t >= (hours - 1) * HOUR:
            last_hour["requests"] += 1
            last_hour["hits"] += int(held[u])
        if held[u]:
            if u in host:
                host.move_to_end(u)
                kinds["host"] += 1
            else:
                kinds["disk"] += 1
                host[u] = size[u]
                host_total += size[u]
                while host_total > policy.host_bytes and host:
                    host_total -= host.popitem(last=False)[1]
        else:
            kinds["cold"] += 1
            host_total -= host.pop(u, 0.0)
            if not queued[u]:
                queued[u] = True
                queue.append(u)
    requests = sum(kinds.values())
    ttfts = np.repeat([ttft["host"], ttft["disk"], ttft["cold"]],
                      [kinds["host"], kinds["disk"], kinds["cold"]])
    return {
        "requests": requests, "hit_rate": (kinds["host"] + kinds["disk"]) / max(requests, 1),
        "host_hit_rate": kinds["host"] / max(requests, 1), "kinds": kinds,
        "hit_rate_last_hour": last_hour["hits"] / max(last_hour["requests"], 1),
        "distinct_users": int(len(np.unique(who))),
        "reencoded_users_per_hour": reencoded_users / hours,
        "reencoded_facts_per_hour": reencoded_facts / hours,
        "evicted_users": evicted_users, "reencode_queue_at_end": len(queue),
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if requests else None,
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if requests else None,
        "durable_bytes_max_after_start": max((b for h, b, _ in timeline if h >= 0.25),
                                             default=total),
        "timeline": [{"hour": round(h, 3), "durable_bytes": b, "host_bytes": hb}
                     for h, b, hb in timeline[::max(len(timeline) // 200, 1)]],
    }


def _ttft(report: Path, k: int) -> dict[str, float]:
    """Median TTFT of inject (host tier), inject from disk and text prefill at ``k``."""
    rows = {r["mode"]: r["ttft_median_s"] for r in json.loads(report.read_text())["rows"]
            if r["k"] == k}
    return {"host": rows["inject"], "disk": rows["inject-disk"], "cold": rows["text"]}


def run(settings: Settings, data: Path, model_path: Path, out_dir: Path, ttft_report: Path,
        users: int = 10_000, rate: float = 2.0, zipf_a: float = 1.1, hours: float = 6.0,
        k: int = 20, budget_shares: tuple[float, ...] = (0.05, 0.1, 0.25),
        encode_rates: tuple[float, ...] = (0.7, 70.0), seed: int = 0) -> dict:
    """Bytes per fact and per user by format; then the population under each budget (a share
    of what it holds raw), raw vs the settings' format, at each encode rate."""
    from transformers import AutoConfig, AutoTokenizer

    from inferscale.contracts.layout import MemoryLayout
    from inferscale.kv.rope import model_head_dim
    from inferscale.lab.drift import load_locomo

    model_config = AutoConfig.from_pretrained(model_path)
    layout = MemoryLayout(AutoTokenizer.from_pretrained(model_path))
    kv_format = settings.kv_format
    conversations = len(json.loads(data.read_text()))
    memories = [load_locomo(data, c, None, 0, seed)[0] for c in range(conversations)]
    tokens = [len(layout.fact_segment(f)) for facts in memories for f in facts]
    served = (model_config.num_hidden_layers, model_config.num_key_value_heads,
              model_head_dim(model_config))
    lead = settings.lead_kv_format or kv_format if settings.lead_encoding else None
    lead_share = lead_share_of([len(m) for m in memories], settings)
    formats = {"raw": ("raw", "raw"), kv_format: (kv_format, lead)}
    bytes_rows: list[dict[str, Any]] = []
    for model, shape in (("served", served), ("llama-3.1-8b", LLAMA_8B)):
        for name in FORMATS:
            per_fact = fact_bytes(shape, tokens, name, name)
            bytes_rows.append({"model": model, "format": name, "lead": name,
                               "lead_share": 1.0, "bytes_per_fact": per_fact,
                               "bytes_per_user": per_fact * len(tokens) / conversations})
        body, lead_format = formats[kv_format]
        per_fact = fact_bytes(shape, tokens, body, lead_format, lead_share)
        bytes_rows.append({"model": model, "format": f"{body} (default)", "lead": lead_format,
                           "lead_share": lead_share, "bytes_per_fact": per_fact,
                           "bytes_per_user": per_fact * len(tokens) / conversations})
    for row in bytes_rows:
        raw = next(r for r in bytes_rows if r["model"] == row["model"] and r["format"] == "raw")
        row["share_of_raw"] = row["bytes_per_fact"] / raw["bytes_per_fact"]
    print_table(["model", "format", "lead", "facts with a lead", "bytes / fact", "MB / user",
                 "share of raw"],
                [[r["model"], r["format"], r["lead"], r["lead_share"], int(r["bytes_per_fact"]),
                  r["bytes_per_user"] / 1e6, r["share_of_raw"]] for r in bytes_rows])

    rng = np.random.default_rng(seed)
    facts_per_user = np.array([len(m) for m in memories])[rng.integers(0, conversations, users)]
    ttft = _ttft(ttft_report, k)
    served_bytes = {r["format"]: r["bytes_per_fact"] for r in bytes_rows
                    if r["model"] == "served"}
    compared = {"raw": served_bytes["raw"], kv_format: served_bytes[f"{kv_format} (default)"]}
    raw_total = float(facts_per_user.sum()) * compared["raw"]
    runs = []
    for share in budget_shares:
        for encode_rate in encode_rates:
            for name, bytes_per_fact in compared.items():
                policy = Policy(budget_bytes=raw_total * share, encode_rate=encode_rate)
                result = simulate(facts_per_user, bytes_per_fact, policy, rate, zipf_a, hours,
                                  ttft, seed)
                runs.append({"budget_share_of_raw": share, "budget_bytes": policy.budget_bytes,
                             "encode_rate": encode_rate, "format": name, **result})
    print_table(["budget (share of raw)", "encode facts/s", "format", "hit rate",
                 "last hour", "host hits", "re-encoded users/h", "queue at end", "TTFT p50 s",
                 "TTFT p99 s"],
                [[r["budget_share_of_raw"], r["encode_rate"], r["format"], r["hit_rate"],
                  r["hit_rate_last_hour"], r["host_hit_rate"], r["reencoded_users_per_hour"],
                  r["reencode_queue_at_end"], r["ttft_p50_s"], r["ttft_p99_s"]] for r in runs])
    report = {"users": users, "rate_per_s": rate, "zipf_a": zipf_a, "hours": hours, "k": k,
              "kv_format": kv_format, "lead_format": lead, "lead_share": lead_share, "ttft_s": ttft,
              "ttft_report": str(ttft_report), "raw_population_bytes": raw_total,
              "facts_per_user_mean": float(facts_per_user.mean()), "bytes": bytes_rows,
              "runs": runs}
    path = write_report(out_dir, "cost", report)
    _plot(runs, out_dir / "cost.png")
    print(f"wrote {path}")
    return report


def _plot(runs: list[dict], path: Path) -> None:
    """Durable bytes over time per run (one panel per budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = sorted({r["budget_share_of_raw"] for r in runs})
    fig, axes = plt.subplots(1, len(shares), figsize=(5 * len(shares), 3.6), squeeze=False)
    for ax, share in zip(axes[0], shares, strict=True):
        for r in (r for r in runs if r["budget_share_of_raw"] == share):
            ax.plot([p["hour"] for p in r["timeline"]],
                    [p["durable_bytes"] / 1e12 for p in r["timeline"]],
                    label=f"{r['format']}, {r['encode_rate']:g} facts/s "
                          f"(hit {r['hit_rate']:.0%})")
        budget = next(r["budget_bytes"] for r in runs if r["budget_share_of_raw"] == share)
        ax.axhline(budget / 1e12, color="grey", linestyle=":", label="budget")
        ax.set_title(f"budget {share:.0%} of the raw population")
        ax.set_xlabel("hour")
        ax.set_ylabel("durable tier (TB)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
