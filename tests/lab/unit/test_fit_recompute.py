"""Fitting recompute auto's policy from answers (pure logic over records)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.lab.evaluate import configs
from inferscale.lab.fit_recompute import (
    GRID,
    Attempt,
    Question,
    choose,
    fit,
    frontier,
    margin,
    policies,
    questions_from,
    replay,
    text_share_curve,
)
from inferscale.serving.calibration import RecomputePolicy


def _q(injected, tail, text_first=1, k=20, ttfts=(0.1, 0.2, 0.5)):
    """A question: injected / tail are (first token, margin)."""
    return Question(k, Attempt(text_first, 3.0, ttfts[2]), Attempt(*injected, ttfts[0]),
                    {2: Attempt(*tail, ttfts[1])})


def test_margin_is_the_top_two_gap():
    assert margin({"5": -0.1, "7": -0.6, "9": -3.0}) == pytest.approx(0.5)
    assert margin({"5": -0.1}) == math.inf
    assert margin({}) == 0.0


def test_replay_follows_the_three_attempts():
    qs = [_q((1, 2.0), (1, 2.0)),  # sure and right: kept
          _q((2, 0.2), (1, 1.0)),  # unsure, the tail is sure and right: recomputed
          _q((2, 0.2), (2, 0.05))]  # unsure, the tail a tie: text, right by construction
    r = replay(qs, RecomputePolicy(margin=0.5, text_margin=0.125, tail=2))
    assert (r.first_token, r.recomputed_share, r.text_share) == (1.0, pytest.approx(1 / 3),
                                                                 pytest.approx(1 / 3))
    assert r.ttft_mean_s == pytest.approx((0.1 + 0.3 + 0.8) / 3)
    kept_all = replay(qs, RecomputePolicy(margin=0.0, text_margin=0.0, tail=2))
    assert kept_all.first_token == pytest.approx(1 / 3) and kept_all.text_share == 0


def test_a_hopeless_first_margin_skips_the_tail_and_pays_two_attempts():
    qs = [_q((2, 0.05), (2, 0.05)),  # hopeless: text at once
          _q((2, 0.3), (1, 1.0))]  # unsure, not hopeless: the tail answers
    r = replay(qs, RecomputePolicy(margin=0.5, text_margin=0.125, tail=2, direct_margin=0.1))
    assert (r.text_share, r.recomputed_share, r.first_token) == (0.5, 0.5, 1.0)
    assert r.ttft_mean_s == pytest.approx(((0.1 + 0.5) + (0.1 + 0.2)) / 2)
    three = replay(qs, RecomputePolicy(margin=0.5, text_margin=0.125, tail=2))
    assert three.ttft_mean_s == pytest.approx(((0.1 + 0.2 + 0.5) + (0.1 + 0.2)) / 2)
    assert r.ttft_over_text_p95 < three.ttft_over_text_p95


def test_agreement_of_the_requests_served_as_kv_leaves_out_those_answered_as_text():
    qs = [_q((1, 2.0), (1, 2.0))] * 6 + [_q((2, 2.0), (2, 2.0))] * 2 + [_q((2, 0.1), (2, 0.0))] * 2
    r = replay(qs, RecomputePolicy(margin=0.5, text_margin=0.125, tail=2))
    assert r.first_token == pytest.approx(0.8) and r.text_share == pytest.approx(0.2)
    assert r.first_token_kv == pytest.approx(6 / 8)  # the text answers agree by construction
    everything_as_text = replay(qs, RecomputePolicy(margin=1000.0, text_margin=1000.0,
                                                    tail=2, direct_margin=1000.0))
    assert everything_as_text.first_token == 1.0 and everything_as_text.first_token_kv is None


def test_a_bound_on_the_text_share_keeps_agreement_from_being_bought_with_text():
    qs = [_q((1, 3.0), (1, 3.0))] * 70 + [_q((2, 0.3), (2, 0.0))] * 30  # only text saves these
    free = fit(qs, target=0.95, max_answered_again=1.0)
    assert free["target"]["reached"] and free["reached"]["text_share"] == pytest.approx(0.3)
    bounded = fit(qs, target=0.95, max_answered_again=1.0, max_text_share=0.2)
    assert not bounded["target"]["reached"]
    assert bounded["reached"]["text_share"] <= 0.2
    curve = bounded["text_share_curve"]
    assert [c["max_text_share"] for c in curve] == sorted(c["max_text_share"] for c in curve)
    assert all(c["text_share"] <= c["max_text_share"] for c in curve)
    agreement = [c["first_token"] for c in curve]
    assert agreement == sorted(agreement) and agreement[-1] == 1.0
    with pytest.raises(ValueError, match="as text"):
        choose([replay(qs, RecomputePolicy(margin=1000.0, text_margin=1000.0, tail=2))],
               0.95, 1.0, max_text_share=0.1)
    assert text_share_curve([]) == []


def test_the_fit_takes_the_cheapest_policy_that_reaches_the_target():
    qs = [_q((1, 3.0), (1, 3.0))] * 80 + [_q((2, 0.3), (1, 2.0))] * 20
    result = fit(qs, target=0.95, max_answered_again=0.5)
    assert result["target"]["reached"]
    policy = result["policy"]
    assert 0.3 < policy.margin <= 3.0  # the unsure ones recomputed, the sure ones kept
    assert result["reached"]["first_token"] == 1.0
    assert result["reached"]["recomputed_share"] == pytest.approx(0.2)
    assert 0.95 <= result["reached"]["first_token_ci95"][0] < 1.0


def test_the_target_must_hold_with_confidence_not_just_on_this_sample():
    """97 of 100 right with nothing recomputed is 97% here, but [91.5%, 99.0%]: not enough
    evidence of 95%, so the fit pays for recomputing the unsure ones."""
    qs = ([_q((1, 3.0), (1, 3.0))] * 90 + [_q((1, 0.3), (1, 2.0))] * 7
          + [_q((2, 0.3), (1, 2.0))] * 3)
    result = fit(qs, target=0.95, max_answered_again=0.5)
    assert result["policy"].margin > 0.3 and result["reached"]["first_token"] == 1.0


def test_short_of_the_target_the_fit_says_so_and_keeps_the_most_faithful():
    qs = [_q((2, 1.0), (2, 1.0))] * 50 + [_q((1, 1.0), (1, 1.0))] * 50  # half wrong, alike
    everything_as_text = fit(qs, target=0.95, max_answered_again=1.0)
    assert everything_as_text["target"]["reached"]
    assert everything_as_text["reached"]["text_share"] == 1.0
    bounded = fit(qs, target=0.95, max_answered_again=0.4)  # may answer again none of them
    assert not bounded["target"]["reached"]
    assert bounded["reached"]["first_token"] == 0.5
    assert bounded["reached"]["recomputed_share"] + bounded["reached"]["text_share"] == 0
    with pytest.raises(ValueError, match="no question"):
        fit([], 0.95, 1.0)


ATTEMPT = st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0, 2.0,
                                                        math.inf]))
QUESTIONS = st.lists(st.builds(_q, ATTEMPT, ATTEMPT, st.integers(0, 3)), min_size=1,
                     max_size=30)


@settings(max_examples=60, deadline=None)
@given(QUESTIONS, st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_the_choice_is_feasible_and_none_cheaper_is(qs, target, bound):
    replays = [replay(qs, p) for p in policies([2], GRID[::4])]
    chosen, reached = choose(replays, target, bound)
    assert chosen.recomputed_share + chosen.text_share <= bound
    feasible = [r for r in replays if r.recomputed_share + r.text_share <= bound
                and r.lower_bound >= target]
    assert reached == bool(feasible)
    if reached:
        assert chosen.lower_bound >= target
        assert all(r.ttft_mean_s >= chosen.ttft_mean_s for r in feasible)
    else:
        assert all(r.first_token <= chosen.first_token for r in replays
                   if r.recomputed_share + r.text_share <= bound)
    best = frontier(replays)
    assert [r.first_token for r in best] == sorted({r.first_token for r in best})
    assert all(not (r.first_token > b.first_token and r.ttft_mean_s < b.ttft_mean_s)
               for b in best for r in replays)


def test_questions_are_read_back_from_an_eval_report():
    encodings = [("neighbours", 10)]
    plan = configs([20], encodings, [0, 2])
    names = {c.mode + str(c.recompute): c.name for c in plan}
    record = {"sample_id": "s", "question": "q?", "ttft_s": 0.1}
    report = {"ks": [20], "windows": [10], "contexts": ["neighbours"], "recomputes": [0, 2],
              "order": "relevance", "leads": [True], "key_scales": [None], "records": [
                  {**record, "config": names["text0"], "token_ids": [5], "first_top": {"5": -0.1}},
                  {**record, "config": names["inject0"], "token_ids": [6],
                   "first_top": {"6": -0.5, "5": -0.7}},
                  {**record, "config": names["inject2"], "token_ids": [5],
                   "first_top": {"5": -0.1, "6": -2.1}},
                  {**record, "config": "none", "token_ids": [9], "first_top": {}}]}
    [q] = questions_from(report)
    assert (q.k, q.text.first, q.injected.first, q.injected.margin) == (20, 5, 6,
                                                                        pytest.approx(0.2))
    assert q.tails[2].first == 5 and q.tails[2].margin == pytest.approx(2.0)
