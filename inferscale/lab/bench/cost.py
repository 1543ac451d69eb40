"""`inferscale bench cost`: what keeping memory as KV costs, by format, and what a KV budget
does for a population of users.

Bytes (measured): the dev conversations' facts (the ``turn`` extractor's), tokenized as the
layout renders them, stored as the encode stage stores them (a blob per fact, a lead blob per
fact that gets one) in every format; K/V are random (a blob's size depends on its shape only:
nothing is entropy coded), in the served model's shape and in Llama-3.1-8B's (32 layers, 8 KV
heads, head_dim 128, bf16).

Population (a model of the budget policy of ``db/kv_budget.py`` and the encode stage, whose
SQL the integration tests pin; fact by fact since the soak measured where a model of whole users
was wrong, ``docs/results/soak.md``): ``users`` users, each with the facts of a dev
conversation (drawn with replacement), all encoded at the start (as ingest leaves them).
Requests arrive Poisson at ``rate`` per second, each for a user drawn from a Zipf law, and
retrieve ``k`` of the user's facts: injected when all hold KV (from the server's host tier, an
LRU of ``host_bytes``, or paged in from the durable tier), partial when some do, text when none
do; the facts it missed queue to be encoded again at ``encode_rate`` facts per second. Every
``interval_s`` each user's oldest encodings beyond the per-user budget go, then the least
recently served users' facts until the tier holds ``headroom`` under the budget, sparing facts
served within the grace period. TTFT of each kind: the medians of a ``bench ttft`` report
(inject, disk, text at k); a partial request's is interpolated (``simulate``).
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
from inferscale.lab.bench.common import print_table, settings_differing, write_report

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
    user_budget_bytes: float | None = None  # kv_user_budget_bytes (None: none)


def simulate(facts_per_user: np.ndarray, bytes_per_fact: float, policy: Policy, rate: float,
             zipf_a: float, hours: float, ttft: dict[str, float], seed: int = 0, k: int = 5,
             new_fact_rate: float = 0.0) -> dict[str, Any]:
    """Run the population for ``hours`` (a model, fact by fact): each request retrieves ``k``
    of its user's facts (uniformly), is ``injected`` when all of them hold KV (from the host
    tier or the durable one), ``partial`` when some do, ``text`` when none do, and wants the
    missing ones encoded again; new facts arrive at ``new_fact_rate`` for users drawn by
    activity. Each round, each user's oldest encodings beyond ``user_budget_bytes`` go, then the
    least recently served users' facts until the tier is ``headroom`` under the budget, sparing
    the facts served within the grace (as ``db/kv_budget.py``). TTFT: ``ttft["host"]`` /
    ``["disk"]`` for an injected request, ``["cold"]`` for text, and for a partial one the
    injected figure plus the cold one's extra in the share of its facts sent as text (a model).
    Returns the shares of each kind, the re-encode load, TTFT, bytes held over time."""
    rng = np.random.default_rng(seed)
    users = len(facts_per_user)
    weights = rng.permutation(1.0 / np.arange(1, users + 1) ** zipf_a)  # popularity by chance
    weights /= weights.sum()
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * hours * HOUR * 1.1) + 10))
    arrivals = arrivals[arrivals < hours * HOUR]
    who = rng.choice(users, size=len(arrivals), p=weights)
    growth = (np.cumsum(rng.exponential(1 / new_fact_rate, int(new_fact_rate * hours * HOUR
                                                              * 1.1) + 10))
              if new_fact_rate > 0 else np.zeros(0))
    growth = growth[growth < hours * HOUR]
    growers = rng.choice(users, size=len(growth), p=weights)
    capacity = int(facts_per_user.sum()) + len(growth)
    owner = np.empty(capacity, np.int64)
    owner[:int(facts_per_user.sum())] = np.repeat(np.arange(users), facts_per_user)
    n_facts = int(facts_per_user.sum())
    mine: list[list[int]] = [[] for _ in range(users)]
    for fact, user in enumerate(owner[:n_facts]):
        mine[user].append(fact)
    held = np.zeros(capacity, bool)
    held[:n_facts] = True  # all encoded at the start, as ingest leaves them
    ever = held.copy()  # encoded once: another encode is a re-encode
    encoded_at = np.full(capacity, -math.inf)
    served_at = np.full(capacity, -math.inf)
    user_served = np.full(users, -math.inf)
    wanted = np.zeros(capacity, bool)
    queue: deque[int] = deque()
    host: OrderedDict[int, None] = OrderedDict()  # facts in the server's host tier
    host_slots = max(int(policy.host_bytes // max(bytes_per_fact, 1.0)), 0)
    kinds = {"host": 0, "disk": 0, "partial": 0, "text": 0}
    ttfts: list[float] = []
    last_hour = {"injected": 0, "requests": 0}
    reencoded = encoded = evicted = 0
    timeline = []
    encoder_free = 0.0
    next_round = policy.interval_s
    grew = 0

    def finish_encodes(now: float) -> None:
        nonlocal encoder_free, reencoded, encoded
        while queue and encoder_free + 1 / policy.encode_rate <= now:
            encoder_free = max(encoder_free, 0.0) + 1 / policy.encode_rate
            fact = queue.popleft()
            held[fact], wanted[fact] = True, False
            encoded_at[fact] = encoder_free
            reencoded += int(ever[fact])
            encoded += 1
            ever[fact] = True

    def want(fact: int, now: float) -> None:
        if not wanted[fact]:
            wanted[fact] = True
            if not queue:
                nonlocal encoder_free
                encoder_free = max(encoder_free, now)
            queue.append(fact)

    def evict(now: float) -> None:
        nonlocal evicted
        spared = served_at >= now - policy.grace_s
        live = held[:n_facts]
        if policy.user_budget_bytes is not None:
            per_user = np.bincount(owner[:n_facts][live], minlength=users) * bytes_per_fact
            for user in np.flatnonzero(per_user > policy.user_budget_bytes):
                facts = [f for f in mine[user] if held[f] and not spared[f]]
                facts.sort(key=lambda f: encoded_at[f])  # the oldest encodings first
                over = per_user[user] - policy.user_budget_bytes
                for fact in facts[:int(math.ceil(over / bytes_per_fact))]:
                    held[fact] = False
                    evicted += 1
        total = float(held[:n_facts].sum()) * bytes_per_fact
        if total <= policy.budget_bytes:
            return
        target = policy.budget_bytes * (1 - policy.headroom)
        for user in np.argsort(user_served, kind="stable"):
            if total <= target:
                break
            for fact in mine[user]:
                if held[fact] and not spared[fact]:
                    held[fact] = False
                    evicted += 1
                    total -= bytes_per_fact
                    if total <= target:
                        break

    for t, u in zip(arrivals, who, strict=True):
        while next_round <= t:
            finish_encodes(next_round)
            evict(next_round)
            timeline.append((next_round / HOUR, float(held[:n_facts].sum()) * bytes_per_fact))
            next_round += policy.interval_s
        while grew < len(growth) and growth[grew] <= t:  # a new fact: its KV is encoded
            user = int(growers[grew])
            owner[n_facts] = user
            mine[user].append(n_facts)
            want(n_facts, growth[grew])
            n_facts += 1
            grew += 1
        finish_encodes(t)
        user_served[u] = t
        facts = mine[u]
        asked = [facts[i] for i in rng.choice(len(facts), min(k, len(facts)), replace=False)]
        served = [f for f in asked if held[f]]
        for fact in asked:
            served_at[fact] = t
            if not held[fact]:
                want(fact, t)
        if served and len(served) == len(asked):
            in_host = all(f in host for f in served)
            kind = "host" if in_host else "disk"
            ttfts.append(ttft[kind])
        elif served:
            kind = "partial"
            ttfts.append(ttft["disk"] + (ttft["cold"] - ttft["disk"])
                         * (len(asked) - len(served)) / len(asked))
        else:
            kind = "text"
            ttfts.append(ttft["cold"])
        kinds[kind] += 1
        for fact in served:
            host[fact] = None
            host.move_to_end(fact)
        while len(host) > host_slots:
            host.popitem(last=False)
        if t >= (hours - 1) * HOUR:
            last_hour["requests"] += 1
            last_hour["injected"] += int(kind in ("host", "disk"))
    requests = sum(kinds.values())
    return {
        "requests": requests, "kinds": kinds,
        "injected_share": (kinds["host"] + kinds["disk"]) / max(requests, 1),
        "some_kv_share": (kinds["host"] + kinds["disk"] + kinds["partial"]) / max(requests, 1),
        "host_hit_rate": kinds["host"] / max(requests, 1),
        "injected_share_last_hour": last_hour["injected"] / max(last_hour["requests"], 1),
        "distinct_users": int(len(np.unique(who))),
        "reencoded_facts_per_hour": reencoded / hours, "encoded_facts_per_hour": encoded / hours,
        "evicted_facts": evicted,
        "new_facts": len(growth), "reencode_queue_at_end": len(queue),
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if requests else None,
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if requests else None,
        "durable_bytes_max_after_start": max((b for h, b in timeline if h >= 0.25),
                                             default=float(held.sum()) * bytes_per_fact),
        "timeline": [{"hour": round(h, 3), "durable_bytes": b}
                     for h, b in timeline[::max(len(timeline) // 200, 1)]],
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
                                  ttft, seed, k)
                runs.append({"budget_share_of_raw": share, "budget_bytes": policy.budget_bytes,
                             "encode_rate": encode_rate, "format": name, **result})
    print_table(["budget (share of raw)", "encode facts/s", "format", "all facts as KV",
                 "some", "last hour", "host hits", "re-encoded facts/h", "queue at end",
                 "TTFT p50 s", "TTFT p99 s"],
                [[r["budget_share_of_raw"], r["encode_rate"], r["format"], r["injected_share"],
                  r["some_kv_share"], r["injected_share_last_hour"], r["host_hit_rate"],
                  r["reencoded_facts_per_hour"], r["reencode_queue_at_end"], r["ttft_p50_s"],
                  r["ttft_p99_s"]] for r in runs])
    report = {"settings_differing": settings_differing(settings),
              "data": {"file": str(data), "conversations": conversations, "facts": len(tokens)},
              "users": users, "rate_per_s": rate, "zipf_a": zipf_a, "hours": hours, "k": k,
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
                          f"(all KV {r['injected_share']:.0%})")
        budget = next(r["budget_bytes"] for r in runs if r["budget_share_of_raw"] == share)
        ax.axhline(budget / 1e12, color="grey", linestyle=":", label="budget")
        ax.set_title(f"budget {share:.0%} of the raw population")
        ax.set_xlabel("hour")
        ax.set_ylabel("durable tier (TB)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
