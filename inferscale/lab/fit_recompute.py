"""`inferscale calibrate recompute`: fit recompute auto's policy for the served model.

Recompute auto is deterministic given three answers to a question: with every fact injected
(m = 0), with the best ``tail`` facts prefilled (m = tail) and with every fact as text. An
``eval fidelity`` run that answers calibration questions all three ways therefore replays any
policy (margin, text margin, tail) exactly, offline: a request is kept where m = 0's first-token
top-2 margin reaches ``margin``, else answered by the tail where that answer's margin reaches
``text_margin``, else as text (which agrees with text prefill by construction); where m = 0's
margin is under ``direct_margin``, as text at once. Its TTFT is modelled as the measured TTFTs
of the attempts it makes (kept: m = 0's; recomputed: m = 0's plus the tail's; text: all three,
or m = 0's and text's where the tail is skipped), as a streamed request pays them.

The fit keeps the cheapest policy (mean modelled TTFT) whose first-token agreement with text
prefill reaches the target with 95% confidence (Wilson) and whose shares of requests answered
again and answered as text stay under their bounds; where none does, the most faithful one
within the bounds, marked as short of the target. Agreement bought by answering as text is not
faithfulness of the KV, so every replay also gives the agreement among the requests served with
KV, and the fit returns the Pareto frontier (agreement against mean TTFT) and the curve of the
best agreement per bound on the text share: what a model that cannot reach the target should be
judged by.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.settings import Settings
from inferscale.lab import evaluate
from inferscale.lab.bench.common import print_table, source
from inferscale.lab.evaluate import Config, configs
from inferscale.lab.fidelity import wilson_interval
from inferscale.serving.calibration import Fit, Profile, RecomputePolicy, profile_path

GRID = tuple(i * 0.125 for i in range(25))  # bf16 resolves these logprobs in 0.125-nat steps


@dataclass(frozen=True)
class Attempt:
    """One answer's first token, its top-2 margin (nats) and TTFT (s)."""

    first: int | None
    margin: float
    ttft: float


@dataclass(frozen=True)
class Question:
    """One question at one k answered as text, with every fact injected, and per tail."""

    k: int
    text: Attempt
    injected: Attempt
    tails: dict[int, Attempt]


@dataclass(frozen=True)
class Replay:
    """What a policy does over a set of questions."""

    policy: RecomputePolicy
    n: int
    first_token: float  # share whose first token equals text prefill's
    recomputed_share: float
    text_share: float
    ttft_mean_s: float
    text_ttft_mean_s: float
    first_token_kv: float | None  # the same among requests served with KV (kept, recomputed)
    ttft_over_text_p95: float  # a request's modelled TTFT over its own text prefill's

    @property
    def lower_bound(self) -> float:
        """The lower end of the agreement's 95% Wilson interval."""
        return wilson_interval(round(self.first_token * self.n), self.n)[0]

    @property
    def speedup(self) -> float:
        """Text prefill's mean TTFT over the policy's."""
        return self.text_ttft_mean_s / self.ttft_mean_s

    def summary(self) -> dict:
        """JSON-ready figures, with a Wilson interval for the agreement."""
        lo, hi = wilson_interval(round(self.first_token * self.n), self.n)
        figures = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "policy"}
        return {"policy": self.policy.model_dump(), **figures, "first_token_ci95": [lo, hi],
                "speedup_mean": self.speedup}


def margin(first_top: dict) -> float:
    """Top-2 logprob margin of a first position (inf with one candidate, 0 with none)."""
    values = sorted((float(v) for v in first_top.values()), reverse=True)
    if len(values) < 2:
        return math.inf if values else 0.0
    return values[0] - values[1]


def _attempt(record: dict) -> Attempt:
    ids = record.get("token_ids") or []
    return Attempt(ids[0] if ids else None, margin(record.get("first_top") or {}),
                   float(record["ttft_s"]))


def questions_from(report: dict) -> list[Question]:
    """The questions of an ``eval fidelity`` report that were answered as text, with m = 0 and
    with at least one tail (other configurations are ignored)."""
    encodings = [(c, w) for c in report["contexts"] for w in report["windows"]]
    plan = configs(report["ks"], encodings, report["recomputes"], report["order"],
                   leads=tuple(report["leads"]),
                   key_scales=tuple(report.get("key_scales", [None])))
    by_name: dict[str, Config] = {c.name: c for c in plan}
    grouped: dict[tuple[str, str, int], dict[str, Attempt]] = defaultdict(dict)
    for record in report["records"]:
        config = by_name.get(record["config"])
        if config is None or config.mode == "none" or config.encoding != encodings[0]:
            continue
        slot = "text" if config.mode == "text" else f"m{config.recompute}"
        grouped[(record["sample_id"], record["question"], config.k)][slot] = _attempt(record)
    out = []
    for (_, _, k), got in grouped.items():
        tails = {int(slot[1:]): a for slot, a in got.items()
                 if slot.startswith("m") and slot[1:].isdigit() and slot != "m0"}
        if "text" in got and "m0" in got and tails:
            out.append(Question(k, got["text"], got["m0"], tails))
    return out


def replay(questions: Sequence[Question], policy: RecomputePolicy) -> Replay:
    """Agreement (overall and among requests served with KV), shares and modelled TTFT of
    ``policy`` over ``questions`` (each must have been answered with ``policy.tail``)."""
    agree = recomputed = text = 0
    ttfts, ratios = [], []
    for q in questions:
        if q.injected.margin >= policy.margin:
            agree += q.injected.first == q.text.first
            ttft = q.injected.ttft
        elif q.injected.margin < policy.direct_margin:  # the tail skipped: text at once
            text += 1
            agree += 1
            ttft = q.injected.ttft + q.text.ttft
        elif (tail := q.tails[policy.tail]).margin >= policy.text_margin:
            recomputed += 1
            agree += tail.first == q.text.first
            ttft = q.injected.ttft + tail.ttft
        else:
            text += 1
            agree += 1
            ttft = q.injected.ttft + tail.ttft + q.text.ttft
        ttfts.append(ttft)
        ratios.append(ttft / q.text.ttft if q.text.ttft > 0 else math.inf)
    n = len(questions)
    served_kv = n - text
    return Replay(policy, n, agree / n, recomputed / n, text / n, statistics.mean(ttfts),
                  statistics.mean(q.text.ttft for q in questions),
                  (agree - text) / served_kv if served_kv else None,
                  float(np.percentile(ratios, 95)))


def policies(tails: Iterable[int], grid: Sequence[float] = GRID) -> list[RecomputePolicy]:
    """Every (margin, text margin, tail, direct margin) of the grid; a text margin only
    matters below the margin's reach, so every pair is tried; a direct margin only up to the
    margin (above it every abandoned request skips the tail, as at the margin itself)."""
    return [RecomputePolicy(margin=a, text_margin=t, tail=m, direct_margin=d)
            for m in sorted(tails) for a in grid for t in grid for d in grid if d <= a]


def frontier(replays: Iterable[Replay]) -> list[Replay]:
    """The replays no other beats on both agreement and mean TTFT, fastest first."""
    best: list[Replay] = []
    for r in sorted(replays, key=lambda r: (r.ttft_mean_s, -r.first_token)):
        if not best or r.first_token > best[-1].first_token:
            best.append(r)
    return best


def choose(replays: Sequence[Replay], target: float, max_answered_again: float,
           max_text_share: float = 1.0) -> tuple[Replay, bool]:
    """The cheapest replay whose agreement reaches ``target`` with 95% confidence (the Wilson
    interval's lower end: a few hundred calibration answers must not pick a policy that only
    this sample favours) with at most ``max_answered_again`` of requests recomputed or sent to
    text and at most ``max_text_share`` sent to text (an answer as text agrees by construction:
    without a bound, agreement is bought by not serving KV), and whether it reached the target
    (if none does: the most faithful within the bounds, then the cheapest of those)."""
    within = [r for r in replays if r.recomputed_share + r.text_share <= max_answered_again
              and r.text_share <= max_text_share]
    if not within:
        raise ValueError(f"no policy answers again at most {max_answered_again:.0%} of requests "
                         f"with at most {max_text_share:.0%} as text")
    reaching = [r for r in within if r.lower_bound >= target]
    if reaching:
        return min(reaching, key=lambda r: (r.ttft_mean_s, -r.first_token)), True
    return min(within, key=lambda r: (-r.first_token, r.ttft_mean_s)), False


def text_share_curve(replays: Iterable[Replay],
                     bounds: Sequence[float] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5)
                     ) -> list[dict]:
    """Per bound on the share answered as text, the most faithful policy within it (then the
    cheapest): agreement against how much of it is bought by not serving KV."""
    pool = list(replays)
    curve = []
    for bound in bounds:
        within = [r for r in pool if r.text_share <= bound]
        if within:
            best = min(within, key=lambda r: (-r.first_token, r.ttft_mean_s))
            curve.append({"max_text_share": bound, **best.summary()})
    return curve


def fit(questions: Sequence[Question], target: float, max_answered_again: float,
        max_text_share: float = 1.0) -> dict:
    """The chosen policy and the evidence: its replay overall and per k, the frontier and the
    curve of agreement against the share answered as text."""
    if not questions:
        raise ValueError("no question was answered as text, with m = 0 and with a tail")
    tails = set.intersection(*(set(q.tails) for q in questions))
    replays = [replay(questions, p) for p in policies(tails)]
    chosen, reached = choose(replays, target, max_answered_again, max_text_share)
    per_k = {str(k): replay([q for q in questions if q.k == k], chosen.policy).summary()
             for k in sorted({q.k for q in questions})}
    return {"policy": chosen.policy, "target": {"first_token": target,
                                                "max_answered_again": max_answered_again,
                                                "max_text_share": max_text_share,
                                                "reached": reached},
            "reached": chosen.summary(), "per_k": per_k,
            "frontier": [r.summary() for r in frontier(replays)],
            "text_share_curve": text_share_curve(replays)}


def _table(summaries: Sequence[dict]) -> None:
    print_table(["margin", "text margin", "tail", "direct", "first token", "95% CI",
                 "served as KV: first token", "recomputed", "as text", "text / this TTFT (mean)",
                 "this / text p95"],
                [[s["policy"]["margin"], s["policy"]["text_margin"], s["policy"]["tail"],
                  s["policy"]["direct_margin"], s["first_token"],
                  "{:.3f}..{:.3f}".format(*s["first_token_ci95"]),
                  "" if s["first_token_kv"] is None else s["first_token_kv"],
                  s["recomputed_share"], s["text_share"], s["speedup_mean"],
                  s["ttft_over_text_p95"]]
                 for s in summaries])


def run(settings: Settings, data: Path | None, out_dir: Path, *, records: Path | None = None,
        conversations: tuple[int, ...] = (1,), questions: int = 1000,
        ks: tuple[int, ...] = (20, 50), tails: tuple[int, ...] = (2, 4),
        max_turns: int | None = None, seed: int = 0, target: float = 0.95,
        max_answered_again: float = 0.5, max_text_share: float = 0.5,
        profile_out: Path | None = None) -> Path:
    """Answer the calibration questions as text, with m = 0 and with each tail (or read such a
    run's report), fit, and write the served model's profile; returns its path."""
    if records is None:
        if data is None:
            raise ValueError("calibrate recompute needs --data (or --records of a run)")
        report = evaluate.run(settings, data, out_dir, conversations=conversations,
                              questions=questions, ks=ks, windows=(settings.window,),
                              contexts=(settings.encode_context,), recomputes=(0, *tails),
                              max_tokens=1, max_turns=max_turns, seed=seed)
    else:
        opener = gzip.open if records.suffix == ".gz" else open
        with opener(records, "rt") as f:
            report = json.load(f)
    model_path = resolve_model_path(settings)
    fingerprint = model_fingerprint(model_path)
    if report.get("fingerprint", fingerprint) != fingerprint:
        raise ValueError(f"{records} was answered by model {report.get('model')} "
                         f"({report['fingerprint'][:16]}), not the served model")
    result = fit(questions_from(report), target, max_answered_again, max_text_share)
    _table(result["frontier"])
    print("the most faithful policy per bound on the share answered as text:")
    _table(result["text_share_curve"])
    chosen = result["reached"]
    print(f"chosen: {chosen['policy']} first token {chosen['first_token']:.1%} "
          f"(target {'reached' if result['target']['reached'] else 'NOT reached'})")
    profile = Profile(model=model_path.name, fingerprint=fingerprint, recompute=result["policy"],
                      fit=Fit.model_validate({
                          **{key: result[key] for key in ("target", "reached", "per_k",
                                                          "frontier", "text_share_curve")},
                          "made_from": {"answered_at": report.get("source"),
                                        "fitted_at": source(), "data": report.get("data"),
                                        "settings_differing": report.get("settings_differing"),
                                        "conversations": report.get("conversations"),
                                        "questions": report.get("questions"),
                                        "ks": report.get("ks"),
                                        "max_turns": report.get("max_turns"),
                                        "records": str(records) if records else None}}))
    path = profile_out or profile_path(settings.data_dir, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.model_dump_json(indent=2) + "\n")
    print(f"profile written to {path}")
    return path
