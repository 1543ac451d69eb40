"""Turn event contract: validation reasons for the dead-letter topic (pure logic)."""

import json

import pytest

from inferscale.events import InvalidEvent, TurnEvent, parse_turn

GOOD = {"version": 1, "user_id": "u1", "conversation_id": "c1", "turn_id": "t1",
        "speaker": "Ann", "text": "I like tea.", "timestamp": "2025-01-02T03:04:05Z"}


def test_valid_event_round_trips():
    event = parse_turn(json.dumps(GOOD).encode(), 16384)
    assert event == TurnEvent.model_validate(GOOD)
    assert parse_turn(event.to_bytes(), 16384) == event
    assert event.timestamp.utcoffset().total_seconds() == 0


def test_naive_timestamp_is_utc():
    event = parse_turn(json.dumps({**GOOD, "timestamp": "2025-01-02T03:04:05"}).encode(), 100)
    assert event.timestamp.tzinfo is not None


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "invalid json"),
        (b"\xff\xfe", "invalid json"),
        (b"[1, 2]", "not a json object"),
        (json.dumps({**GOOD, "version": 2}).encode(), "unknown version: 2"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "version"}).encode(),
         "unknown version: None"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "user_id"}).encode(), "user_id"),
        (json.dumps({**GOOD, "text": "x" * 101}).encode(), "text too large"),
        (json.dumps({**GOOD, "timestamp": "yesterday"}).encode(), "timestamp"),
        (json.dumps({**GOOD, "speaker": 7}).encode(), "speaker"),
        (json.dumps({**GOOD, "user_id": "a\x00b"}).encode(), "NUL"),
        (None, "empty message"),
    ],
)
def test_invalid_events_have_reasons(raw, reason):
    with pytest.raises(InvalidEvent) as info:
        parse_turn(raw, 100)
    assert reason in info.value.reason
