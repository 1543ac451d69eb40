"""Fidelity metrics and the eval's configuration plan (pure logic)."""

import argparse
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.core.settings import Settings
from inferscale.lab.evaluate import Config, configs, run, summarize
from inferscale.lab.fidelity import bootstrap_mean_ci, compare, same_prefix, top_kl


def _top(logits: dict[int, float], keep: int) -> dict[int, float]:
    """The ``keep`` most likely tokens of a softmax over ``logits``, as logprobs."""
    norm = math.log(sum(math.exp(v) for v in logits.values()))
    ranked = sorted(logits.items(), key=lambda kv: -kv[1])[:keep]
    return {t: v - norm for t, v in ranked}


def test_prefix_agreement_on_token_ids():
    assert same_prefix([1, 2, 3], [1, 2, 4], 2) and not same_prefix([1, 2, 3], [1, 2, 4], 3)
    assert same_prefix([5], [5], 4)  # both ended after one token
    assert not same_prefix([5], [5, 6], 4)


def test_kl_is_zero_for_equal_and_grows_as_q_moves_away():
    p = _top({1: 3.0, 2: 1.0, 3: 0.0, 4: -1.0}, 4)
    assert top_kl(p, p) == pytest.approx(0.0, abs=1e-12)
    near = _top({1: 2.8, 2: 1.1, 3: 0.0, 4: -1.0}, 4)
    far = _top({1: 0.0, 2: 3.0, 3: 0.0, 4: -1.0}, 4)
    assert 0 < top_kl(p, near) < top_kl(p, far)
    # Full distributions listed: the estimate is the exact KL.
    exact = sum(math.exp(p[t]) * (p[t] - far[t]) for t in p)
    assert top_kl(p, far) == pytest.approx(exact)


def test_kl_charges_mass_on_tokens_q_does_not_list():
    logits = {t: -t / 3 for t in range(40)}
    p = _top(logits, 20)
    shifted = _top({t: -abs(t - 30) / 3 for t in range(40)}, 20)  # q's top list misses p's
    assert top_kl(p, shifted) > 1.0
    with pytest.raises(ValueError):
        top_kl({}, p)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=40),
       st.lists(st.floats(-20, 20), min_size=2, max_size=40), st.integers(1, 20))
def test_kl_estimate_is_finite_and_non_negative(a, b, keep):
    p = _top(dict(enumerate(a)), keep)
    q = _top(dict(enumerate(b)), keep)
    kl = top_kl(p, q)
    assert math.isfinite(kl) and kl >= 0


def test_bootstrap_interval():
    assert bootstrap_mean_ci([0.5] * 30) == (pytest.approx(0.5), pytest.approx(0.5))
    values = [0.0] * 50 + [1.0] * 50
    low, high = bootstrap_mean_ci(values, seed=1)
    assert low < 0.5 < high and 0.05 < high - low < 0.4
    assert bootstrap_mean_ci(values, seed=1) == (low, high)
    assert all(math.isnan(x) for x in bootstrap_mean_ci([]))


def _answer(ids, f1, first):
    return {"token_ids": ids, "f1": f1, "first_top": first}


def test_compare_counts_agreement_and_gap():
    top = {7: -0.1, 8: -2.5}
    text = [_answer([7, 1, 2, 3, 4], 1.0, top), _answer([7, 9], 0.5, top),
            _answer([8], 0.0, {8: -0.2, 7: -1.8})]
    inject = [_answer([7, 1, 2, 3, 5], 1.0, top), _answer([7, 8], 0.0, top),
              _answer([7], 0.5, {7: -0.3, 8: -1.4})]
    got = compare(text, inject)
    assert got["first_token"] == pytest.approx(2 / 3)
    assert got["first_4"] == pytest.approx(1 / 3)
    assert got["whole_answer"] == 0
    assert got["f1_gap"] == pytest.approx(0.0)
    assert got["first_token_kl"] > 0
    with pytest.raises(ValueError):
        compare(text, inject[:2])


def test_plan_and_summary():
    plan = configs([5, 20], [("turns", 5)], [0, 3, 10])
    names = [c.name for c in plan]
    assert names[0] == "none" and "inject k=5 w=5 m=10" not in names
    # m above k prefills all k facts: measured once, as m = k.
    assert [n for n in names if n.startswith("inject k=5 ")] == [
        "inject k=5 w=5 m=0", "inject k=5 w=5 m=3", "inject k=5 w=5 m=5"]
    assert [c.name for c in configs([1], [("turns", 5)], [2, 3])][2:] == ["inject k=1 w=5 m=1"]
    assert names.index("text k=20 (user w=5)") < names.index("inject k=20 w=5 m=3")
    both = configs([20], [("turns", 5), ("neighbours", 5)], [0])
    assert [(c.name, c.encoding) for c in both[1:]] == [
        ("text k=20 (user w=5)", ("turns", 5)), ("inject k=20 w=5 m=0", ("turns", 5)),
        ("text k=20 (user w=5 neighbours)", ("neighbours", 5)),
        ("inject k=20 w=5 neighbours m=0", ("neighbours", 5))]
    assert both[4].reference() == both[3]
    oracle = [c.name for c in configs([0, 20], [("turns", 5)], [0], oracle=True)]
    assert oracle == ["none", "text k=0 (user w=5)", "inject k=0 w=5 m=0", "text k=20 (user w=5)",
                      "inject k=20 w=oracle m=0", "inject k=20 w=5 m=0"]
    plan = configs([5], [("turns", 5)], [0])
    records = []
    for config, ids, ttft in ((plan[0], [3], 0.1), (plan[1], [7, 1], 2.0), (plan[2], [7, 2], 0.5)):
        records.append({"config": config.name, "f1": 0.5, "em": False, "token_ids": ids,
                        "first_top": {7: -0.1}, "ttft_s": ttft, "fact_ids": "4,2"})
    summary = summarize(records, plan)
    inject = summary[Config("inject", 5, 5, 0).name]
    assert inject["vs_text"]["first_token"] == 1 and inject["vs_text"]["whole_answer"] == 0
    assert inject["ttft_ratio_text_over_this"] == pytest.approx(4.0)
    assert inject["ttft_ratio_text_over_this_ci95"] == pytest.approx([4.0, 4.0])
    assert inject["same_facts"] == 1 and "ttft_ratio_this_over_hit" not in inject


def test_prefix_hit_is_planned_after_its_text_and_divides_inject():
    plan = configs([0, 5], [("turns", 5)], [0], prefix_hit=True)
    assert [c.name for c in plan] == ["none", "text k=0 (user w=5)", "inject k=0 w=5 m=0",
                                      "text k=5 (user w=5)", "prefix hit k=5 (user w=5)",
                                      "inject k=5 w=5 m=0"]
    hit, inject = plan[4], plan[5]
    assert hit.reference() == plan[3] and inject.prefix_hit() == hit
    records = []
    for q in range(4):  # text 1.0 s, hit 0.1 s, inject 0.2 s; the hit flips question 0
        for config, ttft, ids in ((plan[3], 1.0, [7]), (hit, 0.1, [8] if q == 0 else [7]),
                                  (inject, 0.2, [7])):
            records.append({"config": config.name, "f1": 0.5, "em": False, "token_ids": ids,
                            "first_top": {7: -0.1}, "ttft_s": ttft + q / 100, "fact_ids": "1"})
    summary = summarize(records, plan[3:])
    assert summary[hit.name]["vs_text"]["first_token"] == pytest.approx(0.75)
    got = summary[inject.name]
    assert got["ttft_ratio_this_over_hit"] == pytest.approx(0.215 / 0.115)
    low, high = got["ttft_ratio_this_over_hit_ci95"]
    assert low <= got["ttft_ratio_this_over_hit"] <= high and high < 2.1
    assert got["vs_exact"]["exact_paths_differ"] == pytest.approx(0.25)


def test_exact_path_agreement_counts_either_exact_answer():
    from inferscale.lab.fidelity import exact_path_agreement

    def answers(*firsts: int) -> list[dict]:
        return [{"token_ids": [f, 1]} for f in firsts]

    text, hit = answers(1, 2, 3, 4), answers(1, 5, 3, 6)
    got = exact_path_agreement(text, hit, answers(1, 5, 7, 4))  # text, hit, neither, text
    assert got["first_token_either"] == pytest.approx(0.75)
    assert got["exact_paths_differ"] == pytest.approx(0.5)
    low, high = got["first_token_either_ci95"]
    assert low < 0.75 < high
    with pytest.raises(ValueError):
        exact_path_agreement(text, hit[:3], answers(1, 2, 3, 4))


def test_median_ratio_interval_refuses_unpaired_timings():
    from inferscale.lab.fidelity import bootstrap_median_ratio_ci

    with pytest.raises(ValueError):
        bootstrap_median_ratio_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        bootstrap_median_ratio_ci([], [])


@pytest.mark.parametrize("conversations", [(), (2,), (-1,), (0, 0)])
def test_eval_refuses_conversations_the_file_does_not_have(tmp_path, conversations):
    data = tmp_path / "two.json"
    data.write_text(json.dumps([{"sample_id": "a", "qa": []}, {"sample_id": "b", "qa": []}]))
    with pytest.raises(ValueError, match="distinct indices in \\[0, 2\\)"):
        run(Settings(), data, tmp_path / "out", conversations=conversations)
    assert not (tmp_path / "out").exists()  # refused before any infrastructure or output


@pytest.mark.parametrize("raw", ["half", "1.5", "-0.1", "nan", "inf"])
def test_eval_refuses_key_scale_strengths_outside_0_1(raw, capsys):
    from inferscale.cli import build_parser

    def parse(*values: str) -> argparse.Namespace:
        return build_parser().parse_args(["eval", "fidelity", "--data", "x.json",
                                          "--key-scales", *values])

    with pytest.raises(SystemExit) as refused:
        parse(raw)
    assert refused.value.code == 2 and "on, off or a number" in capsys.readouterr().err
    assert parse("on", "off", "0.5", "1").key_scales == [None, 0.0, 0.5, 1.0]
    assert [c.name for c in configs([20], [("turns", 5)], [0], key_scales=(None, 0.0, 0.5))][2:] \
        == ["inject k=20 w=5 m=0", "inject k=20 w=5 m=0 unscaled", "inject k=20 w=5 m=0 scales^0.5"]


def test_agreement_is_split_by_how_each_request_was_served():
    """An answer recompute auto sent to text agrees by construction: the figure for the KV is
    the one over the requests served with it, and the text share says how much was bought."""
    from inferscale.lab.fidelity import served_as_kv

    def answers(*pairs: tuple[int, float]) -> list[dict]:
        return [{"token_ids": [first, 1], "ttft_s": ttft} for first, ttft in pairs]

    text = answers((1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0))
    served = answers((1, 0.2), (9, 0.2), (3, 1.5), (4, 2.6))  # kept, kept (wrong), text, text
    got = served_as_kv(text, served, ["kept", "recomputed", "text", "text"])
    assert got["first_token"] == pytest.approx(0.75)
    assert (got["served_as_kv"], got["served_as_text"]) == (0.5, 0.5)
    assert got["first_token_kv"] == pytest.approx(0.5)
    assert got["first_token_kv_ci95"][0] < 0.5 < got["first_token_kv_ci95"][1]
    assert got["as_text_ttft_over_text_p50"] == pytest.approx(1.4)
    assert got["ttft_over_text_p95"] > 1.4 > got["ttft_over_text_p50"]
    hit = answers((1, 0.1), (9, 0.1), (3, 0.1), (4, 0.1))  # the hit's near-tie flips question 1
    either = served_as_kv(text, served, ["kept", "kept", "text", "text"], hit)
    assert either["first_token_kv_either"] == 1.0 and either["first_token_either"] == 1.0
    not_auto = served_as_kv(text, served, [None] * 4)  # a fixed m: every request is KV
    assert not_auto["served_as_text"] == 0 and not_auto["first_token_kv"] == 0.75
    all_text = served_as_kv(text, text, ["text"] * 4)
    assert all_text["first_token_kv"] is None and all_text["first_token"] == 1.0
    with pytest.raises(ValueError):
        served_as_kv(text, served[:3], ["kept"] * 3)
    with pytest.raises(ValueError):
        served_as_kv(text, served, ["kept"] * 4, hit[:2])
