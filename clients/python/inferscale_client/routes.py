"""The memory API's requests, one builder per route, each with how its response is read.

Both clients (``memory_client.py``) send these; only how they are sent differs. Owner ids are
quoted into the path whatever they hold; the server validates them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from types import EllipsisType
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from pydantic import TypeAdapter

from inferscale_client.results import (
    Deleted,
    Event,
    Fact,
    FactPage,
    Forgotten,
    Imported,
    SearchHit,
    TurnsAdded,
)

T = TypeVar("T")
API = "/v1/memory"
MAX_IMPORT = 1000  # records per import request (the server's bound)
_HITS = TypeAdapter(list[SearchHit])
_VERSIONS = TypeAdapter(list[Fact])


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and the reader of its 2xx body."""

    method: str
    path: str
    read: Callable[[Any], T]
    params: dict[str, Any] = field(default_factory=dict)
    body: dict[str, Any] | None = None
    wait_s: float = 0.0  # how long the server may hold the answer back (added to the timeout)


def _user(user: str) -> str:
    """The owner's path: its id as one segment, dots escaped too (``..`` names an owner, never
    the parent path)."""
    return f"{API}/users/{quote(user, safe='').replace('.', '%2E')}"


def _scope(agent_id: str | None, run_id: str | None) -> dict[str, str]:
    return {name: value for name, value in (("agent_id", agent_id), ("run_id", run_id))
            if value is not None}


def list_facts(user: str, limit: int, cursor: str | None, agent_id: str | None = None,
               run_id: str | None = None, filters: dict[str, Any] | None = None
               ) -> Call[FactPage]:
    params: dict[str, Any] = {"limit": limit, **_scope(agent_id, run_id)}
    if cursor is not None:
        params["cursor"] = cursor
    if filters is not None:
        params["filters"] = json.dumps(filters)
    return Call("GET", f"{_user(user)}/facts", FactPage.model_validate, params)


def get_fact(user: str, fact_id: int) -> Call[Fact]:
    return Call("GET", f"{_user(user)}/facts/{int(fact_id)}", Fact.model_validate)


def history(user: str, fact_id: int) -> Call[list[Fact]]:
    return Call("GET", f"{_user(user)}/facts/{int(fact_id)}/history",
                lambda body: _VERSIONS.validate_python(body["versions"]))


def _given(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


def search(user: str, query: str, k: int, agent_id: str | None = None,
           run_id: str | None = None, filters: dict[str, Any] | None = None
           ) -> Call[list[SearchHit]]:
    return Call("POST", f"{_user(user)}/search",
                lambda body: _HITS.validate_python(body["hits"]),
                body={"query": query, "k": k, **_scope(agent_id, run_id),
                      **_given(filters=filters)})


def add_fact(user: str, text: str, conversation_id: str, agent_id: str | None = None,
             run_id: str | None = None, metadata: dict[str, Any] | None = None,
             expires_at: datetime | None = None, pinned: bool = False) -> Call[Fact]:
    return Call("POST", f"{_user(user)}/facts", Fact.model_validate,
                body={"text": text, "conversation_id": conversation_id,
                      **_scope(agent_id, run_id), **_given(metadata=metadata),
                      **_given(expires_at=expires_at and expires_at.isoformat()),
                      **({"pinned": True} if pinned else {})})


def edit_fact(user: str, fact_id: int, text: str | None,
              metadata: dict[str, Any] | None = None,
              expires_at: datetime | None | EllipsisType = ...,
              pinned: bool | None = None) -> Call[Fact]:
    """``expires_at``: ``...`` keeps the fact's, None: never expires; ``pinned`` None: as
    it was."""
    expiry = {} if expires_at is ... else {
        "expires_at": expires_at.isoformat() if expires_at else None}
    return Call("PATCH", f"{_user(user)}/facts/{int(fact_id)}", Fact.model_validate,
                body={**_given(text=text, metadata=metadata, pinned=pinned), **expiry})


def delete_fact(user: str, fact_id: int) -> Call[Deleted]:
    return Call("DELETE", f"{_user(user)}/facts/{int(fact_id)}", Deleted.model_validate)


def delete_facts(user: str, filters: dict[str, Any] | None, agent_id: str | None = None,
                 run_id: str | None = None, limit: int | None = None) -> Call[list[int]]:
    return Call("POST", f"{_user(user)}/facts/delete", lambda body: list(body["deleted"]),
                body={**_scope(agent_id, run_id), **_given(filters=filters, limit=limit)})


def add_turns(user: str, turns: list[dict[str, Any]], agent_id: str | None = None,
              run_id: str | None = None) -> Call[TurnsAdded]:
    return Call("POST", f"{_user(user)}/turns", TurnsAdded.model_validate,
                body={"turns": turns, **_scope(agent_id, run_id)})


def event(user: str, event_id: str, wait: float) -> Call[Event]:
    return Call("GET", f"{_user(user)}/events/{quote(event_id, safe='')}", Event.model_validate,
                {"wait": wait}, wait_s=max(0.0, wait))


def export(user: str, agent_id: str | None = None, run_id: str | None = None) -> Call[None]:
    """The owner's memory as JSON Lines (streamed: the body is read line by line)."""
    return Call("GET", f"{_user(user)}/export", lambda _: None, _scope(agent_id, run_id))


def import_records(user: str, header: dict[str, Any], facts: list[dict[str, Any]]
                   ) -> Call[Imported]:
    return Call("POST", f"{_user(user)}/import", Imported.model_validate,
                body={"header": header, "facts": facts})


def forget(user: str) -> Call[Forgotten]:
    return Call("DELETE", _user(user), Forgotten.model_validate)
