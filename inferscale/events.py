"""Turn event contract (v1) and its validation for the ingest topic."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

TURN_EVENT_VERSION = 1


class InvalidEvent(ValueError):
    """A message that cannot be ingested; ``reason`` goes into the dead-letter header."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class TurnEvent(BaseModel):
    """One conversation turn. Kafka key = user_id so a user's turns stay ordered."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: Literal[1] = TURN_EVENT_VERSION
    user_id: str = Field(min_length=1, max_length=256)
    conversation_id: str = Field(min_length=1, max_length=256)
    turn_id: str = Field(min_length=1, max_length=256)
    speaker: str = Field(min_length=1, max_length=256)
    text: str
    timestamp: datetime

    @field_validator("timestamp")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def parse_turn(raw: bytes | None, max_text_bytes: int) -> TurnEvent:
    """Decode and validate one message; raise InvalidEvent with a short reason otherwise."""
    if raw is None:
        raise InvalidEvent("empty message")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidEvent(f"invalid json: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidEvent("not a json object")
    version = data.get("version")
    if version != TURN_EVENT_VERSION:
        raise InvalidEvent(f"unknown version: {version!r}")
    text = data.get("text")
    if isinstance(text, str) and len(text.encode()) > max_text_bytes:
        raise InvalidEvent(f"text too large: {len(text.encode())} > {max_text_bytes} bytes")
    try:
        event = TurnEvent.model_validate(data)
    except ValidationError as exc:
        fields = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'event'}: {e['msg']}" for e in exc.errors()
        )
        raise InvalidEvent(f"invalid fields: {fields}") from None
    for name in ("user_id", "conversation_id", "turn_id", "speaker", "text"):
        if "\x00" in getattr(event, name):
            raise InvalidEvent(f"invalid fields: {name} contains NUL")
    return event
