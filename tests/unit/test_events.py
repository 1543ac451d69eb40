"""Turn event contract: validation reasons for the dead-letter topic, and fuzzing of the parser
(pure logic: whatever arrives, a valid TurnEvent or InvalidEvent with a reason, nothing else)."""

import json
from datetime import UTC

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile import (
    json_values,
    mutated_events,
    record_keys,
    record_values,
    tried,
    valid_events,
)
from inferscale.contracts.events import InvalidEvent, TurnEvent, parse_record, parse_turn

GOOD = {"version": 1, "user_id": "u1", "conversation_id": "c1", "turn_id": "t1",
        "speaker": "Ann", "text": "I like tea.", "timestamp": "2025-01-02T03:04:05Z"}
MAX_TEXT_BYTES = 16384
FUZZ = settings(deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_valid_event_round_trips():
    event = parse_turn(json.dumps(GOOD).encode(), 16384)
    assert event == TurnEvent.model_validate(GOOD)
    assert parse_turn(event.to_bytes(), 16384) == event
    assert event.timestamp.utcoffset().total_seconds() == 0


def test_v2_events_carry_scopes_and_v1_events_keep_working():
    """v2 round-trips its scopes; a v1 record is read as before (scope fields it does not
    define are ignored); a producer's event is v1 unless it has a scope."""
    v2 = parse_turn(json.dumps({**GOOD, "version": 2, "agent_id": "coach", "run_id": "s1"})
                    .encode(), 100)
    assert (v2.version, v2.agent_id, v2.run_id) == (2, "coach", "s1")
    assert parse_turn(v2.to_bytes(), 100) == v2
    v1 = parse_turn(json.dumps({**GOOD, "agent_id": "coach"}).encode(), 100)
    assert (v1.version, v1.agent_id, v1.run_id) == (1, None, None)
    fields = {k: v for k, v in GOOD.items() if k != "version"}
    assert TurnEvent.model_validate(fields).version == 1
    assert b"agent_id" not in TurnEvent.model_validate(fields).to_bytes()
    scoped = TurnEvent.model_validate({**fields, "run_id": "s1"})
    assert (scoped.version, scoped.run_id) == (2, "s1")
    with pytest.raises(ValueError, match="version 2"):
        TurnEvent.model_validate({**GOOD, "agent_id": "coach"})


def test_v3_events_carry_metadata_and_older_versions_never_write_it():
    """v3 round-trips metadata; v1 and v2 records are read without it (not a field they
    define); a producer's event is v3 only when it has metadata, and an older version with
    metadata is refused rather than written without it."""
    v3 = parse_turn(_raw(version=3, metadata={"topic": "tea", "n": 2}, run_id="s1"), 100)
    assert (v3.version, v3.metadata, v3.run_id) == (3, {"topic": "tea", "n": 2}, "s1")
    assert parse_turn(v3.to_bytes(), 100) == v3
    for version in (1, 2):
        older = parse_turn(_raw(version=version, metadata={"topic": "tea"}), 100)
        assert older.metadata is None and b"metadata" not in older.to_bytes()
    fields = {k: v for k, v in GOOD.items() if k != "version"}
    assert TurnEvent.model_validate({**fields, "metadata": {"a": 1}}).version == 3
    assert TurnEvent.model_validate({**fields, "agent_id": "coach"}).version == 2
    for version in (1, 2):
        with pytest.raises(ValueError, match="version 3"):
            TurnEvent.model_validate({**fields, "version": version, "metadata": {"a": 1}})


def test_naive_timestamp_is_utc():
    event = parse_turn(json.dumps({**GOOD, "timestamp": "2025-01-02T03:04:05"}).encode(), 100)
    assert event.timestamp.tzinfo is not None


def _raw(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "invalid json"),
        (b"\xff\xfe", "invalid json"),
        (b"[1, 2]", "not a json object"),
        (_raw(version=4), "unknown version: 4"),
        (_raw(version=3, metadata={"": 1}), "metadata"),
        (_raw(version=3, metadata=[1]), "metadata"),
        (_raw(version=3, metadata={"k": "a\x00b"}), "metadata"),
        (_raw(version=3, metadata={"k": "x" * 5000}),
         "metadata"),
        (_raw(version=2, agent_id=""), "agent_id"),
        (_raw(version=2, run_id="r\x00"), "run_id contains NUL"),
        (_raw(version=2, agent_id="a" * 257), "agent_id"),
        (_raw(version=2, run_id=["r"]), "run_id"),
        (_raw(version=2, agent_id="\udfff"), "agent_id is not valid UTF-8"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "version"}).encode(),
         "unknown version: None"),
        (_raw(version=True), "unknown version: True"),
        (_raw(version=1.0), "unknown version: 1.0"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "user_id"}).encode(), "user_id"),
        (_raw(text="x" * 101), "text too large"),
        (_raw(timestamp="yesterday"), "timestamp"),
        (_raw(speaker=7), "speaker"),
        (_raw(user_id="a\x00b"), "NUL"),
        (_raw(user_id="a\tb"), "user_id"),  # no control characters in ids
        (_raw(user_id="esc\x1b[31m"), "user_id"),
        (_raw(version=2, agent_id="a\x7f"), "agent_id"),
        (None, "empty message"),
        # Named regressions: each of these used to crash the worker on every redelivery.
        (_raw().replace(b'"t1"', b"1" + b"0" * 4999), "invalid json: number too large"),
        (_raw().replace(b'"t1"', b"[" * 100_000 + b"]" * 100_000),
         "invalid json: nesting too deep"),
        (_raw().replace(b'"t1"', b'{"a":' * 100_000 + b"0" + b"}" * 100_000),
         "invalid json: nesting too deep"),
        (_raw(text="\ud800"), "invalid fields: text is not valid UTF-8 (lone surrogate)"),
        (_raw().replace(b"I like tea.", b"\xed\xa0\x80"),  # a surrogate as raw UTF-8-ish bytes
         "invalid fields: text is not valid UTF-8 (lone surrogate)"),
        (_raw(speaker="\udfff"), "invalid fields: speaker is not valid UTF-8 (lone surrogate)"),
        (_raw(timestamp="9999-12-31T23:59:59-01:00"), "timestamp out of range"),
        (_raw(timestamp="0001-01-01T00:00:00+01:00"), "timestamp out of range"),
        (_raw(version="\ud800" * 10_000), "unknown version: '\\ud800"),
    ],
)
def test_invalid_events_have_reasons(raw, reason):
    with pytest.raises(InvalidEvent) as info:
        parse_turn(raw, 100)
    assert reason in info.value.reason
    assert len(info.value.reason) < 200
    tried("event parser: named regressions")


@pytest.mark.parametrize(("key", "reason"), [
    (None, "missing key (must be the user_id)"),
    (b"u2", "key does not match user_id"),
    (b"U1", "key does not match user_id"),
    (b"\xff", "key does not match user_id"),
])
def test_record_key_must_be_the_user_id(key, reason):
    with pytest.raises(InvalidEvent) as info:
        parse_record(key, _raw(), 100)
    assert info.value.reason == reason
    assert parse_record(b"u1", _raw(), 100).user_id == "u1"
    tried("event parser: named regressions")


def check_parse(raw: bytes | None, key: bytes | None = b"", check_key: bool = False):
    """The fuzzing oracle: a valid, storable, round-tripping event or a short reason."""
    try:
        event = (parse_record(key, raw, MAX_TEXT_BYTES) if check_key
                 else parse_turn(raw, MAX_TEXT_BYTES))
    except InvalidEvent as exc:
        assert exc.reason and len(exc.reason) < 1024
        assert not exc.reason.startswith("unparseable"), exc.reason  # every case has a reason
        exc.reason.encode()  # the DLQ header can carry it
        return exc
    for name in ("user_id", "conversation_id", "turn_id", "speaker", "text"):
        assert "\x00" not in getattr(event, name)
        getattr(event, name).encode()  # no lone surrogate: Postgres can store it
    assert len(event.text.encode()) <= MAX_TEXT_BYTES
    assert event.timestamp.utcoffset().total_seconds() == 0
    assert parse_turn(event.to_bytes(), MAX_TEXT_BYTES) == event
    return event


@settings(FUZZ, max_examples=2000)
@given(st.binary(max_size=400))
def test_fuzz_arbitrary_bytes(raw):
    check_parse(raw)
    tried("event parser: arbitrary bytes")


@settings(FUZZ, max_examples=400)
@given(json_values, st.booleans())
def test_fuzz_arbitrary_json(value, ascii_only):
    check_parse(json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"))
    tried("event parser: arbitrary json")


@settings(FUZZ, max_examples=700)
@given(mutated_events(), record_keys)
def test_fuzz_mutated_events(raw, key):
    check_parse(raw, key, check_key=True)
    tried("event parser: mutated events")


@settings(FUZZ, max_examples=400)
@given(record_values, record_keys)
def test_fuzz_kafka_records(raw, key):
    check_parse(raw, key, check_key=True)
    tried("event parser: kafka records")


@settings(FUZZ, max_examples=300)
@given(valid_events())
def test_fuzz_valid_events_round_trip(fields):
    event = check_parse(json.dumps(fields).encode())
    assert isinstance(event, TurnEvent), event
    assert (event.user_id, event.conversation_id, event.turn_id, event.speaker, event.text) == (
        fields["user_id"], fields["conversation_id"], fields["turn_id"], fields["speaker"],
        fields["text"])
    assert event.timestamp.astimezone(UTC) == event.timestamp
    assert parse_record(event.user_id.encode(), event.to_bytes(), MAX_TEXT_BYTES) == event
    tried("event parser: valid events")
