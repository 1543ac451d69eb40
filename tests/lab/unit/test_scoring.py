"""LoCoMo scoring (pure logic)."""

import pytest

from inferscale.lab.scoring import exact_match, locomo_f1, normalize_answer


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
