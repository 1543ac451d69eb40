"""Fact extractors: turn a stored turn into memory facts (pluggable by name)."""

from __future__ import annotations

from collections.abc import Callable

from inferscale.events import TurnEvent

Extractor = Callable[[TurnEvent], list[str]]


def turn_fact(turn: TurnEvent) -> list[str]:
    """Default extractor: one fact per non-empty turn, "<date> <speaker>: <text>"."""
    text = " ".join(turn.text.split())
    if not text:
        return []
    return [f"{turn.timestamp.strftime('%-d %B %Y')} {turn.speaker}: {text}"]


EXTRACTORS: dict[str, Extractor] = {"turn": turn_fact}


def get_extractor(name: str) -> Extractor:
    """The extractor registered under ``name``."""
    try:
        return EXTRACTORS[name]
    except KeyError:
        raise ValueError(f"unknown extractor {name!r}; known: {sorted(EXTRACTORS)}") from None
