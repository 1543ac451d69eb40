"""Fact extraction: turns (with the turns before them) -> short memory facts.

Two extractors share one batched protocol: ``turn`` keeps each turn as one fact; ``llm`` asks a
language model for the turn's facts as JSON (grammar-constrained, see
``inferscale.pipeline.generators``).
Every fact starts with its turn's date, so temporal questions keep their anchor. An LLM answer
that cannot be used falls back to the turn itself: extraction never loses a turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from inferscale.pipeline.generators import JsonGenerator

MAX_FACT_CHARS = 300
# What the model reads of a turn and of each context turn (a turn may hold 16 KiB): the
# prompt stays within a small model's context; the turn itself is stored whole.
MAX_TURN_CHARS = 4000
MAX_CONTEXT_CHARS = 500


@dataclass(frozen=True)
class TurnInContext:
    """A turn to extract facts from, with the ``context`` turns before it (oldest first)."""

    speaker: str
    text: str
    ts: datetime
    context: Sequence[str] = ()


@dataclass(frozen=True)
class Draft:
    """A fact drafted from a turn, and which extractor wrote it."""

    text: str
    extractor: str


class Extractor(Protocol):
    """Blocking and batched: one list of drafts per turn, in order."""

    name: str

    def extract(self, turns: Sequence[TurnInContext]) -> list[list[Draft]]: ...


def day(ts: datetime) -> str:
    return ts.strftime("%-d %B %Y")


def turn_fact(speaker: str, text: str, ts: datetime) -> str | None:
    """A turn as one fact, "<date> <speaker>: <text>" (None for an empty turn)."""
    text = " ".join(text.split())
    return f"{day(ts)} {speaker}: {text}" if text else None


class TurnExtractor:
    """One fact per non-empty turn (the default: no model, nothing lost)."""

    name = "turn"

    def extract(self, turns: Sequence[TurnInContext]) -> list[list[Draft]]:
        return [[Draft(f, self.name)] if (f := turn_fact(t.speaker, t.text, t.ts)) else []
                for t in turns]


FACTS_SCHEMA = {
    "type": "object",
    "properties": {"facts": {"type": "array", "maxItems": 5,
                             "items": {"type": "string", "minLength": 3, "maxLength": 200}}},
    "required": ["facts"],
    "additionalProperties": False,
}
EXTRACT_SYSTEM = (
    "You keep a personal assistant's memory. From the new message, list the facts worth "
    "remembering about the people in it: short, self-contained sentences in the third person "
    "that name the person. Use the earlier messages only to resolve who and what is meant. "
    'Small talk has no facts: answer an empty list. Answer JSON: {"facts": [...]}.'
)


def extract_prompt(turn: TurnInContext) -> list[dict[str, str]]:
    """Chat messages asking for one turn's facts."""
    earlier = "\n".join(c[:MAX_CONTEXT_CHARS] for c in turn.context) or "(none)"
    return [{"role": "system", "content": EXTRACT_SYSTEM},
            {"role": "user", "content": f"Earlier messages:\n{earlier}\n\nNew message "
                                        f"({day(turn.ts)}):\n{turn.speaker}: "
                                        f"{turn.text[:MAX_TURN_CHARS]}"}]


class LLMExtractor:
    """Facts from a language model, one batched generation per call."""

    name = "llm"

    def __init__(self, generator: JsonGenerator, max_tokens: int = 192):
        self.generator = generator
        self.max_tokens = max_tokens
        self.fallbacks = 0  # turns kept whole because the model's answer was unusable

    def extract(self, turns: Sequence[TurnInContext]) -> list[list[Draft]]:
        if not turns:
            return []
        answers = self.generator.generate([extract_prompt(t) for t in turns], FACTS_SCHEMA,
                                          self.max_tokens)
        out = []
        for turn, answer in zip(turns, answers, strict=True):
            facts = _clean_facts(answer["facts"]) if answer is not None else None
            if facts is None:
                self.fallbacks += 1
                out += TurnExtractor().extract([turn])
            else:
                out.append([Draft(f"{day(turn.ts)} {f}", self.name) for f in facts])
        return out


def _clean_facts(facts: list[str]) -> list[str]:
    """Whitespace-normalised, non-empty, capped, without repeats (order kept)."""
    cleaned = (" ".join(f.split())[:MAX_FACT_CHARS] for f in facts)
    return list(dict.fromkeys(f for f in cleaned if f))


def get_extractor(name: str, generator: JsonGenerator | None = None) -> Extractor:
    """The extractor called ``name`` (``llm`` needs a generator)."""
    if name == "turn":
        return TurnExtractor()
    if name == "llm":
        if generator is None:
            raise ValueError("the llm extractor needs a JSON generator")
        return LLMExtractor(generator)
    raise ValueError(f"unknown extractor {name!r}; known: ['llm', 'turn']")
