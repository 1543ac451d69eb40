"""The soak's figures over time: per minute, TTFT of each kind of answer, their shares, the TTFT
ratio of text prefill to inject on the same prompts, errors by class, and what the samplers saw
(KV held against the budget, evictions and re-encodes); intervals for medians and shares; plots.

Kinds are ``soak_load.answer_kind``'s. Counters sampled from processes that restart are summed
over restarts (a counter that went down started again from zero).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from inferscale.lab.bench.common import percentile
from inferscale.lab.bench.soak_load import Answer

KINDS = ("injected", "partial", "text-fallback", "recomputed", "text-auto", "no-memory",
         "text-prefill")


def median_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float] | None:
    """A distribution-free ~95% interval of the median (binomial order statistics); None
    under 6 values."""
    n = len(values)
    if n < 6:
        return None
    ordered = sorted(values)
    half = z * math.sqrt(n) / 2
    return ordered[max(0, math.floor(n / 2 - half))], ordered[min(n - 1, math.ceil(n / 2 + half))]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson's ~95% interval of a share k / n; None for n = 0."""
    if n == 0:
        return None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def ttft_ratio(answers: Iterable[Answer]) -> tuple[float | None, int]:
    """Median text-prefill TTFT over median inject TTFT, over the pairs (the same prompt asked
    both ways) where both answered; and how many pairs."""
    by_pair: dict[str, dict[str, float]] = {}
    for a in answers:
        if a.pair is not None and a.ttft is not None:
            by_pair.setdefault(a.pair, {})["text" if a.kind == "text-prefill" else "inject"] = \
                a.ttft
    pairs = [p for p in by_pair.values() if len(p) == 2]
    if not pairs:
        return None, 0
    return (statistics.median(p["text"] for p in pairs)
            / statistics.median(p["inject"] for p in pairs), len(pairs))


def summarise(answers: Sequence[Answer]) -> dict:
    """Counts, shares (with intervals) and TTFT p50 (with its interval) / p99 by kind; errors by
    class; the TTFT ratio on pairs."""
    asked = [a for a in answers if a.kind != "text-prefill"]  # the load's own questions
    kinds = Counter(a.kind for a in asked)
    out: dict = {"requests": len(asked), "errors": dict(Counter(a.error for a in answers
                                                                if a.error)),
                 "kinds": {}}
    for kind in KINDS:
        ttfts = [a.ttft for a in answers if a.kind == kind and a.ttft is not None]
        n = len(ttfts)
        out["kinds"][kind] = {
            "n": n, "share": kinds[kind] / len(asked) if asked and kind in kinds else 0.0,
            "share_ci": wilson(kinds[kind], len(asked)) if kind != "text-prefill" else None,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p50_ci_s": median_ci(ttfts), "ttft_p99_s": percentile(ttfts, 99)}
    out["ttft_ratio_text_over_inject"], out["pairs"] = ttft_ratio(answers)
    return out


class Accumulator:
    """Counters read from processes that restart, summed over their lives."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.total: dict[str, float] = {}

    def update(self, values: dict[str, float]) -> dict[str, float]:
        """Add the new readings; the running totals."""
        for name, value in values.items():
            before = self.last.get(name)
            grown = value if before is None or value < before else value - before
            self.total[name] = self.total.get(name, 0.0) + grown
            self.last[name] = value
        return dict(self.total)


def per_minute(answers: Sequence[Answer], samples: Sequence[dict], began: float, minutes: int
               ) -> list[dict]:
    """The run minute by minute: ``summarise`` of the answers asked in it, and from the samples
    (each with ``at`` and running totals) the KV held (max) and each total's increase."""
    rows = []
    for m in range(minutes):
        lo, hi = began + 60 * m, began + 60 * (m + 1)
        row = {"minute": m, **summarise([a for a in answers if lo <= a.started < hi])}
        inside = [s for s in samples if lo <= s["at"] < hi]
        before = [s for s in samples if s["at"] < lo]
        if inside:
            row["kv_held_bytes_max"] = max((s["kv_held_bytes"] for s in inside
                                            if "kv_held_bytes" in s), default=None)
            start = before[-1] if before else inside[0]
            row["increase"] = {k: inside[-1]["totals"].get(k, 0) - start["totals"].get(k, 0)
                               for k in inside[-1]["totals"]}
        rows.append(row)
    return rows


def plot(rows: list[dict], samples: list[dict], began: float, budget: int | None,
         faults: list[dict], path: Path) -> None:
    """Four panels over time: TTFT p50 by kind, the TTFT ratio on pairs, answer shares, KV held
    against the budget (and the host's load average); faults as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 12), sharex=True)
    minutes = [r["minute"] + 0.5 for r in rows]
    for kind in ("injected", "partial", "text-fallback", "recomputed", "text-prefill"):
        points = [(m, r["kinds"][kind]["ttft_p50_s"]) for m, r in zip(minutes, rows, strict=True)
                  if r["kinds"][kind]["ttft_p50_s"] is not None]
        if points:
            axes[0].plot(*zip(*points, strict=True), marker=".", label=kind)
    axes[0].set_ylabel("TTFT p50 (s)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    ratio = [(m, r["ttft_ratio_text_over_inject"]) for m, r in zip(minutes, rows, strict=True)
             if r["ttft_ratio_text_over_inject"] is not None]
    if ratio:
        axes[1].plot(*zip(*ratio, strict=True), marker="o")
    axes[1].set_ylabel("text / inject TTFT\n(same prompts)")
    bottom = [0.0] * len(rows)
    for kind in ("injected", "partial", "text-fallback", "recomputed", "text-auto", "no-memory"):
        share = [r["kinds"][kind]["share"] for r in rows]
        axes[2].bar(minutes, share, bottom=bottom, width=0.9, label=kind)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    axes[2].set_ylabel("share of answers")
    axes[2].legend(fontsize=7, ncol=3)
    axes[3].plot([(s["at"] - began) / 60 for s in samples],
                 [s["kv_held_bytes"] / 1e6 for s in samples], label="KV held")
    if budget is not None:
        axes[3].axhline(budget / 1e6, color="grey", linestyle=":", label="budget")
    axes[3].set_ylabel("durable KV (MB)")
    axes[3].set_xlabel("minute of the soak")
    axes[3].legend(fontsize=7, loc="lower left")
    load = axes[3].twinx()  # the host's load: other work on the same cores shows here
    load.plot([(s["at"] - began) / 60 for s in samples], [s["loadavg_1m"] for s in samples],
              color="grey", alpha=0.5, linewidth=0.8)
    load.set_ylabel("host load average (1 min)", color="grey")
    for fault in faults:
        for ax in axes:
            ax.axvline((fault["at"] - began) / 60, color="red", alpha=0.3)
        axes[0].annotate(fault["what"], ((fault["at"] - began) / 60, axes[0].get_ylim()[1]),
                         fontsize=6, rotation=90, va="top", color="red")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
