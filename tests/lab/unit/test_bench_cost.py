"""The population model of ``bench cost`` (pure logic, fact by fact): a budget that holds
everything evicts nothing; a tight one holds the tier under it after every round and answers
partly as KV; a per-user budget holds each user to it; new facts get encoded; blob bytes
follow the format."""

import numpy as np
import pytest

from inferscale.core.settings import Settings
from inferscale.lab.bench.cost import Policy, blob_bytes, fact_bytes, lead_share_of, simulate

TTFT = {"host": 0.1, "disk": 0.15, "cold": 1.0}
K = 5


def _population(users=300, seed=0):
    return np.random.default_rng(seed).integers(50, 400, users)


def test_a_budget_that_holds_everything_serves_every_request_injected():
    facts = _population()
    result = simulate(facts, 1e6, Policy(budget_bytes=float(facts.sum()) * 1e6), rate=2.0,
                      zipf_a=1.1, hours=0.5, ttft=TTFT, k=K)
    assert result["requests"] > 3000 and result["injected_share"] == 1.0
    assert result["evicted_facts"] == 0 and result["ttft_p99_s"] <= TTFT["disk"]


def test_a_tight_budget_holds_the_tier_under_it_after_every_round():
    """(No grace period: one would keep facts served within it over the budget.)"""
    facts = _population()
    budget = float(facts.sum()) * 1e6 * 0.2
    result = simulate(facts, 1e6, Policy(budget_bytes=budget, grace_s=0.0, encode_rate=50.0),
                      rate=2.0, zipf_a=1.1, hours=1.0, ttft=TTFT, k=K)
    assert result["evicted_facts"] > 0 and 0 < result["injected_share"] < 1
    assert result["injected_share"] <= result["some_kv_share"] <= 1
    assert all(p["durable_bytes"] <= budget for p in result["timeline"])
    assert result["kinds"]["text"] + result["kinds"]["partial"] > 0
    assert TTFT["host"] <= result["ttft_p50_s"] <= result["ttft_p99_s"] <= TTFT["cold"]


def test_a_user_budget_keeps_each_user_to_it_and_answers_partly_as_kv():
    facts = np.full(50, 30)
    result = simulate(facts, 1e6, Policy(budget_bytes=1e12, grace_s=0.0, encode_rate=5.0,
                                         user_budget_bytes=8e6), rate=1.0, zipf_a=1.1,
                      hours=0.5, ttft=TTFT, k=K)
    assert result["evicted_facts"] >= 50 * (30 - 8)  # each user down to 8 facts' KV
    assert result["kinds"]["partial"] > result["kinds"]["host"] + result["kinds"]["disk"]
    assert all(p["durable_bytes"] <= 50 * 8e6 + 5.0 * 30 * 1e6 for p in result["timeline"]
               if p["hour"] > 0.05)  # within the budgets, plus what was encoded since a round


def test_new_facts_are_encoded_and_counted():
    facts = _population(users=20)
    result = simulate(facts, 1e6, Policy(budget_bytes=1e15, encode_rate=10.0), rate=1.0,
                      zipf_a=1.1, hours=0.25, ttft=TTFT, k=K, new_fact_rate=0.5)
    assert result["new_facts"] > 300 and result["reencode_queue_at_end"] < 10
    assert result["encoded_facts_per_hour"] >= (result["new_facts"] - 10) / 0.25
    assert result["reencoded_facts_per_hour"] == 0  # nothing was evicted: no re-encode


@pytest.mark.parametrize("kv_format", ["int8", "int4", "int2"])
def test_fact_bytes_follow_the_format(kv_format):
    shape = (4, 2, 64)
    raw, coded = blob_bytes(shape, 44, "raw"), blob_bytes(shape, 44, kv_format)
    assert coded < raw * {"int8": 0.6, "int4": 0.35, "int2": 0.2}[kv_format]
    both = fact_bytes(shape, [40, 44, 48], kv_format, kv_format)
    assert both == pytest.approx(2 * coded, rel=0.01)
    assert fact_bytes(shape, [44], kv_format, None) == coded
    assert fact_bytes(shape, [44], kv_format, kv_format, 0.25) == pytest.approx(1.25 * coded)


def test_the_lead_share_counts_small_memories_whole():
    small, large = Settings(window=10, lead_share=0.25), Settings(window=10, lead_share=0.0)
    assert lead_share_of([4, 6], small) == 1.0  # every fact of a memory under the window
    assert lead_share_of([110], small) == pytest.approx((10 + 25) / 110)
    assert lead_share_of([110], large) == pytest.approx(10 / 110)
