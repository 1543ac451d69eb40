"""LoCoMo scoring (pure logic)."""

import pytest

from inferscale.evaluate import summarize
from inferscale.scoring import exact_match, locomo_f1, normalize_answer


def test_normalization_and_exact_match():
    assert normalize_answer("The  Pickles, and a jar!") == "pickles jar"
    assert exact_match("the Pickles.", "Pickles")
    assert not exact_match("Pickles the octopus", "Pickles")


def test_f1_stems_and_handles_categories():
    assert locomo_f1("She paints sunrises", "painted sunrise", 4) == pytest.approx(0.8)
    assert locomo_f1("nothing relevant", "Lisbon", 4) == 0.0
    assert locomo_f1("psychology, counseling", "Psychology, counseling certification", 1) == (
        pytest.approx((1.0 + 2 / 3) / 2))
    assert locomo_f1("Lisbon", "Lisbon; Portugal", 3) == 1.0


def test_summary_reports_gap_and_first_token_agreement():
    base = {"question": "q", "answer": "Lisbon", "category": 1}
    records = [
        {**base, "mode": "text", "k": 5, "w": None, "prediction": "Lisbon", "f1": 1.0,
         "em": True},
        {**base, "mode": "inject", "k": 5, "w": 0, "prediction": "Porto", "f1": 0.0,
         "em": False},
        {**base, "mode": "none", "k": 0, "w": None, "prediction": "?", "f1": 0.0, "em": False},
    ]
    summary = summarize(records, [5], [0])
    assert summary["agreement"]["k=5 w=0"]["f1_gap_inject_minus_text"] == -1.0
    assert summary["agreement"]["k=5 w=0"]["first_token_agreement"] == 0.0
    assert summary["configs"]["text k=5"]["by_category"] == {1: 1.0}
