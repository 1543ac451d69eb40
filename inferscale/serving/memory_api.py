"""The memory API: an owner's facts listed, read, searched, edited, deleted and their history;
turns added (to the turn topic: the worker path stays the one way in); an owner forgotten.

Routes live in vLLM's own FastAPI app (``serve_memory`` adds them at start-up, with Mem0's
dialect of them, ``mem0_api.py``), so they are in the server's ``/openapi.json`` with their
response models (``memory_models.py``); ``GET /memory`` serves the memory inspector page
(``static/inspector.html``, with a content security policy), which calls them. Every route is
admitted (``memory_ops.Admission``: ``access.py``) as chat requests are: a key that may act for
the owner (and, for a scoped key, in the scope read or the fact's own scope; for changes, a
key that may write); the browser rules (``browser_guard.py``) ran before any route. What an
edit or delete guarantees: ``memory_ops.py``. Listing, search and delete take a scope
(``agent_id``, ``run_id``: ``contracts/scope.py``) and a filter (``contracts/filters.py``),
as chat requests do; facts carry bounded metadata (``contracts/metadata.py``).
"""

import base64
import binascii
import dataclasses
import importlib.resources
import json
from datetime import datetime
from types import EllipsisType
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, HTTPException, Path, Query
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, model_validator

from inferscale.contracts.events import TurnEvent
from inferscale.contracts.filters import EVERYTHING, Node
from inferscale.contracts.memory_export import (
    MAX_FACT_CHARS,
    MAX_IMPORT,
    ExportedFact,
    ExportHeader,
    FactText,
    Label,
)
from inferscale.contracts.metadata import Metadata
from inferscale.contracts.scope import (
    ANY,
    OwnerId,
    Scope,
    ScopeValue,
)
from inferscale.db import memory_edits
from inferscale.serving import mem0_api
from inferscale.serving import memory_ops as ops
from inferscale.serving.access import holds
from inferscale.serving.browser_guard import page_headers
from inferscale.serving.memory_models import (
    ERRORS,
    AddedFact,
    Deleted,
    DeletedMany,
    EditedFact,
    EventStatus,
    Fact,
    FactPage,
    Forgotten,
    Hits,
    ImportedFacts,
    TurnsAdded,
    Versions,
)
from inferscale.serving.memory_ops import Admission, Service

MAX_PAGE = 500
MAX_SEARCH_K = 100
MAX_TURNS = 1000
MAX_DELETE = 1000
MAX_FILTER_CHARS = 16384
FactId = Annotated[int, Path(ge=1, le=2**63 - 1)]  # a bigint
FilterQuery = Annotated[str | None, Query(max_length=MAX_FILTER_CHARS,
                                          description="a filter (contracts/filters.py) as JSON")]
API = "/v1/memory"
INSPECTOR_PATH = "/memory"  # outside /v1: a browser opens it without a bearer header
INSPECTOR_HTML = (importlib.resources.files("inferscale.serving") / "static" / "inspector.html"
                  ).read_text(encoding="utf-8")
INSPECTOR_HEADERS = page_headers(
    INSPECTOR_HTML.split("<script>", 1)[1].split("</script>", 1)[0])

router = APIRouter(tags=["memory"], responses=ERRORS)


class Scoped(BaseModel):
    """An agent and / or run: the facts' scope, or a filter (None: any)."""

    model_config = ConfigDict(extra="forbid")
    agent_id: ScopeValue | None = None
    run_id: ScopeValue | None = None

    @property
    def scope(self) -> Scope:
        return Scope(self.agent_id, self.run_id)


class Filtered(Scoped):
    """A scope and a filter (``contracts/filters.py``; None: every fact of the scope)."""

    filters: dict[str, Any] | None = None

    @property
    def where(self) -> Node:
        return ops.parsed(self.filters)


class NewFactBody(Scoped):
    """A fact added directly (no source turn), in a scope, with metadata, expiring at
    ``expires_at`` (None: never), ``pinned``: in every memory prompt of the owner, first."""

    text: FactText
    conversation_id: Label = "operator"
    metadata: Metadata | None = None
    expires_at: AwareDatetime | None = None
    pinned: bool = False


class EditBody(BaseModel):
    """A fact's new text, metadata, expiry and / or pinning (at least one; ``expires_at`` null:
    never expires)."""

    model_config = ConfigDict(extra="forbid")
    text: FactText | None = None
    metadata: Metadata | None = None
    expires_at: AwareDatetime | None = None
    pinned: bool | None = None

    @model_validator(mode="after")
    def _something(self) -> "EditBody":
        if (self.text is None and self.metadata is None and self.pinned is None
                and "expires_at" not in self.model_fields_set):
            raise ValueError("an edit sets text, metadata, expires_at, pinned or some of them")
        return self

    @property
    def expiry(self) -> datetime | None | EllipsisType:
        """The new expiry (``...``: the old one's)."""
        return self.expires_at if "expires_at" in self.model_fields_set else ...


class SearchBody(Filtered):
    """A query, retrieved as a chat request of the owner would be (in the scope and filter)."""

    query: str = Field(min_length=1, max_length=MAX_FACT_CHARS)
    k: int = Field(default=10, ge=1, le=MAX_SEARCH_K)


class DeleteBody(Filtered):
    """Which facts to delete: a scope and / or a filter (one of them at least)."""

    limit: int = Field(default=MAX_DELETE, ge=1, le=MAX_DELETE)


class ForgetBody(BaseModel):
    """``POST /v1/memory/forget``: the owner to forget."""

    model_config = ConfigDict(extra="forbid")
    user: OwnerId


class ImportBody(BaseModel):
    """Records of an export (its header, and up to ``MAX_IMPORT`` of its facts)."""

    model_config = ConfigDict(extra="forbid")
    header: ExportHeader
    facts: list[ExportedFact] = Field(min_length=1, max_length=MAX_IMPORT)


class TurnsBody(Scoped):
    """Turns of the owner to publish (``user_id`` is the path's; a different one is refused);
    ``agent_id`` / ``run_id`` apply to turns that set none."""

    turns: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_TURNS)


def _cursor(after_id: int) -> str:
    return base64.urlsafe_b64encode(f"after:{after_id}".encode()).decode()


def _after(cursor: str | None) -> int:
    """The fact id a cursor continues after (400 for one this server did not make)."""
    if cursor is None:
        return 0
    try:
        kind, _, value = base64.urlsafe_b64decode(cursor.encode()).decode().partition(":")
        after = int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise HTTPException(400, "malformed cursor") from None
    if kind != "after" or not 0 <= after < 2**63:
        raise HTTPException(400, "malformed cursor")
    return after


@router.get(INSPECTOR_PATH, include_in_schema=False)
async def inspector() -> HTMLResponse:
    """The memory inspector page (static; it calls the routes below with its key)."""
    return HTMLResponse(INSPECTOR_HTML, headers=INSPECTOR_HEADERS)


@router.get(API + "/users/{user_id}/facts", summary="List an owner's live facts",
            response_model=FactPage)
async def list_facts(user_id: str, service: Service, caller: Admission,
                     limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
                     cursor: Annotated[str | None, Query(max_length=200)] = None,
                     agent_id: ops.ScopeQuery = None, run_id: ops.ScopeQuery = None,
                     filters: FilterQuery = None) -> dict[str, Any]:
    """Live facts (of the agent / run given, passing the filter) in id order with provenance
    and KV status; ``next_cursor`` continues."""
    try:
        where = ops.parsed(None if filters is None else json.loads(filters))
    except (ValueError, RecursionError):
        raise HTTPException(400, "filters: not JSON") from None
    scope = Scope(agent_id, run_id)
    caller.admit(user_id, ops.named_scope(scope, where))
    after = _after(cursor)
    records = await ops.in_transaction(service, lambda conn, model: memory_edits.list_facts(
        conn, user_id, model, after, limit, scope, where))
    return {"facts": await ops.shown(service, records),
            "next_cursor": _cursor(records[-1].id) if len(records) == limit else None}


@router.get(API + "/users/{user_id}/facts/{fact_id}", summary="One live fact",
            response_model=Fact)
async def get_fact(user_id: str, fact_id: FactId, service: Service, caller: Admission
                   ) -> dict[str, Any]:
    grant = caller.admit(user_id, None)
    return (await ops.shown(service, [await ops.live_fact(service, grant, user_id, fact_id)]))[0]


@router.get(API + "/users/{user_id}/facts/{fact_id}/history",
            summary="Every version of a fact", response_model=Versions)
async def history(user_id: str, fact_id: FactId, service: Service, caller: Admission
                  ) -> dict[str, Any]:
    """The fact's versions, oldest first, each with the turns it came from."""
    grant = caller.admit(user_id, None)
    versions = await ops.in_transaction(service, lambda conn, model: memory_edits.fact_history(
        conn, user_id, model, fact_id))
    if not versions or ops.visible(grant, versions[-1]) is None:
        raise HTTPException(404, f"{user_id!r} has no fact {fact_id}")
    return {"versions": await ops.shown(service, versions)}


@router.post(API + "/users/{user_id}/facts", status_code=201,
             summary="Add a fact", response_model=AddedFact)
async def add_fact(user_id: str, body: NewFactBody, service: Service, caller: Admission
                   ) -> dict[str, Any]:
    """A fact given directly, with no source turn, by a key that may write the owner's scope.
    Served as text at once, injected once a worker encodes it (its event says when)."""
    ops.check_pinning(caller.admit(user_id, body.scope, write=True), body.pinned)
    record = await ops.add_fact(service, user_id, body.text, body.scope, body.conversation_id,
                                body.metadata, expires_at=body.expires_at,
                                pinned=body.pinned)
    return {**record.as_json(), "event_id": await ops.record_event(service, user_id,
                                                                    fact_ids=[record.id])}


@router.patch(API + "/users/{user_id}/facts/{fact_id}", summary="Edit a fact",
              response_model=EditedFact)
async def edit(user_id: str, fact_id: FactId, body: EditBody, service: Service,
               caller: Admission) -> dict[str, Any]:
    """A new version of the fact (new text, metadata, expiry and / or pinning) replaces it
    (served as text until it is encoded); the old version is never served again by any server
    once this returns."""
    grant = caller.admit(user_id, None, write=True)
    ops.check_pinning(grant, body.pinned is not None)
    record = await ops.edit_fact(service, grant, user_id, fact_id, body.text, body.metadata,
                                 body.expiry, body.pinned)
    return {**record.as_json(), "replaces": fact_id}


@router.delete(API + "/users/{user_id}/facts/{fact_id}", summary="Delete one fact",
               response_model=Deleted)
async def delete(user_id: str, fact_id: FactId, service: Service, caller: Admission
                 ) -> dict[str, Any]:
    grant = caller.admit(user_id, None, write=True)
    await ops.delete_fact(service, grant, user_id, fact_id)
    return {"id": fact_id, "deleted": True}


@router.post(API + "/users/{user_id}/facts/delete", summary="Delete the facts a filter selects",
             response_model=DeletedMany)
async def delete_many(user_id: str, body: DeleteBody, service: Service, caller: Admission
                      ) -> dict[str, Any]:
    """The owner's live facts of the scope passing the filter (at most ``limit``, lowest ids
    first), as one delete each; a scope or a filter is required (forget deletes everything)."""
    where = body.where
    if body.scope == ANY and where == EVERYTHING:
        raise HTTPException(400, "name a scope or a filter (DELETE /v1/memory/users/{user} "
                                 "forgets the owner)")
    scope = ops.named_scope(body.scope, where)
    caller.admit(user_id, scope, write=True)
    return {"deleted": await ops.delete_where(service, user_id, ops.within(body.scope, where),
                                              body.limit)}


@router.post(API + "/users/{user_id}/search", summary="Search as the server retrieves",
             response_model=Hits)
async def search(user_id: str, body: SearchBody, service: Service, caller: Admission
                 ) -> dict[str, Any]:
    """The owner's k live facts (of the agent / run given, passing the filter) nearest to the
    query, with their cosine similarity."""
    where = body.where
    caller.admit(user_id, ops.named_scope(body.scope, where))
    hits = await ops.search(service, user_id, body.query, body.k, body.scope, where)
    return {"hits": [{"id": h.id, "text": h.text, "score": 1.0 - h.distance,
                      "kv_encoded": h.kv_location is not None} for h in hits]}


@router.post(API + "/users/{user_id}/turns", status_code=202, summary="Add conversation turns",
             response_model=TurnsAdded)
async def add_turns(user_id: str, body: TurnsBody, service: Service, caller: Admission
                    ) -> dict[str, Any]:
    """Published to the turn topic (keyed by the owner, so in order); each turn is accepted or
    refused with the reason. Facts follow once a worker extracts them."""
    grant = caller.admit(user_id, None, write=True, cost=len(body.turns))
    accepted: list[TurnEvent] = []
    refused = []
    for i, raw in enumerate(body.turns):
        if raw.get("user_id", user_id) != user_id:
            refused.append({"index": i, "reason": "user_id differs from the path's"})
            continue
        scoped = {name: value for name, value in body.scope.items() if raw.get(name) is None}
        try:
            turn = TurnEvent.model_validate({**raw, **scoped, "user_id": user_id})
        except ValidationError as exc:
            refused.append({"index": i, "reason": exc.errors()[0]["msg"]})
            continue
        if not holds(grant, turn.scope):
            refused.append({"index": i, "reason": "this API key may not write that scope"})
            continue
        if len(turn.text.encode()) > service.settings.max_text_bytes:
            refused.append({"index": i, "reason": "text longer than max_text_bytes"})
            continue
        accepted.append(turn)
    await ops.publish_turns(service, accepted)
    event_id = await ops.record_event(service, user_id, accepted) if accepted else None
    return {"accepted": [t.turn_id for t in accepted], "refused": refused, "event_id": event_id}


@router.get(API + "/users/{user_id}/events/{event_id}", summary="How far an add has come",
            response_model=EventStatus)
async def event(user_id: str, event_id: Annotated[str, Path(pattern=ops.EVENT_ID_PATTERN)],
                service: Service, caller: Admission,
                wait: Annotated[float, Query(ge=0, le=ops.MAX_WAIT_S)] = 0.0) -> dict[str, Any]:
    """The stage of an add of turns or a fact (``queued``, ``stored``, ``extracted``,
    ``encoded``) and the facts it produced; with ``wait`` (seconds, up to 60), answered once it
    is encoded or the time is up, whichever comes first."""
    grant = caller.admit(user_id, None)
    if wait:
        with caller.waiting():
            progress = await ops.event_progress(service, grant, user_id, event_id, wait)
    else:
        progress = await ops.event_progress(service, grant, user_id, event_id, wait)
    return {**dataclasses.asdict(progress), "stage": progress.stage,
            "created_at": progress.created_at.isoformat(),
            "facts": [{"id": f.id, "live": f.live, "encoded": f.encoded,
                       "encode_error": f.encode_error} for f in progress.facts]}


@router.get(API + "/users/{user_id}/export", summary="Export an owner's memory (JSON Lines)",
            response_class=StreamingResponse,
            responses={200: {"content": {"application/x-ndjson": {}},
                             "description": "a header line, then every version of every fact"}})
async def export(user_id: str, service: Service, caller: Admission,
                 agent_id: ops.ScopeQuery = None, run_id: ops.ScopeQuery = None
                 ) -> StreamingResponse:
    """Every version of the owner's facts (of the agent / run given), oldest first, with their
    history and metadata, streamed from one snapshot (``contracts/memory_export.py``)."""
    scope = Scope(agent_id, run_id)
    caller.admit(user_id, scope)
    return StreamingResponse(ops.exported(service, user_id, scope),
                             media_type="application/x-ndjson")


@router.post(API + "/users/{user_id}/import", summary="Import records of an export",
             response_model=ImportedFacts)
async def import_facts(user_id: str, body: ImportBody, service: Service, caller: Admission
                       ) -> dict[str, Any]:
    """The records the owner does not hold yet, stored (served as text at once, injected once
    encoded: the event says when); importing the same records again adds nothing. Each
    record's scope must be one the key may write."""
    grant = caller.admit(user_id, None, write=True, cost=len(body.facts))
    if not all(holds(grant, Scope(r.agent_id, r.run_id)) for r in body.facts):
        raise HTTPException(403, "a record's scope is not one this API key may write")
    ops.check_pinning(grant, any(r.pinned for r in body.facts))
    imported = await ops.import_facts(service, user_id, body.header, body.facts)
    return {"imported": imported.ids, "skipped": imported.skipped,
            "event_id": await ops.record_event(service, user_id, fact_ids=imported.ids)}


@router.delete(API + "/users/{user_id}", summary="Forget an owner", response_model=Forgotten)
async def forget(user_id: str, service: Service, caller: Admission) -> dict[str, Any]:
    """Turns, facts, vectors and KV of the owner, from every tier and server, with a tombstone
    (``POST /v1/memory/forget`` does the same); keys limited to some agents or runs may not."""
    caller.admit(user_id, ANY, write=True)
    return await service.forget(user_id)


@router.post(API + "/forget", summary="Forget an owner (the owner in the body)",
             response_model=Forgotten)
async def forget_in_body(body: ForgetBody, service: Service, caller: Admission
                         ) -> dict[str, Any]:
    caller.admit(body.user, ANY, write=True)
    return await service.forget(body.user)


def memory_endpoints() -> list[object]:
    """The functions behind the memory API's routes, both dialects (``route_policy.py``)."""
    return [getattr(route, "endpoint", None) for route in (*router.routes,
                                                            *mem0_api.router.routes)]


def serve_memory(app: FastAPI, service: ops.MemoryService) -> None:
    """Serve the memory API (both dialects) on ``app`` with ``service``."""
    setattr(app.state, ops.STATE_KEY, service)
    app.include_router(router)
    app.include_router(mem0_api.router)
