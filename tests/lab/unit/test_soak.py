"""The soak's pure parts: answer kinds from headers, the end-of-run checks, the budget bound,
counters across restarts, intervals, and the population."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from conftest import SAMPLE
from inferscale.lab.bench.soak_checks import (
    BudgetSample,
    budget_excess,
    foreign_answers,
    kv_state,
    stale_answers,
    turn_check,
)
from inferscale.lab.bench.soak_load import Answer, Edit, answer_kind
from inferscale.lab.bench.soak_population import build, zipf_weights
from inferscale.lab.bench.soak_timeline import Accumulator, median_ci, ttft_ratio, wilson


@pytest.mark.parametrize(("mode", "headers", "kind"), [
    ("text", {"x-inferscale-facts": "5"}, "text-prefill"),
    ("inject", {"x-inferscale-recompute-auto": "text"}, "text-auto"),
    ("inject", {"x-inferscale-recompute-auto": "recomputed", "x-inferscale-facts": "5",
                "x-inferscale-facts-injected": "5"}, "recomputed"),
    ("inject", {"x-inferscale-facts": "0", "x-inferscale-facts-injected": "0"}, "no-memory"),
    ("inject", {"x-inferscale-facts": "5", "x-inferscale-facts-injected": "0"}, "text-fallback"),
    ("inject", {"x-inferscale-facts": "5", "x-inferscale-facts-injected": "3"}, "partial"),
    ("inject", {"x-inferscale-recompute-auto": "kept", "x-inferscale-facts": "5",
                "x-inferscale-facts-injected": "5"}, "injected"),
])
def test_answer_kind_reads_the_headers(mode, headers, kind):
    assert answer_kind(mode, headers) == kind


def _answer(user: str, started: float, ids: tuple[int, ...], kind: str = "injected",
            ttft: float | None = 0.1, pair: str | None = None) -> Answer:
    return Answer(user, started, ttft, kind, ids, None, pair)


def test_turns_lost_and_duplicated_are_counted_per_published_turn():
    published = [("u", "t0"), ("u", "t1"), ("v", "t0")]
    stored = Counter({("u", "t0"): 1, ("u", "t1"): 1, ("w", "t9"): 1})
    facts = Counter({("u", "t0"): 2, ("u", "t1"): 1})
    assert turn_check(published, stored, facts) == {
        "published": 3, "lost": 1, "duplicated": 0, "facts_lost": 1, "facts_duplicated": 1,
        "stored_not_published": 1}


def test_an_answer_is_stale_only_if_it_started_after_the_retirement_was_answered():
    edits = [Edit("u", "edit", 7, 9, done=100.0), Edit("u", "delete", 8, None, done=200.0)]
    answers = [_answer("u", 99.0, (7, 8)), _answer("u", 101.0, (9, 8)),
               _answer("u", 150.0, (7,)), _answer("u", 201.0, (8,))]
    stale = stale_answers(answers, edits)
    assert [(s["started"], s["fact_id"], s["op"]) for s in stale] == [(150.0, 7, "edit"),
                                                                      (201.0, 8, "delete")]


def test_a_fact_of_another_owner_or_of_no_row_is_foreign():
    owners = {1: "u", 2: "v"}
    answers = [_answer("u", 1.0, (1,)), _answer("u", 2.0, (1, 2)), _answer("v", 3.0, (3,))]
    assert [(f["user"], f["fact_id"], f["owner"]) for f in foreign_answers(answers, owners)] \
        == [("u", 2, "v"), ("v", 3, None)]


def test_the_budget_bound_is_the_larger_of_budget_and_grace_plus_recent_encodes():
    sample = BudgetSample(0.0, held={"u": 60, "v": 50}, in_grace={"u": 30}, recent={"v": 10})
    assert budget_excess(sample, 100, None) == (0, 0)  # 110 <= max(100, 30) + 10
    assert budget_excess(sample, 90, None) == (10, 0)
    # per user: u 60 - max(40, 30) - 0 = 20; v 50 - 40 - 10 = 0
    assert budget_excess(sample, None, 40) == (0, 20)
    in_grace = BudgetSample(0.0, held={"u": 60}, in_grace={"u": 60}, recent={})
    assert budget_excess(in_grace, 10, 10) == (0, 0)


class _Row:
    def __init__(self, location=None, evicted=False, error=None, attempts=0):
        self.kv_location, self.evicted = location, evicted
        self.encode_error, self.encode_attempts = error, attempts


def test_kv_states_separate_the_re_encodable_from_the_lost():
    assert kv_state(_Row("x"), True, 5) == "present"
    assert kv_state(_Row("x"), False, 5) == "broken"
    assert kv_state(_Row(evicted=True), None, 5) == "evicted"
    assert kv_state(_Row(), None, 5) == "pending"
    assert kv_state(_Row(error="quarantined: worker died 3 times"), None, 5) == "quarantined"
    assert kv_state(_Row(error="RuntimeError: boom", attempts=5), None, 5) == "failed"
    assert kv_state(_Row(error="RuntimeError: boom", attempts=2), None, 5) == "pending"
    assert kv_state(_Row(error="storage: ENOSPC", attempts=9), None, 5) == "pending"


def test_counters_are_summed_over_restarts():
    acc = Accumulator()
    acc.update({"n": 5})
    acc.update({"n": 8})
    assert acc.update({"n": 2}) == {"n": 10}  # restarted from zero, counted 2 since


def test_ttft_ratio_uses_complete_pairs_only():
    answers = [_answer("u", 0, (), "injected", 0.1, "a"), _answer("u", 0, (), "text-prefill",
                                                                  0.4, "a"),
               _answer("u", 0, (), "injected", 0.2, "b"),
               _answer("u", 0, (), "injected", 0.3, None)]
    assert ttft_ratio(answers) == (pytest.approx(4.0), 1)


def test_intervals_contain_their_estimate():
    values = [float(v) for v in range(100)]
    low, high = median_ci(values)
    assert low < 49.5 < high
    assert median_ci(values[:5]) is None
    low, high = wilson(30, 100)
    assert low < 0.3 < high
    assert wilson(0, 0) is None


def test_population_users_hold_distinct_memories_with_zipf_activity():
    weights = zipf_weights(50, 1.1, random.Random(0))
    assert sum(weights) == pytest.approx(1.0)
    assert max(weights) / min(weights) == pytest.approx(50 ** 1.1)
    population = build(SAMPLE, "soak-test", 4, seed=1)
    first = [u.take(3) for u in population.users]
    assert [t.turn_id for t in first[0]] == ["t0", "t1", "t2"]
    assert population.users[0].take(1)[0].turn_id == "t3"
    assert all(t.user_id == u.id == t.conversation_id
               for u, turns in zip(population.users, first, strict=True) for t in turns)
    assert len({tuple(t.text for t in turns) for turns in first}) == len(first)


def test_results_record_only_the_settings_that_differ_from_the_defaults(tmp_path):
    from inferscale.core.settings import Settings
    from inferscale.lab.bench.common import settings_differing

    settings = Settings(kv_budget_bytes=5, kv_evict_grace_s=30, data_dir=tmp_path,
                        server_port=9, plan_secret="s")
    assert settings_differing(settings) == {"kv_budget_bytes": 5, "kv_evict_grace_s": 30.0}


def test_the_cost_model_runs_with_the_live_parameters_or_says_why_not():
    from inferscale.core.settings import Settings
    from inferscale.lab.bench.soak import SoakConfig, _model_comparison

    live = {"facts_per_user": [6, 9, 12], "bytes_per_fact": 5e5, "question_rate": 0.5,
            "encoded_per_s": 0.7, "hit_rate_all_injected": 0.1, "hit_rate_any_injected": 0.7,
            "reencoded_facts_per_hour": 100.0, "ttft_p50_s": 0.3, "ttft_p99_s": 2.0,
            "ttft_injected_p50_s": 0.2, "ttft_text_fallback_p50_s": None,
            "ttft_text_prefill_p50_s": 0.4}
    config = SoakConfig(minutes=5, budget_mb=3)
    compared = _model_comparison(Settings(), config, live)
    model = compared["model"]
    assert 0 <= model["injected_share"] <= model["some_kv_share"] <= 1
    assert compared["ttft_s_used"]["cold"] == 0.4 and model["new_facts"] > 0
    assert compared["measured"]["hit_rate_any_injected"] == 0.7
    assert "skipped" in _model_comparison(Settings(), config, {**live, "ttft_injected_p50_s": None})
