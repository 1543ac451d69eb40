"""Readers that turn conversation files into turn events: JSONL of turns, or LoCoMo JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from inferscale.contracts.events import TurnEvent

_SESSION_KEY = re.compile(r"^session_(\d+)$")


def parse_locomo_datetime(value: str) -> datetime:
    """LoCoMo session times look like "1:56 pm on 8 May, 2023"."""
    return datetime.strptime(value.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC)


def locomo_turns(samples: list[dict]) -> Iterator[TurnEvent]:
    """Each sample is one user and one conversation; sessions in order, turns one second apart."""
    for sample in samples:
        user = str(sample["sample_id"])
        conversation = sample["conversation"]
        sessions = sorted(
            (int(m.group(1)), key) for key in conversation if (m := _SESSION_KEY.match(key))
        )
        for number, key in sessions:
            start = parse_locomo_datetime(conversation[f"session_{number}_date_time"])
            for index, turn in enumerate(conversation[key]):
                text = turn["text"]
                if caption := turn.get("blip_caption"):
                    text = f"{text} [shares a photo: {caption}]"
                yield TurnEvent(
                    user_id=user, conversation_id=user, turn_id=str(turn["dia_id"]),
                    speaker=turn["speaker"], text=text,
                    timestamp=start + timedelta(seconds=index),
                )


def read_turns(path: Path) -> Iterator[TurnEvent]:
    """Turns from a JSONL file (one turn event per line) or a LoCoMo-format JSON file."""
    with path.open() as f:
        head = f.read(1024).lstrip()
    if head.startswith("["):
        yield from locomo_turns(json.loads(path.read_text()))
        return
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield TurnEvent.model_validate_json(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not a turn event: {exc}") from None
