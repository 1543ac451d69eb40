"""Typed results of the memory API: pydantic models of its responses.

Fields the server adds later are kept (``extra="allow"``: an older client reads a newer
server), and every result also answers ``result["field"]`` as the dicts of earlier versions of
this client did, so code written against them keeps working.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict


class Result(BaseModel):
    """A response of the memory API; ``result["name"]`` reads a field as ``result.name``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def __getitem__(self, name: str) -> Any:
        if name not in type(self).model_fields and name not in (self.model_extra or {}):
            raise KeyError(name)
        return getattr(self, name)


class FactKV(Result):
    """A fact's KV for the model the answering server serves (``encoded`` false: none yet)."""

    encoded: bool
    tokens: int | None = None
    bytes: int | None = None
    evicted: bool = False
    tiers: list[str] = []  # "durable", then the answering server's memory tiers holding it
    model_fingerprint: str | None = None
    encoded_at: datetime | None = None


class Fact(Result):
    """One version of a fact, with its provenance (source turns, extractor) and KV status."""

    id: int
    user_id: str
    text: str
    conversation_id: str
    turn_ids: list[str]
    extractor: str
    agent_id: str | None = None
    run_id: str | None = None
    metadata: dict[str, Any] = {}  # the application's (``{}``: none)
    ts: datetime
    created_at: datetime
    deleted_at: datetime | None = None  # set on a retired version
    superseded_by: int | None = None  # the version that replaced it
    expires_at: datetime | None = None  # never served from then on (None: never expires)
    pinned: bool = False  # in every memory prompt of its owner, first
    kv: FactKV
    replaces: int | None = None  # an edit's result: the version it retired
    event_id: str | None = None  # an add's result: its event (``MemoryClient.event``)


class FactPage(Result):
    """One page of an owner's live facts in id order; ``next_cursor`` None on the last."""

    facts: list[Fact]
    next_cursor: str | None


class SearchHit(Result):
    """A fact the server would retrieve, with its cosine similarity to the query."""

    id: int
    text: str
    score: float
    kv_encoded: bool


class Deleted(Result):
    id: int
    deleted: bool


class RefusedTurn(Result):
    index: int  # its place in the request's list
    reason: str


class TurnsAdded(Result):
    """Turns published to the turn topic (by turn id) and those refused, with why."""

    accepted: list[str]
    refused: list[RefusedTurn]
    event_id: str | None = None  # how far the accepted turns have come (None: none accepted)


class Imported(Result):
    """One import request: the facts stored, in the records' order, and those skipped (the
    owner held them already); the event says when the stored ones are encoded."""

    imported: list[int]
    skipped: int
    event_id: str


class ProducedFact(Result):
    id: int
    live: bool  # False: edited or deleted since
    encoded: bool  # its KV made for the answering server's model
    encode_error: str | None = None  # why its last encode failed, while it waits for a retry


class Event(Result):
    """How far an add has come: ``stage`` is ``queued`` (a turn not stored yet), ``stored``
    (not extracted yet), ``extracted`` (a live fact it produced not encoded yet) or
    ``encoded`` (ready: every live fact it produced is injected as KV)."""

    id: str
    user_id: str
    stage: str
    created_at: datetime
    turns: int
    turns_stored: int
    turns_extracted: int
    facts: list[ProducedFact]


class Forgotten(Result):
    """What forgetting an owner removed."""

    user: str
    facts_deleted: int
    blobs_deleted: int
    purged_from_memory: int
