"""The memory API: an owner's facts listed, read, searched, edited, deleted and their history;
turns added (to the turn topic: the worker path stays the one way in); an owner forgotten.

Routes live in vLLM's own FastAPI app (``MemoryFrontend`` adds the router at start-up), so
they are in the server's ``/openapi.json``; ``GET /memory`` serves the memory inspector page
(``static/inspector.html``, with a content security policy), which calls them. Every route is
admitted by ``access.py`` as chat requests are: a key that may act for the owner (and, for a
scoped key, in the scope read or the fact's own scope; for changes, a key that may write); the
browser rules (``browser_guard.py``) ran before any route. An edit or delete returns once the
database holds it: from then on no server serves the old text (retrieval reads only live facts
and every server checks the owner's memory version per request) nor the old KV (a plan names
only live facts); the old blob leaves the durable tier and this server's memory tiers before
the response, every other server's through an invalidation record (a blob an encode records
after the edit is removed by that worker: ``db/encode_queue.record_encoded``). Listing and
search take a scope filter (``agent_id``, ``run_id``: ``contracts/scope.py``), as chat requests
do; turns and operator facts may carry a scope.
"""

import asyncio
import base64
import binascii
import importlib.resources
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferscale.contracts.events import TurnEvent
from inferscale.contracts.scope import (
    ANY,
    MAX_SCOPE_CHARS,
    SCOPE_PATTERN,
    OwnerId,
    Scope,
    ScopeValue,
    is_owner_id,
)
from inferscale.core.settings import KeyGrant, Settings
from inferscale.db.memory_edits import FactRecord
from inferscale.serving.access import Access, holds
from inferscale.serving.browser_guard import page_headers
from inferscale.serving.compose import MemoryRuntime
from inferscale.serving.guards import FrontendError

MAX_PAGE = 500
MAX_FACT_CHARS = 4000
MAX_SEARCH_K = 100
MAX_TURNS = 1000
FactId = Annotated[int, Path(ge=1, le=2**63 - 1)]  # a bigint
ScopeQuery = Annotated[str | None, Query(min_length=1, max_length=MAX_SCOPE_CHARS,
                                         pattern=SCOPE_PATTERN)]
API = "/v1/memory"
INSPECTOR_PATH = "/memory"  # outside /v1: a browser opens it without a bearer header
INSPECTOR_HTML = (importlib.resources.files("inferscale.serving") / "static" / "inspector.html"
                  ).read_text(encoding="utf-8")
INSPECTOR_HEADERS = page_headers(
    INSPECTOR_HTML.split("<script>", 1)[1].split("</script>", 1)[0])


class MemoryService(Protocol):
    """What the routes need of the server they run in."""

    settings: Settings
    access: Access

    async def runtime(self) -> MemoryRuntime: ...

    async def drop_blobs(self, user_id: str, locations: list[str]) -> int:
        """Remove retired facts' blobs from the durable tier and every server's memory tiers;
        returns how many this server's tiers held."""
        ...

    async def forget(self, user_id: str) -> dict[str, Any]: ...

    async def memory_tiers(self, locations: list[str]) -> list[list[str]] | None:
        """For each blob, this server's memory tiers that hold it (None: not known now)."""
        ...


class FactText(BaseModel):
    """A fact's new text."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=MAX_FACT_CHARS)


class Scoped(BaseModel):
    """An agent and / or run: the facts' scope, or a filter (None: any)."""

    model_config = ConfigDict(extra="forbid")
    agent_id: ScopeValue | None = None
    run_id: ScopeValue | None = None

    @property
    def scope(self) -> Scope:
        return Scope(self.agent_id, self.run_id)


class NewFactBody(FactText, Scoped):
    """A fact an operator adds directly (no source turn), in a scope."""

    conversation_id: str = Field(default="operator", min_length=1, max_length=256)


class SearchBody(Scoped):
    """A query, retrieved as a chat request of the owner would be (in the scope given)."""

    query: str = Field(min_length=1, max_length=MAX_FACT_CHARS)
    k: int = Field(default=10, ge=1, le=MAX_SEARCH_K)


class ForgetBody(BaseModel):
    """``POST /v1/memory/forget``: the owner to forget."""

    model_config = ConfigDict(extra="forbid")
    user: OwnerId


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


def build_router(service: MemoryService) -> APIRouter:
    """The memory API's routes, served by ``service``'s server."""
    router = APIRouter(tags=["memory"])

    @router.get(INSPECTOR_PATH, include_in_schema=False)
    async def inspector() -> HTMLResponse:
        """The memory inspector page (static; it calls the routes below with its key)."""
        return HTMLResponse(INSPECTOR_HTML, headers=INSPECTOR_HEADERS)

    def admit(request: Request, user_id: str, scope: Scope | None = ANY,
              write: bool = False) -> KeyGrant:
        """The caller's grant, if it may act for the owner in ``scope`` (None: checked against
        each fact touched); else the refusal."""
        if not is_owner_id(user_id):
            raise HTTPException(400, "owner ids are 1-256 characters, no control characters")
        headers = {k.lower(): v for k, v in request.headers.items()}
        client = request.client.host if request.client else None
        try:
            return service.access.authorize(headers, user_id, scope=scope, write=write,
                                            client=client)
        except FrontendError as exc:
            raise HTTPException(exc.status, exc.message, exc.headers or None) from None

    def held(grant: KeyGrant, record: FactRecord | None) -> FactRecord | None:
        """The fact where the key may act in its scope (else as if it did not exist)."""
        if record is None or not holds(grant, Scope(record.agent_id, record.run_id)):
            return None
        return record

    async def in_transaction(work: Callable[[Any, str], Awaitable[Any]]) -> Any:
        """``work(conn, the served model's fingerprint)`` in one transaction."""
        rt = await service.runtime()
        async with rt.engine.begin() as conn:
            return await work(conn, rt.fingerprint)

    async def live_fact(grant: KeyGrant, user_id: str, fact_id: int) -> FactRecord:
        from inferscale.db.memory_edits import get_fact as read

        record = held(grant, await in_transaction(
            lambda conn, model: read(conn, user_id, model, fact_id)))
        if record is None:
            raise HTTPException(404, f"{user_id!r} has no live fact {fact_id}")
        return record

    async def shown(records: list[FactRecord]) -> list[dict[str, Any]]:
        """The records as JSON, each with the tiers holding its KV on this server."""
        held_in = await service.memory_tiers([r.kv_location for r in records if r.kv_location])
        tiers = iter(held_in or [])
        return [r.as_json(next(tiers, None) if r.kv_location else None) for r in records]

    async def embed(text: str) -> list[float]:
        rt = await service.runtime()
        vector = (await asyncio.get_running_loop().run_in_executor(
            None, rt.embedder.encode, [text]))[0]
        return [float(x) for x in vector]

    @router.get(API + "/users/{user_id}/facts", summary="List an owner's live facts")
    async def list_facts(user_id: str, request: Request,
                         limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
                         cursor: Annotated[str | None, Query(max_length=200)] = None,
                         agent_id: ScopeQuery = None, run_id: ScopeQuery = None
                         ) -> dict[str, Any]:
        """Live facts (of the agent / run given) in id order with provenance and KV status;
        ``next_cursor`` continues."""
        from inferscale.db.memory_edits import list_facts as read

        scope = Scope(agent_id, run_id)
        admit(request, user_id, scope)
        records = await in_transaction(
            lambda conn, model: read(conn, user_id, model, _after(cursor), limit, scope))
        return {"facts": await shown(records),
                "next_cursor": _cursor(records[-1].id) if len(records) == limit else None}

    @router.get(API + "/users/{user_id}/facts/{fact_id}", summary="One live fact")
    async def get_fact(user_id: str, fact_id: FactId, request: Request) -> dict[str, Any]:
        grant = admit(request, user_id, None)
        return (await shown([await live_fact(grant, user_id, fact_id)]))[0]

    @router.get(API + "/users/{user_id}/facts/{fact_id}/history", summary="Every version of a fact")
    async def history(user_id: str, fact_id: FactId, request: Request) -> dict[str, Any]:
        """The fact's versions, oldest first, each with the turns it came from."""
        from inferscale.db.memory_edits import fact_history

        grant = admit(request, user_id, None)
        versions = await in_transaction(
            lambda conn, model: fact_history(conn, user_id, model, fact_id))
        if not versions or held(grant, versions[-1]) is None:
            raise HTTPException(404, f"{user_id!r} has no fact {fact_id}")
        return {"versions": await shown(versions)}

    @router.post(API + "/users/{user_id}/facts", status_code=201, summary="Add a fact (operators)")
    async def add_fact(user_id: str, body: NewFactBody, request: Request) -> dict[str, Any]:
        """A fact given directly, with no source turn: admin keys only. Served as text at once,
        injected once a worker encodes it."""
        from datetime import UTC, datetime

        from inferscale.db.memory_edits import add_fact as store

        admit(request, user_id, body.scope, write=True)
        try:
            service.access.authorize_control({k.lower(): v for k, v in request.headers.items()})
        except FrontendError as exc:
            raise HTTPException(exc.status, exc.message) from None
        embedding = await embed(body.text)
        record = await in_transaction(lambda conn, model: store(
            conn, user_id, model, body.conversation_id, body.text, datetime.now(UTC), embedding,
            body.scope))
        return dict(record.as_json())

    @router.patch(API + "/users/{user_id}/facts/{fact_id}", summary="Edit a fact's text")
    async def edit(user_id: str, fact_id: FactId, body: FactText, request: Request
                   ) -> dict[str, Any]:
        """A new version of the fact replaces it (served as text until it is encoded); the old
        version is never served again by any server once this returns."""
        from inferscale.db.memory_edits import edit_fact

        await live_fact(admit(request, user_id, None, write=True), user_id, fact_id)
        embedding = await embed(body.text)
        edited = await in_transaction(
            lambda conn, model: edit_fact(conn, user_id, model, fact_id, body.text, embedding))
        if edited is None:
            raise HTTPException(404, f"{user_id!r} has no live fact {fact_id}")
        record, locations = edited
        await service.drop_blobs(user_id, locations)
        return {**record.as_json(), "replaces": fact_id}

    @router.delete(API + "/users/{user_id}/facts/{fact_id}", summary="Delete one fact")
    async def delete(user_id: str, fact_id: FactId, request: Request) -> dict[str, Any]:
        from inferscale.db.memory_edits import delete_fact

        await live_fact(admit(request, user_id, None, write=True), user_id, fact_id)
        deleted, locations = await in_transaction(
            lambda conn, _: delete_fact(conn, user_id, fact_id))
        if not deleted:
            raise HTTPException(404, f"{user_id!r} has no live fact {fact_id}")
        await service.drop_blobs(user_id, locations)
        return {"id": fact_id, "deleted": True}

    @router.post(API + "/users/{user_id}/search", summary="Search as the server retrieves")
    async def search(user_id: str, body: SearchBody, request: Request) -> dict[str, Any]:
        """The owner's k live facts (of the agent / run given) nearest to the query, with their
        cosine similarity."""
        from inferscale.serving.retrieval import retrieve

        admit(request, user_id, body.scope)
        rt = await service.runtime()
        hits = await retrieve(rt.index, rt.embedder, user_id, body.query, body.k, body.scope)
        return {"hits": [{"id": h.id, "text": h.text, "score": 1.0 - h.distance,
                          "kv_encoded": h.kv_location is not None} for h in hits]}

    @router.post(API + "/users/{user_id}/turns", status_code=202, summary="Add conversation turns")
    async def add_turns(user_id: str, body: TurnsBody, request: Request) -> dict[str, Any]:
        """Published to the turn topic (keyed by the owner, so in order); each turn is
        accepted or refused with the reason. Facts follow once a worker extracts them."""
        from inferscale.core.endpoints import InfraError, resolve_kafka_bootstrap
        from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns

        grant = admit(request, user_id, None, write=True)
        accepted: list[TurnEvent] = []
        refused = []
        for i, raw in enumerate(body.turns):
            if raw.get("user_id", user_id) != user_id:
                refused.append({"index": i, "reason": "user_id differs from the path's"})
                continue
            scoped = {name: value for name, value in body.scope.items()
                      if raw.get(name) is None}
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
        if accepted:
            try:
                bootstrap = resolve_kafka_bootstrap(service.settings)
            except InfraError as exc:
                raise HTTPException(503, f"no turn topic to publish to: {exc}") from None
            security = kafka_security(service.settings)
            await ensure_topics(bootstrap, [service.settings.turns_topic], security=security)
            await publish_turns(bootstrap, service.settings.turns_topic, accepted,
                                progress=False, security=security)
        return {"accepted": [t.turn_id for t in accepted], "refused": refused}

    @router.delete(API + "/users/{user_id}", summary="Forget an owner")
    async def forget(user_id: str, request: Request) -> dict[str, Any]:
        """Turns, facts, vectors and KV of the owner, from every tier and server, with a
        tombstone (``POST /v1/memory/forget`` does the same); keys limited to some agents or
        runs may not."""
        admit(request, user_id, ANY, write=True)
        return await service.forget(user_id)

    @router.post(API + "/forget", summary="Forget an owner (the owner in the body)")
    async def forget_in_body(body: ForgetBody, request: Request) -> dict[str, Any]:
        admit(request, body.user, ANY, write=True)
        return await service.forget(body.user)

    return router
