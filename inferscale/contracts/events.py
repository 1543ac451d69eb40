"""Turn event contract (v1, v2, v3) and its validation for the ingest topic.

:func:`parse_turn` is the one gate between the topic and the database: whatever bytes arrive,
it returns a valid :class:`TurnEvent` or raises :class:`InvalidEvent` with a short reason.
v2 adds optional scopes (``agent_id``, ``run_id``: ``contracts/scope.py``); v3 adds optional
``metadata`` (``contracts/metadata.py``), which the facts extracted from the turn carry. A
record is read as its version defines it (fields it does not define are ignored), so older
producers keep working; a producer writes the lowest version that holds the turn
(``TurnEvent`` picks it), so older consumers read every turn they can, and refuse (rather than
silently drop) the fields they cannot.
"""

from __future__ import annotations

import json
import reprlib
from datetime import UTC, datetime
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from inferscale.contracts.metadata import Metadata
from inferscale.contracts.scope import SCOPE_FIELDS, OwnerId, Scope, ScopeValue

TURN_EVENT_VERSIONS: Final = (1, 2, 3)
# What each version does not define (ignored when read, never written).
UNDEFINED: Final = {1: (*SCOPE_FIELDS, "metadata"), 2: ("metadata",), 3: ()}
STRING_FIELDS = ("user_id", "conversation_id", "turn_id", "speaker", "text", *SCOPE_FIELDS)


class InvalidEvent(ValueError):
    """A message that cannot be ingested; ``reason`` goes into the dead-letter header."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class TurnEvent(BaseModel):
    """One conversation turn. Kafka key = user_id so a user's turns stay ordered."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: Literal[1, 2, 3] = 1
    user_id: OwnerId
    conversation_id: str = Field(min_length=1, max_length=256)
    turn_id: str = Field(min_length=1, max_length=256)
    speaker: str = Field(min_length=1, max_length=256)
    text: str
    timestamp: datetime
    agent_id: ScopeValue | None = None
    run_id: ScopeValue | None = None
    metadata: Metadata | None = None  # carried by the facts extracted from the turn

    @model_validator(mode="before")
    @classmethod
    def _version(cls, data: Any) -> Any:
        """Unset: the lowest version defining every field the turn sets; a version that does
        not define a field the turn sets is refused (:func:`parse_turn` drops them from a
        record before this sees it)."""
        if not isinstance(data, dict):
            return data
        needs = 3 if data.get("metadata") is not None else 2 if any(
            data.get(name) is not None for name in SCOPE_FIELDS) else 1
        if data.get("version") is None:
            return {**data, "version": needs}
        if isinstance(data["version"], int) and data["version"] < needs:
            raise ValueError("agent_id and run_id need version 2" if needs == 2
                             else "metadata needs version 3")
        return data

    @property
    def scope(self) -> Scope:
        return Scope(self.agent_id, self.run_id)

    @field_validator("timestamp")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        try:
            return value.astimezone(UTC)
        except OverflowError:  # e.g. 9999-12-31T23:59:59-01:00 is past year 9999 in UTC
            raise ValueError("timestamp out of range") from None

    def to_bytes(self) -> bytes:
        """The record's value: only the fields its version defines."""
        return self.model_dump_json(exclude=set(UNDEFINED[self.version])).encode()


def parse_turn(raw: bytes | None, max_text_bytes: int) -> TurnEvent:
    """Decode and validate one message; raise InvalidEvent with a short reason otherwise.

    Never raises anything else: an unforeseen failure becomes ``unparseable: <type>``.
    """
    try:
        return _parse(raw, max_text_bytes)
    except InvalidEvent:
        raise
    except Exception as exc:  # noqa: BLE001 - any input must yield a reason, never a crash
        raise InvalidEvent(f"unparseable: {type(exc).__name__}") from None


def _parse(raw: bytes | None, max_text_bytes: int) -> TurnEvent:
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise InvalidEvent("not a json object")
    version = data.get("version")
    if type(version) is not int or version not in TURN_EVENT_VERSIONS:  # not true, not 1.0
        raise InvalidEvent(f"unknown version: {reprlib.repr(version)}")
    # fields the version does not define are ignored, as every unknown field
    data = {k: v for k, v in data.items() if k not in UNDEFINED[version]}
    _check_strings(data, max_text_bytes)
    try:
        event = TurnEvent.model_validate(data)
    except ValidationError as exc:
        fields = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'event'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_url=False, include_context=False, include_input=False)
        )
        raise InvalidEvent(f"invalid fields: {fields}") from None
    return event


def _load_json(raw: bytes | None) -> object:
    if raw is None:
        raise InvalidEvent("empty message")
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidEvent("invalid json: nesting too deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidEvent(f"invalid json: {exc}") from None
    except ValueError as exc:
        if "integer string conversion" not in str(exc):  # Python's 4300-digit limit
            raise
        raise InvalidEvent("invalid json: number too large") from None


def _check_strings(data: dict[str, Any], max_text_bytes: int) -> None:
    """What Postgres cannot store (lone surrogates, NUL) and oversized text, before validation."""
    for name in STRING_FIELDS:
        value = data.get(name)
        if not isinstance(value, str):
            continue  # missing or ill-typed: the model reports it
        try:
            size = len(value.encode())
        except UnicodeEncodeError:
            raise InvalidEvent(
                f"invalid fields: {name} is not valid UTF-8 (lone surrogate)") from None
        if "\x00" in value:
            raise InvalidEvent(f"invalid fields: {name} contains NUL")
        if name == "text" and size > max_text_bytes:
            raise InvalidEvent(f"text too large: {size} > {max_text_bytes} bytes")


def parse_record(key: bytes | None, value: bytes | None, max_text_bytes: int) -> TurnEvent:
    """:func:`parse_turn` plus the producer contract: the record key is the user_id (UTF-8)."""
    event = parse_turn(value, max_text_bytes)
    if key is None:
        raise InvalidEvent("missing key (must be the user_id)")
    if key != event.user_id.encode():
        raise InvalidEvent("key does not match user_id")
    return event
