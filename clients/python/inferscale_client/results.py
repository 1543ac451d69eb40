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
    ts: datetime
    created_at: datetime
    deleted_at: datetime | None = None  # set on a retired version
    superseded_by: int | None = None  # the version that replaced it
    kv: FactKV
    replaces: int | None = None  # an edit's result: the version it retired


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


class Forgotten(Result):
    """What forgetting an owner removed."""

    user: str
    facts_deleted: int
    blobs_deleted: int
    purged_from_memory: int
