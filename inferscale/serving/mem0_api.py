"""Mem0's platform API over this server's memory: the routes the ``mem0ai`` client (2.2.1,
``MemoryClient`` / ``AsyncMemoryClient``) calls, so an application moves over by changing its
``host`` and key. A Mem0 "memory" is a fact; its id is the fact's id as a string.

- ``infer`` true (Mem0's default): the messages become turns on the turn topic, extracted by the
  workers as any turn is (the answer says they are queued); ``infer`` false: each message's
  text is stored as a fact at once, with its metadata.
- Facts are versioned here: an update stores a new version with a new id, and the old id keeps
  working (reads, updates, deletes and history follow it to its newest version).
- Memory belongs to an owner: the requests that read or delete many name ``user_id`` (in
  ``filters`` or as a parameter); agents and runs are scopes within an owner.
- What has no meaning here (app ids, categories, custom instructions, expiration, reranking,
  keyword search, ...) is refused with a 400 that names it.

Keys are admitted as on the native routes (``memory_ops.Admission``); Mem0's ``Authorization:
Token <key>`` is read as ``Bearer <key>`` by the front end on these paths (``MEM0_PREFIXES``).
A route that learns the owner from a fact id answers 404, not 403, for a fact of an owner the
key may not act for: it tells nothing of other owners' facts.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, date, datetime, time, timedelta
from types import EllipsisType
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette._utils import get_route_path

from inferscale.contracts.events import TurnEvent
from inferscale.contracts.filters import EVERYTHING, Node, pinned
from inferscale.contracts.metadata import Metadata
from inferscale.contracts.scope import ANY, Scope, ScopeValue, is_owner_id
from inferscale.core.settings import KeyGrant
from inferscale.db import memory_edits, memory_events
from inferscale.db.memory_edits import FactRecord
from inferscale.serving import memory_ops as ops
from inferscale.serving.memory_models import ERRORS
from inferscale.serving.memory_ops import Admission, Service

MEM0_PREFIXES: Final = ("/v1/ping/", "/v1/memories/", "/v3/memories/", "/v1/batch/",
                        "/v1/entities/", "/v2/entities/", "/v1/event/")
MAX_MESSAGES: Final = 100
MAX_TEXT: Final = 4000
MAX_BATCH: Final = 1000
MAX_PAGE_SIZE: Final = 500
MAX_TOP_K: Final = 100
MAX_ENTITIES: Final = 1000
DELETE_CHUNK: Final = 1000
NOT_HERE: Final = {
    "app_id": "facts belong to owners, agents and runs here, not apps",
    "org_id": "there are no organisations here: the key says who may act",
    "project_id": "there are no projects here: the key says who may act",
    "custom_categories": "facts have no categories here (use metadata)",
    "categories": "facts have no categories here (use metadata)",
    "custom_instructions": "extraction is configured on the server (INFERSCALE_EXTRACTOR)",
    "agent_custom_instructions": "extraction is configured on the server",
    "includes": "extraction is configured on the server",
    "excludes": "extraction is configured on the server",
    "immutable": "every fact can be edited here",
    "structured_data_schema": "no structured extraction here",
    "rerank": "search ranks by exact cosine similarity; no reranker",
    "keyword_search": "search ranks by meaning; no keyword search",
    "reference_date": "no relative-time queries",
    "fields": "responses carry every field",
    "latest_only": "only the latest version of a fact is ever live here",
    "show_expired": "an expired fact is never served or listed here",
    "start_date": "filter on created_at in filters",
    "end_date": "filter on created_at in filters",
    "enable_graph": "no graph memory here",
    "output_format": "one response format (v1.1)",
}
ACCEPTED_AS_IS: Final = frozenset({"async_mode", "version"})  # response format knobs
# Fields accepted where they ask for what is served (Mem0's TypeScript client sends
# ``output_format: "v1.1"`` with every search).
ACCEPTED_VALUES: Final = {"output_format": "v1.1"}

router = APIRouter(tags=["mem0"], responses=ERRORS)


class Mem0Memory(BaseModel):
    """A fact as Mem0's clients read a memory."""

    id: str
    memory: str
    user_id: str
    agent_id: str | None
    run_id: str | None
    app_id: None = None
    metadata: dict[str, Any]
    categories: list[str] = []
    created_at: str
    updated_at: str  # a version never changes: when it was stored
    score: float | None = None  # search only
    expiration_date: str | None = None  # the last day it is served (expires_at's eve)


class AddResult(BaseModel):
    id: str
    memory: str
    event: Literal["ADD"]


class Added(BaseModel):
    results: list[AddResult]  # infer false: the facts stored
    status: Literal["SUCCEEDED", "PENDING"]  # PENDING: turns queued for extraction
    message: str
    # how far the add has come: GET /v1/memory/users/{user_id}/events/{event_id}
    event_id: str


class Page(BaseModel):
    count: int
    next: str | None
    previous: str | None
    results: list[Mem0Memory]


class Results(BaseModel):
    results: list[Mem0Memory]


class Message(BaseModel):
    message: str


class EventResult(BaseModel):
    id: str  # a memory the add produced
    event: Literal["ADD"]
    user_id: str
    encoded: bool  # its KV made for the served model


class Mem0Event(BaseModel):
    id: str
    event_type: Literal["ADD"]
    # PENDING: turns not all stored; RUNNING: stored, not all extracted and encoded
    status: Literal["PENDING", "RUNNING", "SUCCEEDED"]
    results: list[EventResult]
    created_at: str
    stage: str  # the native event's (``GET /v1/memory/users/{user}/events/{id}``)


class HistoryEntry(BaseModel):
    id: str
    memory_id: str
    old_memory: str | None
    new_memory: str | None
    event: Literal["ADD", "UPDATE", "DELETE"]
    user_id: str
    metadata: dict[str, Any]
    created_at: str
    updated_at: str


class Entity(BaseModel):
    id: str
    name: str
    type: Literal["user"]
    total_memories: int


class Entities(BaseModel):
    results: list[Entity]


class Ping(BaseModel):
    """The client requires an organisation and project; there is one of each here (its
    project routes are not offered)."""

    status: Literal["ok"]
    org_id: Literal["inferscale"] = "inferscale"
    project_id: Literal["inferscale"] = "inferscale"
    user_email: None = None


class _Mem0Body(BaseModel):
    """A body whose fields Mem0 sends; the ones with no meaning here are refused, named."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _meaningful(self) -> _Mem0Body:
        for name, value in (self.model_extra or {}).items():
            if name in ACCEPTED_AS_IS or value is None or ACCEPTED_VALUES.get(name) == value:
                continue
            raise ValueError(f"{name!r} is not offered by InferScale: "
                             f"{NOT_HERE.get(name, 'unknown field')}")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str = Field(default="user", min_length=1, max_length=64)
    content: str = Field(min_length=1, max_length=MAX_TEXT)
    name: str | None = Field(default=None, min_length=1, max_length=256)


class AddBody(_Mem0Body):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    user_id: str | None = None
    agent_id: ScopeValue | None = None
    run_id: ScopeValue | None = None
    filters: dict[str, Any] | None = None
    metadata: Metadata | None = None
    infer: bool = True
    timestamp: int | None = Field(default=None, ge=0, le=253402300799)  # unix seconds
    expiration_date: date | None = None  # expires at the end of that day (UTC)

    @property
    def expires_at(self) -> datetime | None:
        return end_of_day(self.expiration_date)


def end_of_day(day: date | None) -> datetime | None:
    """When a memory with this ``expiration_date`` stops being served (None: never)."""
    return None if day is None else datetime.combine(day, time.min, UTC) + timedelta(days=1)


class ListBody(_Mem0Body):
    filters: dict[str, Any] | None = None
    user_id: str | None = None
    agent_id: ScopeValue | None = None
    run_id: ScopeValue | None = None


class SearchBody(ListBody):
    query: str = Field(min_length=1, max_length=MAX_TEXT)
    top_k: int = Field(default=10, ge=1, le=MAX_TOP_K)
    limit: int | None = Field(default=None, ge=1, le=MAX_TOP_K)  # Mem0's older name
    threshold: float | None = Field(default=None, ge=-1.0, le=1.0)
    metadata: Metadata | None = None  # Mem0's client may echo it; filters select


class UpdateBody(_Mem0Body):
    text: str | None = Field(default=None, min_length=1, max_length=MAX_TEXT)
    metadata: Metadata | None = None
    expiration_date: date | None = None  # given as null: never expires; absent: as it was

    @model_validator(mode="after")
    def _something(self) -> UpdateBody:
        if (self.text is None and self.metadata is None
                and "expiration_date" not in self.model_fields_set):
            raise ValueError("an update sets text, metadata and / or expiration_date")
        return self

    @property
    def expiry(self) -> datetime | None | EllipsisType:
        """The new version's expiry (``...``: the old one's)."""
        if "expiration_date" not in self.model_fields_set:
            return ...
        return end_of_day(self.expiration_date)


class BatchItem(UpdateBody):
    memory_id: str = Field(min_length=1, max_length=40)


class BatchDeleteItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memory_id: str = Field(min_length=1, max_length=40)


class BatchUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memories: list[BatchItem] = Field(min_length=1, max_length=MAX_BATCH)


class BatchDelete(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memories: list[BatchDeleteItem] = Field(min_length=1, max_length=MAX_BATCH)


def memory_json(record: FactRecord, score: float | None = None) -> dict[str, Any]:
    """A fact as a Mem0 memory."""
    stored = record.created_at.isoformat()
    return {"id": str(record.id), "memory": record.text, "user_id": record.user_id,
            "agent_id": record.agent_id, "run_id": record.run_id, "app_id": None,
            "metadata": record.metadata, "categories": [], "created_at": stored,
            "updated_at": stored, "score": score,
            "expiration_date": (record.expires_at - timedelta(microseconds=1)).date().isoformat()
            if record.expires_at else None}


def _owner_and_filter(body: ListBody) -> tuple[str, Scope, Node]:
    """The owner a read names (in the filters, or as Mem0's older top-level field), the scope
    given beside the filters, and the filter."""
    where = ops.parsed(body.filters)
    owner = body.user_id or pinned(where).get("user_id")
    if owner is None:
        raise HTTPException(400, "name the owner: filters {\"user_id\": ...} (memory belongs "
                                 "to an owner here)")
    if not is_owner_id(owner):
        raise HTTPException(400, "owner ids are 1-256 characters, no control characters")
    return owner, Scope(body.agent_id, body.run_id), where


async def _fact(service: Service, caller: Admission, memory_id: str, write: bool = False
                ) -> tuple[KeyGrant, FactRecord]:
    """The live version of a memory id the key may act on (404 otherwise, whoever owns it)."""
    grant = caller.known()
    missing = HTTPException(404, f"no memory {memory_id[:40]!r}")
    if not memory_id.isascii() or not memory_id.isdigit() or not 0 < int(memory_id) < 2**63:
        raise missing
    found = await ops.in_transaction(
        service, lambda conn, _: memory_edits.fact_owner(conn, int(memory_id)))
    if found is None or ("*" not in grant.owners and found[0] not in grant.owners):
        caller.missed()
        raise missing
    owner, live_id = found
    caller.admit(owner, None, write=write)
    record = ops.visible(grant, await ops.in_transaction(
        service, lambda conn, model: memory_edits.get_fact(conn, owner, model, live_id)))
    if record is None:
        caller.missed()
        raise missing
    return grant, record


@router.get("/v1/ping/", summary="Mem0: check the key", response_model=Ping)
async def ping(caller: Admission) -> dict[str, Any]:
    caller.known()
    return {"status": "ok"}


@router.post("/v3/memories/add/", summary="Mem0: add memories", response_model=Added)
async def add(body: AddBody, service: Service, caller: Admission) -> dict[str, Any]:
    """``infer`` true: the messages as turns, extracted by the workers (queued); false: each
    message's text stored as a fact now, with the metadata."""
    owner, scope, _ = _owner_and_filter(ListBody(
        filters=body.filters, user_id=body.user_id, agent_id=body.agent_id, run_id=body.run_id))
    scope = ops.named_scope(scope, ops.parsed(body.filters))
    caller.admit(owner, scope, write=True, cost=len(body.messages))
    when = datetime.fromtimestamp(body.timestamp, UTC) if body.timestamp else datetime.now(UTC)
    if not body.infer:
        records = [await ops.add_fact(service, owner, m.content, scope, "mem0", body.metadata,
                                      when, body.expires_at) for m in body.messages]
        return {"results": [{"id": str(r.id), "memory": r.text, "event": "ADD"}
                            for r in records],
                "status": "SUCCEEDED", "message": f"{len(records)} memories stored",
                "event_id": await ops.record_event(service, owner,
                                                   fact_ids=[r.id for r in records])}
    if body.expiration_date is not None:
        raise HTTPException(400, "expiration_date with infer=true is not offered by InferScale: "
                                 "facts extracted from turns do not expire (add with "
                                 "infer=false, or set expires_at on the facts)")
    conversation = scope.run_id or "mem0"
    turns = [TurnEvent(user_id=owner, conversation_id=conversation,
                       turn_id=f"mem0-{uuid.uuid4().hex}", speaker=m.name or m.role,
                       text=m.content, timestamp=when, agent_id=scope.agent_id,
                       run_id=scope.run_id, metadata=body.metadata) for m in body.messages]
    if any(len(t.text.encode()) > service.settings.max_text_bytes for t in turns):
        raise HTTPException(400, "a message is longer than max_text_bytes")
    await ops.publish_turns(service, turns)
    return {"results": [], "status": "PENDING",
            "message": f"{len(turns)} messages queued for extraction",
            "event_id": await ops.record_event(service, owner, turns)}


@router.post("/v3/memories/", summary="Mem0: list memories", response_model=Page)
async def get_all(request: Request, body: ListBody, service: Service, caller: Admission,
                  page: Annotated[int, Query(ge=1, le=100_000)] = 1,
                  page_size: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 100
                  ) -> dict[str, Any]:
    """The owner's live facts passing the filter, in id order, a page at a time."""
    owner, scope, where = _owner_and_filter(body)
    caller.admit(owner, ops.named_scope(scope, where))
    where = ops.within(scope, where)
    records, count = await ops.in_transaction(service, lambda conn, model: _page(
        conn, owner, model, where, page, page_size))

    def link(to: int) -> str:
        return str(request.url.include_query_params(page=to, page_size=page_size))

    return {"count": count, "results": [memory_json(r) for r in records],
            "next": link(page + 1) if page * page_size < count else None,
            "previous": link(page - 1) if page > 1 else None}


async def _page(conn: Any, owner: str, model: str, where: Node, page: int, size: int
                ) -> tuple[list[FactRecord], int]:
    records = await memory_edits.list_facts(conn, owner, model, 0, size, ANY, where,
                                            offset=(page - 1) * size)
    return records, await memory_edits.count_facts(conn, owner, where)


@router.post("/v3/memories/search/", summary="Mem0: search memories", response_model=Results)
async def search(body: SearchBody, service: Service, caller: Admission) -> dict[str, Any]:
    """The owner's ``top_k`` live facts passing the filter nearest to the query (as the server
    retrieves for a chat request), best first, with their cosine similarity."""
    owner, scope, where = _owner_and_filter(body)
    caller.admit(owner, ops.named_scope(scope, where))
    hits = await ops.search(service, owner, body.query, body.limit or body.top_k, scope, where)
    scores = {h.id: 1.0 - h.distance for h in hits
              if body.threshold is None or 1.0 - h.distance >= body.threshold}
    records = await ops.in_transaction(service, lambda conn, model: memory_edits.get_facts(
        conn, owner, model, list(scores)))
    by_id = {r.id: r for r in records}
    return {"results": [memory_json(by_id[i], s) for i, s in scores.items() if i in by_id]}


@router.get("/v1/memories/{memory_id}/", summary="Mem0: one memory", response_model=Mem0Memory)
async def get(memory_id: str, service: Service, caller: Admission) -> dict[str, Any]:
    _, record = await _fact(service, caller, memory_id)
    return memory_json(record)


@router.put("/v1/memories/{memory_id}/", summary="Mem0: update a memory",
            response_model=Mem0Memory)
async def update(memory_id: str, body: UpdateBody, service: Service, caller: Admission
                 ) -> dict[str, Any]:
    """A new version with the new text, metadata and / or expiry (a new id; the old one
    follows it)."""
    grant, record = await _fact(service, caller, memory_id, write=True)
    return memory_json(await ops.edit_fact(service, grant, record.user_id, record.id,
                                           body.text, body.metadata, body.expiry))


@router.delete("/v1/memories/{memory_id}/", summary="Mem0: delete a memory",
               response_model=Message)
async def delete(memory_id: str, service: Service, caller: Admission,
                 delete_linked: bool = False) -> dict[str, Any]:
    """The memory's live version (the versions it replaced are retired already:
    ``delete_linked`` changes nothing)."""
    grant, record = await _fact(service, caller, memory_id, write=True)
    await ops.delete_fact(service, grant, record.user_id, record.id)
    return {"message": "Memory deleted successfully!"}


@router.get("/v1/event/{event_id}/", summary="Mem0: how far an add has come",
            response_model=Mem0Event)
async def event(event_id: str, service: Service, caller: Admission) -> dict[str, Any]:
    """An add's event (its ``event_id``) as Mem0's: ``SUCCEEDED`` once every fact it produced
    is encoded. 404 for an event the key may not see, whoever owns it."""
    grant = caller.known()
    missing = HTTPException(404, f"no event {event_id[:40]!r}")
    if not re.fullmatch(ops.EVENT_ID_PATTERN, event_id):
        raise missing
    owner = await ops.in_transaction(
        service, lambda conn, _: memory_events.event_owner(conn, event_id))
    if owner is None or ("*" not in grant.owners and owner not in grant.owners):
        caller.missed()
        raise missing
    caller.admit(owner, None)
    progress = await ops.event_progress(service, grant, owner, event_id)
    stage = progress.stage
    return {"id": progress.id, "event_type": "ADD",
            "status": {"queued": "PENDING", "encoded": "SUCCEEDED"}.get(stage, "RUNNING"),
            "results": [{"id": str(f.id), "event": "ADD", "user_id": owner,
                         "encoded": f.encoded} for f in progress.facts],
            "created_at": progress.created_at.isoformat(), "stage": stage}


@router.get("/v1/memories/{memory_id}/history/", summary="Mem0: a memory's history",
            response_model=list[HistoryEntry])
async def history(memory_id: str, service: Service, caller: Admission
                  ) -> list[dict[str, Any]]:
    """Its versions as Mem0's events, oldest first: ADD, then an UPDATE per edit."""
    _, record = await _fact(service, caller, memory_id)
    versions = await ops.in_transaction(service, lambda conn, model: memory_edits.fact_history(
        conn, record.user_id, model, record.id)) or []
    entries, previous = [], None
    for version in versions:
        stored = version.created_at.isoformat()
        entries.append({"id": str(version.id), "memory_id": memory_id,
                        "old_memory": previous, "new_memory": version.text,
                        "event": "ADD" if previous is None else "UPDATE",
                        "user_id": version.user_id, "metadata": version.metadata,
                        "created_at": stored, "updated_at": stored})
        previous = version.text
    return entries


@router.delete("/v1/memories/", summary="Mem0: delete an owner's memories",
               response_model=Message)
async def delete_all(service: Service, caller: Admission, user_id: ops.ScopeQuery = None,
                     agent_id: ops.ScopeQuery = None, run_id: ops.ScopeQuery = None,
                     app_id: Annotated[str | None, Query(max_length=256)] = None
                     ) -> dict[str, Any]:
    """Every live fact of the owner (in the agent / run given); their turns stay (forget the
    owner with ``delete_users`` for that)."""
    if app_id is not None:
        raise HTTPException(400, f"'app_id' is not offered by InferScale: {NOT_HERE['app_id']}")
    if user_id is None:
        raise HTTPException(400, "name the owner: user_id (memory belongs to an owner here)")
    scope = Scope(agent_id, run_id)
    caller.admit(user_id, scope, write=True)
    where = ops.within(scope, EVERYTHING)
    while len(await ops.delete_where(service, user_id, where, DELETE_CHUNK)) == DELETE_CHUNK:
        pass
    return {"message": "Memories deleted successfully!"}


@router.put("/v1/batch/", summary="Mem0: update memories", response_model=Message)
async def batch_update(body: BatchUpdate, service: Service, caller: Admission
                       ) -> dict[str, Any]:
    """Each memory found and admitted first (any refusal changes nothing), then updated."""
    found = [await _fact(service, caller, item.memory_id, write=True) for item in body.memories]
    for (grant, record), item in zip(found, body.memories, strict=True):
        await ops.edit_fact(service, grant, record.user_id, record.id, item.text, item.metadata,
                            item.expiry)
    return {"message": f"Successfully updated {len(found)} memories"}


@router.delete("/v1/batch/", summary="Mem0: delete memories", response_model=Message)
async def batch_delete(body: BatchDelete, service: Service, caller: Admission
                       ) -> dict[str, Any]:
    """Each memory found and admitted first (any refusal changes nothing), then deleted."""
    found = [await _fact(service, caller, item.memory_id, write=True) for item in body.memories]
    for grant, record in {r.id: (g, r) for g, r in found}.values():
        await ops.delete_fact(service, grant, record.user_id, record.id)
    return {"message": f"Successfully deleted {len(found)} memories"}


@router.get("/v1/entities/", summary="Mem0: the owners with memories", response_model=Entities)
async def users(service: Service, caller: Admission) -> dict[str, Any]:
    """The owners the key may act for that have live facts it may see (of its agents and
    runs, where it is limited to some), each with how many of those (at most
    ``MAX_ENTITIES``), as Mem0's user entities."""
    grant = caller.known()
    owners = None if "*" in grant.owners else list(grant.owners)
    counts = await ops.in_transaction(service, lambda conn, _: memory_edits.owners_with_facts(
        conn, owners, MAX_ENTITIES, grant.agents, grant.runs))
    return {"results": [{"id": owner, "name": owner, "type": "user", "total_memories": n}
                        for owner, n in counts.items()]}


@router.delete("/v2/entities/{kind}/{name}/", summary="Mem0: delete an entity",
               response_model=Message)
async def delete_entity(kind: str, name: str, service: Service, caller: Admission
                        ) -> dict[str, Any]:
    """A user entity is an owner: forgotten (turns, facts, vectors, KV, with a tombstone).
    Agents and runs are scopes within owners here: delete their memories with ``delete_all``
    naming the owner."""
    if kind != "user":
        raise HTTPException(400, f"{kind[:20]!r} entities are not offered by InferScale: agents "
                                 "and runs are scopes within an owner (delete_all(user_id=..., "
                                 "agent_id=...))")
    caller.admit(name, ANY, write=True)
    await service.forget(name)
    return {"message": "Entity deleted successfully."}


def token_as_bearer(scope: dict[str, Any]) -> dict[str, Any]:
    """An ASGI scope in which, on Mem0's paths only, ``Authorization: Token <key>`` (the
    ``mem0ai`` client's scheme) reads ``Bearer <key>``: the same keys, checked by the same code
    (``access.py``, and vLLM's own ``--api-key`` check); elsewhere the scope unchanged."""
    if scope.get("type") != "http" or not get_route_path(scope).startswith(MEM0_PREFIXES):
        return scope
    headers = [(name, b"Bearer " + value[6:]
                if name.lower() == b"authorization" and value[:6].lower() == b"token " else value)
               for name, value in scope["headers"]]
    return {**scope, "headers": headers}
