"""What the memory API's routes share, whichever dialect they speak (``memory_api.py``, the
native one; ``mem0_api.py``, Mem0's): the service they run on and the caller's admission as
FastAPI dependencies, and the operations on an owner's facts (read, shown with their KV tiers,
added, edited, deleted) over that service.

Admission comes before any work: a route names the owner (and scope, and whether it writes) and
gets the key's grant or the refusal (401 / 403 / 429, ``access.py``); facts the key may not see
in its scope are answered as if they did not exist. An edit or a delete returns once the
database holds it and the old blobs have left the durable tier and this server's memory tiers
(every other server's through an invalidation: ``MemoryService.drop_blobs``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from types import EllipsisType
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, HTTPException, Query, Request
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.contracts.events import TurnEvent
from inferscale.contracts.filters import (
    EVERYTHING,
    AllOf,
    Condition,
    FilterError,
    Node,
    parse_filter,
    pinned,
)
from inferscale.contracts.memory_export import ExportedFact, ExportHeader, line
from inferscale.contracts.scope import (
    ANY,
    MAX_SCOPE_CHARS,
    SCOPE_FIELDS,
    SCOPE_PATTERN,
    Scope,
    is_owner_id,
    is_scope_value,
)
from inferscale.core.endpoints import InfraError, resolve_kafka_bootstrap
from inferscale.core.settings import KeyGrant, Settings
from inferscale.db import memory_edits, memory_events, memory_io
from inferscale.db.memory_edits import FactRecord
from inferscale.db.memory_events import EventProgress
from inferscale.db.reads import RetrievedFact
from inferscale.pipeline import kafka
from inferscale.serving.access import Access, holds
from inferscale.serving.compose import MemoryRuntime
from inferscale.serving.guards import FrontendError
from inferscale.serving.retrieval import retrieve

STATE_KEY = "inferscale_memory"  # the service's name on the app's state
MAX_WAIT_S = 60.0  # the longest a read of an event waits for it to be encoded
EVENT_ID_PATTERN = "^[0-9a-f]{32}$"  # an event id, as record_event makes them
POLL_S = 0.25
T = TypeVar("T")
# An owner, agent or run id as a query parameter.
ScopeQuery = Annotated[str | None, Query(min_length=1, max_length=MAX_SCOPE_CHARS,
                                         pattern=SCOPE_PATTERN)]


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


def memory_service(request: Request) -> MemoryService:
    """The service the app serves memory with (set by ``serve_memory``)."""
    service: MemoryService = getattr(request.app.state, STATE_KEY)
    return service


Service = Annotated[MemoryService, Depends(memory_service)]


def refusal(exc: FrontendError) -> HTTPException:
    return HTTPException(exc.status, exc.message, exc.headers or None)


@dataclass(frozen=True)
class Caller:
    """A request's credentials, admitted per owner by the routes."""

    access: Access
    headers: dict[str, str]  # lower-case keys
    client: str | None

    def admit(self, user_id: str, scope: Scope | None = ANY, write: bool = False,
              cost: int = 1) -> KeyGrant:
        """The key's grant, if it may act for the owner in ``scope`` (None: checked against
        each fact touched, with ``visible``), counted as ``cost`` requests; else the
        refusal."""
        if not is_owner_id(user_id):
            raise HTTPException(400, "owner ids are 1-256 characters, no control characters")
        try:
            return self.access.authorize(self.headers, user_id, scope=scope, write=write,
                                         client=self.client, cost=cost)
        except FrontendError as exc:
            raise refusal(exc) from None

    def missed(self) -> None:
        """Count a lookup of an id that is not the caller's (429 past its own limit)."""
        try:
            self.access.missed(self.headers, self.client)
        except FrontendError as exc:
            raise refusal(exc) from None

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Hold one of the caller's waiting slots (429 where none is free)."""
        try:
            with self.access.waiting(self.headers, self.client):
                yield
        except FrontendError as exc:
            raise refusal(exc) from None

    def admit_control(self) -> None:
        """Operator-only routes: an admin key, else the refusal."""
        try:
            self.access.authorize_control(self.headers, self.client)
        except FrontendError as exc:
            raise refusal(exc) from None

    def known(self) -> KeyGrant:
        """The key's grant before any owner is known (401 for no or an unknown key; counted in
        the rate limit); routes that learn the owner from what they read admit it with
        ``admit`` before answering."""
        try:
            return self.access.known(self.headers, self.client)
        except FrontendError as exc:
            raise refusal(exc) from None


def caller(request: Request, service: Service) -> Caller:
    return Caller(service.access, {k.lower(): v for k, v in request.headers.items()},
                  request.client.host if request.client else None)


Admission = Annotated[Caller, Depends(caller)]


def check_pinning(grant: KeyGrant, pinning: bool) -> None:
    """Pinning (or unpinning) needs a key that holds every scope: a pinned fact leads every
    memory prompt of its owner, whatever scope the prompt serves (403 otherwise)."""
    if pinning and (grant.agents is not None or grant.runs is not None):
        raise HTTPException(403, "pinning needs a key not limited to some agents or runs: a "
                                 "pinned fact leads every memory prompt of its owner")


def visible(grant: KeyGrant, record: FactRecord | None) -> FactRecord | None:
    """The fact where the key may act in its scope (else as if it did not exist)."""
    if record is None or not holds(grant, Scope(record.agent_id, record.run_id)):
        return None
    return record


async def in_transaction(service: MemoryService,
                         work: Callable[[AsyncConnection, str], Awaitable[T]]) -> T:
    """``work(conn, the served model's fingerprint)`` in one transaction."""
    rt = await service.runtime()
    async with rt.engine.begin() as conn:
        return await work(conn, rt.fingerprint)


async def live_fact(service: MemoryService, grant: KeyGrant, user_id: str, fact_id: int
                    ) -> FactRecord:
    """One live fact of the owner the key may see (404 otherwise)."""
    record = visible(grant, await in_transaction(
        service, lambda conn, model: memory_edits.get_fact(conn, user_id, model, fact_id)))
    if record is None:
        raise HTTPException(404, f"{user_id!r} has no live fact {fact_id}")
    return record


async def shown(service: MemoryService, records: list[FactRecord]) -> list[dict[str, Any]]:
    """The records as JSON, each with the tiers holding its KV on this server."""
    held_in = await service.memory_tiers([r.kv_location for r in records if r.kv_location])
    tiers = iter(held_in or [])
    return [r.as_json(next(tiers, None) if r.kv_location else None) for r in records]


async def embed(service: MemoryService, text: str) -> list[float]:
    """The text's embedding, computed off the event loop."""
    rt = await service.runtime()
    vector = (await asyncio.get_running_loop().run_in_executor(
        None, rt.embedder.encode, [text]))[0]
    return [float(x) for x in vector]


async def add_fact(service: MemoryService, user_id: str, text: str, scope: Scope,
                   conversation_id: str, metadata: dict[str, Any] | None = None,
                   ts: datetime | None = None, expires_at: datetime | None = None,
                   pinned: bool = False) -> FactRecord:
    """A fact given directly (no source turn; said at ``ts``, None: now; never served from
    ``expires_at`` on; ``pinned``: in every memory prompt of the owner): served as text at
    once, injected once a worker encodes it."""
    embedding = await embed(service, text)
    with _pinning():
        return await in_transaction(service, lambda conn, model: memory_edits.add_fact(
            conn, user_id, model, conversation_id, text, ts or datetime.now(UTC), embedding,
            scope, metadata, expires_at, pinned, service.settings.pinned_max))


async def edit_fact(service: MemoryService, grant: KeyGrant, user_id: str, fact_id: int,
                    text: str | None, metadata: dict[str, Any] | None = None,
                    expiry: datetime | None | EllipsisType = ..., pinned: bool | None = None
                    ) -> FactRecord:
    """A new version of the fact (new text, metadata, expiry and / or pinning; None, ``...``
    for the expiry: the old one's) replaces it; the old one is never served again once this
    returns (its blobs dropped everywhere)."""
    await live_fact(service, grant, user_id, fact_id)
    embedding = None if text is None else await embed(service, text)
    with _pinning():
        edited = await in_transaction(service, lambda conn, model: memory_edits.edit_fact(
            conn, user_id, model, fact_id, text, embedding, metadata, expiry, pinned,
            service.settings.pinned_max))
    if edited is None:
        raise HTTPException(404, f"{user_id!r} has no live fact {fact_id}")
    record, locations = edited
    await service.drop_blobs(user_id, locations)
    return record


@contextmanager
def _pinning() -> Iterator[None]:
    """An owner at its ``pinned_max`` pinned facts: 409, naming the limit."""
    try:
        yield
    except memory_edits.PinnedLimit as exc:
        raise HTTPException(409, str(exc)) from None


async def delete_where(service: MemoryService, user_id: str, where: Node, limit: int
                       ) -> list[int]:
    """Retire the owner's live facts passing ``where`` (at most ``limit``); their blobs leave
    every tier. The caller admitted a key that may act on every fact the filter can select."""
    ids, locations = await in_transaction(
        service, lambda conn, _: memory_edits.delete_facts(conn, user_id, where, limit))
    await service.drop_blobs(user_id, locations)
    return ids


async def delete_fact(service: MemoryService, grant: KeyGrant, user_id: str, fact_id: int
                      ) -> None:
    """Retire one live fact of the owner (404 where there is none the key may see)."""
    await live_fact(service, grant, user_id, fact_id)
    deleted, locations = await in_transaction(
        service, lambda conn, _: memory_edits.delete_fact(conn, user_id, fact_id))
    if not deleted:
        raise HTTPException(404, f"{user_id!r} has no live fact {fact_id}")
    await service.drop_blobs(user_id, locations)


async def search(service: MemoryService, user_id: str, query: str, k: int, scope: Scope,
                 where: Node) -> list[RetrievedFact]:
    """The owner's k facts nearest the query as the server retrieves them (``retrieve``); a
    filter too costly for the owner is the route's 413."""
    rt = await service.runtime()
    try:
        return await retrieve(rt.index, rt.embedder, user_id, query, k, scope, where)
    except FrontendError as exc:
        raise refusal(exc) from None


def named_scope(scope: Scope, where: Node) -> Scope:
    """The scope a request names: its own fields, else those its filter pins by equality (a
    pinned value no fact could hold names nothing)."""
    pins = pinned(where)
    fields = {name: getattr(scope, name) or pins.get(name) for name in SCOPE_FIELDS}
    return Scope(**{name: value for name, value in fields.items()
                    if value is not None and is_scope_value(value)})


def within(scope: Scope, where: Node) -> Node:
    """``where`` and the scope's fields as equalities: one filter."""
    conditions = tuple(Condition("id", name, "eq", value) for name, value in scope.items())
    return AllOf((*conditions, where)) if conditions else where


def parsed(raw: object) -> Node:
    """A filter as a tree (400 naming what is refused; None: no filter)."""
    if raw is None:
        return EVERYTHING
    try:
        return parse_filter(raw)
    except FilterError as exc:
        raise HTTPException(400, f"filters: {exc}") from None


async def publish_turns(service: MemoryService, turns: list[TurnEvent]) -> None:
    """Publish turns to the turn topic (keyed by owner, so in order); 503 where there is no
    broker to publish to."""
    if not turns:
        return
    settings = service.settings
    try:
        bootstrap = resolve_kafka_bootstrap(settings)
    except InfraError as exc:
        raise HTTPException(503, f"no turn topic to publish to: {exc}") from None
    security = kafka.kafka_security(settings)
    await kafka.ensure_topics(bootstrap, [settings.turns_topic], security=security)
    await kafka.publish_turns(bootstrap, settings.turns_topic, turns, progress=False,
                              security=security)


async def record_event(service: MemoryService, user_id: str,
                       turns: list[TurnEvent] | None = None, fact_ids: list[int] | None = None
                       ) -> str:
    """The id of a new event for turns published and facts stored by one add."""
    pairs = [(t.conversation_id, t.turn_id) for t in turns or []]
    return await in_transaction(service, lambda conn, _: memory_events.record_event(
        conn, user_id, pairs, fact_ids or []))


async def event_progress(service: MemoryService, grant: KeyGrant, user_id: str, event_id: str,
                         wait_s: float = 0.0) -> EventProgress:
    """How far the owner's event has come, waiting up to ``wait_s`` for it to be encoded
    (404: no such event of the owner); only facts the key may see are listed."""
    deadline = asyncio.get_running_loop().time() + min(wait_s, MAX_WAIT_S)
    while True:
        progress = await in_transaction(service, lambda conn, model: (
            memory_events.event_progress(conn, user_id, event_id, model)))
        if progress is None:
            raise HTTPException(404, f"{user_id!r} has no event {event_id}")
        if progress.stage == "encoded" or asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(POLL_S)
    shown = [f for f in progress.facts if holds(grant, Scope(f.agent_id, f.run_id))]
    return dataclasses.replace(progress, facts=shown)


async def exported(service: MemoryService, user_id: str, scope: Scope) -> AsyncIterator[bytes]:
    """The owner's memory in ``scope`` as JSON Lines (``contracts/memory_export.py``), read from
    one snapshot (a page of facts per chunk)."""
    rt = await service.runtime()
    async with rt.engine.connect() as conn:
        snapshot = await conn.execution_options(isolation_level="REPEATABLE READ")
        async with snapshot.begin():
            yield line(ExportHeader(user_id=user_id, origin=await memory_io.origin(snapshot),
                                    exported_at=datetime.now(UTC), agent_id=scope.agent_id,
                                    run_id=scope.run_id))
            async for page in memory_io.export_pages(snapshot, user_id, scope):
                yield b"".join(line({name: value.isoformat() if isinstance(value, datetime)
                                     else value for name, value in row.items()})
                               for row in page)


async def import_facts(service: MemoryService, user_id: str, header: ExportHeader,
                       records: list[ExportedFact]) -> memory_io.Imported:
    """Store the records the owner does not hold yet (embedded off the event loop)."""
    rt = await service.runtime()
    vectors = await asyncio.get_running_loop().run_in_executor(
        None, rt.embedder.encode, [r.text for r in records])
    embeddings = [[float(x) for x in vector] for vector in vectors]
    return await in_transaction(service, lambda conn, _: memory_io.import_facts(
        conn, user_id, header, records, embeddings))
