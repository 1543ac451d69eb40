"""Conversation file readers: LoCoMo format and JSONL."""

import json
from datetime import UTC, datetime

from conftest import SAMPLE
from inferscale.pipeline.sources import read_turns


def test_locomo_sessions_in_order_with_session_times():
    turns = list(read_turns(SAMPLE))
    sample = json.loads(SAMPLE.read_text())[0]
    sessions = [v for k, v in sample["conversation"].items()
                if k.startswith("session_") and isinstance(v, list)]
    assert len(turns) == sum(len(s) for s in sessions)
    assert {t.user_id for t in turns} == {sample["sample_id"]}
    assert turns[0].turn_id == "D1:1"
    assert turns[0].timestamp == datetime(2025, 3, 3, 10, 15, tzinfo=UTC)
    assert all(a.timestamp < b.timestamp for a, b in zip(turns, turns[1:], strict=False))


def test_jsonl_round_trip(tmp_path):
    turns = list(read_turns(SAMPLE))[:3]
    path = tmp_path / "turns.jsonl"
    path.write_text("\n".join(t.model_dump_json() for t in turns) + "\n")
    assert list(read_turns(path)) == turns
