"""The memory API's responses as pydantic models: the schemas of ``/openapi.json`` (a client can
be generated from it) and what every route's answer is checked against. Timestamps are ISO 8601
strings as the database's ``FactRecord.as_json`` writes them. Every refusal has one shape,
``ErrorResponse`` (vLLM's, OpenAI's): the front end's refusals and the app's alike."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class KVStatus(BaseModel):
    """A fact's KV for the model the answering server serves."""

    encoded: bool
    tokens: int | None
    bytes: int | None
    evicted: bool
    tiers: list[str]  # "durable", and this server's memory tiers holding it ("host", "device")
    model_fingerprint: str | None
    encoded_at: str | None


class Fact(BaseModel):
    """One fact: text, scope, metadata, provenance, KV status."""

    id: int
    user_id: str
    text: str
    conversation_id: str
    turn_ids: list[str]
    agent_id: str | None
    run_id: str | None
    metadata: dict[str, Any]
    extractor: str
    ts: str
    created_at: str
    deleted_at: str | None
    superseded_by: int | None
    expires_at: str | None  # never served from then on (None: never expires)
    pinned: bool  # in every memory prompt of its owner, first
    kv: KVStatus


class AddedFact(Fact):
    """A fact added directly, and the event that says when its KV is ready."""

    event_id: str


class EditedFact(Fact):
    """The new version an edit made, and the fact it replaced."""

    replaces: int


class FactPage(BaseModel):
    facts: list[Fact]
    next_cursor: str | None  # None: the last page


class Versions(BaseModel):
    versions: list[Fact]  # oldest first


class Hit(BaseModel):
    id: int
    text: str
    score: float  # cosine similarity
    kv_encoded: bool


class Hits(BaseModel):
    hits: list[Hit]  # best first


class Deleted(BaseModel):
    id: int
    deleted: bool


class DeletedMany(BaseModel):
    deleted: list[int]  # the facts retired, in id order


class RefusedTurn(BaseModel):
    index: int
    reason: str


class TurnsAdded(BaseModel):
    accepted: list[str]  # turn ids published
    refused: list[RefusedTurn]
    event_id: str | None  # how far the accepted turns have come (None: none accepted)


class ImportedFacts(BaseModel):
    imported: list[int]  # the facts stored, in the records' order
    skipped: int  # records the owner held already
    event_id: str  # when the imported facts are encoded


class ProducedFact(BaseModel):
    id: int
    live: bool  # False: edited or deleted since
    encoded: bool  # its KV made for the answering server's model (evicted since counts)
    encode_error: str | None  # why the last encode failed, while it waits to be retried


class EventStatus(BaseModel):
    """How far an add has come: ``queued`` (a turn not stored yet), ``stored`` (a turn not
    extracted yet), ``extracted`` (a live fact it produced has no KV for this server's model
    yet), ``encoded`` (every live fact it produced has; also an add that produced none)."""

    id: str
    user_id: str
    stage: Literal["queued", "stored", "extracted", "encoded"]
    created_at: str
    turns: int
    turns_stored: int
    turns_extracted: int
    facts: list[ProducedFact]  # those the key may see, in id order


class Forgotten(BaseModel):
    user: str
    facts_deleted: int
    blobs_deleted: int
    purged_from_memory: int


class ErrorInfo(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    """Every refusal: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorInfo


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what} for status, what in (
        (400, "malformed request"), (401, "no or an unknown API key"),
        (403, "the key may not do this, or a foreign Host / Origin"),
        (404, "no such fact the key may see"),
        (409, "the owner is at a limit (pinned_max pinned facts)"), (413, "body too large"),
        (415, "not application/json"), (429, "over the key's rate limit"))}
