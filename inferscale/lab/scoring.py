"""LoCoMo answer scoring: normalized token F1 (Porter-stemmed, as the benchmark defines it)."""

from __future__ import annotations

import re
import string
from collections import Counter

from nltk.stem import PorterStemmer

_stemmer = PorterStemmer()
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace."""
    text = str(text).replace(",", "").lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(prediction: str, truth: str) -> float:
    pred = [_stemmer.stem(w) for w in normalize_answer(prediction).split()]
    gold = [_stemmer.stem(w) for w in normalize_answer(truth).split()]
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def locomo_f1(prediction: str, answer: str, category: int) -> float:
    """Category 1 (multi-hop) scores each comma-separated gold part against its best part of
    the prediction; category 3 uses the first ';'-separated gold answer; else plain F1."""
    answer = str(answer)
    if category == 3:
        answer = answer.split(";")[0].strip()
    if category == 1:
        parts = [p for p in answer.split(",") if p.strip()]
        preds = [p for p in prediction.split(",") if p.strip()] or [prediction]
        return sum(max(_f1(p, g) for p in preds) for g in parts) / max(1, len(parts))
    return _f1(prediction, answer)


def exact_match(prediction: str, answer: str) -> bool:
    """Normalized prediction equals the normalized gold answer."""
    return normalize_answer(prediction) == normalize_answer(str(answer))
