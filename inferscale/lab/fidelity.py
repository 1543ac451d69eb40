"""Fidelity metrics: how closely answers with injected memory follow the same memory prefilled.

Answers are compared on generated token ids (not words): first token, first n tokens, whole
answer; the first-token distributions through a KL estimate from the top logprobs; answer F1
through a paired bootstrap interval of the gap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

MIN_PROB = 1e-9  # floor for a probability the top logprobs do not cover


def same_prefix(a: Sequence[int], b: Sequence[int], n: int) -> bool:
    """Whether the first ``n`` generated token ids agree (a shorter answer counts whole)."""
    return list(a[:n]) == list(b[:n])


def top_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(P || Q) in nats, estimated from two top-logprob maps (token id -> logprob).

    Sums over P's top tokens plus one bucket for the rest of P's mass. A token missing from
    Q's top list gets the smaller of Q's lowest listed probability and Q's uncovered mass.
    """
    if not p:
        raise ValueError("P has no logprobs")
    q_probs = {t: math.exp(lp) for t, lp in q.items()}
    q_rest = max(1.0 - sum(q_probs.values()), MIN_PROB)
    q_unlisted = max(min(min(q_probs.values(), default=1.0), q_rest), MIN_PROB)
    kl, p_listed, q_listed = 0.0, 0.0, 0.0
    for token, logprob in p.items():
        p_t = math.exp(logprob)
        q_t = q_probs.get(token, q_unlisted)
        kl += p_t * (logprob - math.log(q_t))
        p_listed += p_t
        q_listed += q_t
    p_rest = max(1.0 - p_listed, 0.0)
    if p_rest > MIN_PROB:
        kl += p_rest * math.log(p_rest / max(1.0 - q_listed, MIN_PROB))
    return max(kl, 0.0)


def bootstrap_mean_ci(values: Sequence[float], resamples: int = 2000, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (paired differences)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    return _percentile_interval(means, level)


def _percentile_interval(resampled: np.ndarray, level: float) -> tuple[float, float]:
    """The central ``level`` interval of bootstrap resamples' statistics."""
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(resampled, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_median_ratio_ci(numerators: Sequence[float], denominators: Sequence[float],
                              resamples: int = 2000, level: float = 0.95,
                              seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of median(numerators) / median(denominators), resampling
    the pairs together (two timings of the same questions)."""
    top, bottom = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if top.size != bottom.size or top.size == 0:
        raise ValueError("a median ratio needs the same non-empty questions on both sides")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, top.size, size=(resamples, top.size))
    ratios = np.median(top[picks], axis=1) / np.median(bottom[picks], axis=1)
    return _percentile_interval(ratios, level)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95% by default) of a rate of ``successes`` in ``n`` trials."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes} of {n}")
    rate = successes / n
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def exact_path_agreement(text: Sequence[dict], hit: Sequence[dict],
                         candidate: Sequence[dict]) -> dict:
    """First-token agreement of ``candidate`` with either of two exact answers to each question
    (text prefill, and a prefix-cache hit of the same prompt: both exact serving, which can
    differ on a near-tie), with its Wilson interval; and how often the two exact
    answers themselves differ."""
    if not len(text) == len(hit) == len(candidate) or not text:
        raise ValueError("exact-path agreement needs the same non-empty question list on all sides")
    rows = list(zip(text, hit, candidate, strict=True))
    either = sum(same_prefix(t["token_ids"], c["token_ids"], 1)
                 or same_prefix(h["token_ids"], c["token_ids"], 1) for t, h, c in rows)
    split = sum(not same_prefix(t["token_ids"], h["token_ids"], 1) for t, h, _ in rows)
    return {"questions": len(rows), "first_token_either": either / len(rows),
            "first_token_either_ci95": list(wilson_interval(either, len(rows))),
            "exact_paths_differ": split / len(rows)}


SERVED_AS_TEXT = "text"  # recompute auto's outcome where every fact was prefilled as text


def served_as_kv(reference: Sequence[dict], candidate: Sequence[dict],
                 outcomes: Sequence[str | None], hit: Sequence[dict] | None = None) -> dict:
    """First-token agreement of ``candidate`` with text prefill (``reference``), split by how
    each request was answered: an answer recompute auto sent to text agrees by construction,
    so the figure that says whether KV is faithful is the one over the requests served with KV
    (``outcomes``: each request's ``x-inferscale-recompute-auto``; None: not under auto, served
    with KV). With ``hit`` (the prefix hit's answers), agreement with either exact answer too.
    Also each request's TTFT over text prefill's of the same prompt (p50, p95, and of the
    requests answered as text, which pay every earlier attempt first)."""
    if not len(reference) == len(candidate) == len(outcomes) or not reference:
        raise ValueError("served_as_kv needs the same non-empty question list on all sides")
    rows = list(zip(reference, candidate, outcomes, strict=True))
    kv = [(r, c) for r, c, o in rows if o != SERVED_AS_TEXT]
    agree = sum(same_prefix(r["token_ids"], c["token_ids"], 1) for r, c, _ in rows)
    kv_agree = sum(same_prefix(r["token_ids"], c["token_ids"], 1) for r, c in kv)
    ratios = [c["ttft_s"] / r["ttft_s"] for r, c, _ in rows if r["ttft_s"] > 0]
    as_text = [c["ttft_s"] / r["ttft_s"] for r, c, o in rows
               if o == SERVED_AS_TEXT and r["ttft_s"] > 0]
    out = {"questions": len(rows), "first_token": agree / len(rows),
           "first_token_ci95": list(wilson_interval(agree, len(rows))),
           "served_as_kv": len(kv) / len(rows), "served_as_text": 1 - len(kv) / len(rows),
           "first_token_kv": kv_agree / len(kv) if kv else None,
           "first_token_kv_ci95": list(wilson_interval(kv_agree, len(kv))) if kv else None,
           "ttft_over_text_p50": float(np.median(ratios)) if ratios else None,
           "ttft_over_text_p95": float(np.percentile(ratios, 95)) if ratios else None,
           "as_text_ttft_over_text_p50": float(np.median(as_text)) if as_text else None}
    if hit is not None:
        if len(hit) != len(rows):
            raise ValueError("the prefix hit's answers must be of the same questions")
        either = [same_prefix(r["token_ids"], c["token_ids"], 1)
                  or same_prefix(h["token_ids"], c["token_ids"], 1)
                  for (r, c, _), h in zip(rows, hit, strict=True)]
        kv_either = [e for e, (_, _, o) in zip(either, rows, strict=True) if o != SERVED_AS_TEXT]
        out["first_token_either"] = sum(either) / len(rows)
        out["first_token_kv_either"] = sum(kv_either) / len(kv_either) if kv_either else None
    return out


def compare(reference: Sequence[dict], candidate: Sequence[dict], first_n: int = 4) -> dict:
    """Agreement of ``candidate`` answers with ``reference`` answers to the same questions.

    Each answer: ``token_ids`` (generated), ``first_top`` (token id -> logprob of the first
    position), ``f1``. Returns rates (the first token's with its Wilson interval), mean
    first-token KL and the F1 gap with its interval.
    """
    if len(reference) != len(candidate) or not reference:
        raise ValueError("compare needs the same non-empty question list on both sides")
    pairs = list(zip(reference, candidate, strict=True))
    gaps = [c["f1"] - r["f1"] for r, c in pairs]
    low, high = bootstrap_mean_ci(gaps)
    first = sum(same_prefix(r["token_ids"], c["token_ids"], 1) for r, c in pairs)
    return {
        "questions": len(pairs),
        "first_token": first / len(pairs),
        "first_token_ci95": list(wilson_interval(first, len(pairs))),
        f"first_{first_n}": statistics.mean(same_prefix(r["token_ids"], c["token_ids"], first_n)
                                            for r, c in pairs),
        "whole_answer": statistics.mean(list(r["token_ids"]) == list(c["token_ids"])
                                        for r, c in pairs),
        "first_token_kl": statistics.mean(top_kl(r["first_top"], c["first_top"])
                                          for r, c in pairs),
        "f1_gap": statistics.mean(gaps),
        "f1_gap_ci95": [low, high],
    }
