"""The memory API of one server over HTTP, blocking (``MemoryClient``) and asyncio
(``AsyncMemoryClient``), with typed results (``results.py``).

>>> with MemoryClient("http://127.0.0.1:8000", api_key="...") as memory:
...     page = memory.list_facts("alice")
...     memory.edit_fact("alice", page.facts[0].id, "Alice moved to Lisbon in May 2025.")

Both build the same requests (``routes.py``). A refused request raises ``MemoryAPIError`` with
the server's status and message; a 429 (and a 503 of a read or delete) is sent again up to
``retries`` times, after the server's ``Retry-After`` (``retry_policy``, with tenacity). With
no ``api_key`` they send ``INFERSCALE_API_KEY``, or for a server on this machine the local admin key
(``keys.py``; ``data_dir``: where it is).
``agent_id`` / ``run_id`` scope what a call writes and filter what it reads (None: any).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from datetime import datetime
from itertools import islice
from pathlib import Path
from types import EllipsisType
from typing import Any, TypeVar

import httpx
from tenacity import AsyncRetrying, RetryCallState, Retrying, retry_if_result, stop_after_attempt

from inferscale_client import routes
from inferscale_client.keys import key_for
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


class MemoryAPIError(Exception):
    """The server refused a request: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _read(response: httpx.Response, call: routes.Call[T]) -> T:
    if response.status_code >= 400:
        try:
            payload = response.json()
            detail = payload.get("detail") or payload.get("error", {}).get("message")
        except (ValueError, AttributeError):
            detail = None
        raise MemoryAPIError(response.status_code, str(detail or response.text))
    return call.read(response.json())


def _header(record: dict[str, Any] | None) -> dict[str, Any]:
    if not isinstance(record, dict) or "origin" not in record:
        raise ValueError("an export's records start with its header")
    return record


def _chunks(records: Iterator[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """The records, ``MAX_IMPORT`` at a time."""
    while chunk := list(islice(records, routes.MAX_IMPORT)):
        yield chunk


def _headers(base_url: str, api_key: str | None, data_dir: Path | None) -> dict[str, str]:
    key = api_key if api_key is not None else key_for(base_url, data_dir)
    return {"authorization": f"Bearer {key}"} if key else {}


RETRIED = {429: None, 503: frozenset({"GET", "DELETE"})}  # status -> methods (None: every one)


def retry_policy(method: str, retries: int, max_wait_s: float) -> dict[str, Any]:
    """tenacity's arguments for sending a ``method`` request again: after a 429 (refused before
    anything was done) for every method, after a 503 for reads and deletes (repeating them
    changes nothing), at most ``retries`` times; waiting the server's ``Retry-After`` seconds
    where it gives them, else 0.5 s doubling, never more than ``max_wait_s``. Once the retries
    are spent the last response is the answer; a failure to connect is not retried."""
    def again(response: httpx.Response) -> bool:
        methods = RETRIED.get(response.status_code, frozenset())
        return methods is None or method in methods

    def wait(state: RetryCallState) -> float:
        assert state.outcome is not None
        try:
            seconds = float(state.outcome.result().headers["retry-after"])
        except (KeyError, ValueError):
            seconds = 0.5 * 2 ** (state.attempt_number - 1)
        return min(max(seconds, 0.0), max_wait_s)

    def last_response(state: RetryCallState) -> httpx.Response:
        assert state.outcome is not None
        return state.outcome.result()

    return {"retry": retry_if_result(again), "wait": wait,
            "stop": stop_after_attempt(retries + 1), "retry_error_callback": last_response}


def _waiting(timeout: httpx.Timeout, call: routes.Call[Any]) -> httpx.Timeout:
    """The client's timeout, its read longer by the time the server may wait before answering."""
    if not call.wait_s or timeout.read is None:
        return timeout
    return httpx.Timeout(timeout.connect, read=timeout.read + call.wait_s, write=timeout.write,
                         pool=timeout.pool)


class MemoryClient:
    """The memory API of one server, over HTTP (blocking)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0,
                 transport: httpx.BaseTransport | None = None, data_dir: Path | None = None,
                 retries: int = 3, max_wait_s: float = 10.0):
        self._http = httpx.Client(base_url=base_url.rstrip("/"),
                                  headers=_headers(base_url, api_key, data_dir), timeout=timeout,
                                  transport=transport)
        self._retries, self._max_wait_s = retries, max_wait_s

    def _send(self, call: routes.Call[T]) -> T:
        retrying = Retrying(sleep=lambda seconds: time.sleep(seconds),
                            **retry_policy(call.method, self._retries, self._max_wait_s))
        return _read(retrying(self._http.request, call.method, call.path, params=call.params,
                              json=call.body, timeout=_waiting(self._http.timeout, call)), call)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def list_facts(self, user: str, limit: int = 50, cursor: str | None = None,
                   agent_id: str | None = None, run_id: str | None = None,
                   filters: dict[str, Any] | None = None) -> FactPage:
        """One page of the owner's live facts (passing ``filters``) and the cursor of the next
        (None: the last)."""
        return self._send(routes.list_facts(user, limit, cursor, agent_id, run_id, filters))

    def iter_facts(self, user: str, page: int = 200, agent_id: str | None = None,
                   run_id: str | None = None, filters: dict[str, Any] | None = None
                   ) -> Iterator[Fact]:
        """Every live fact of the owner (passing ``filters``), page by page."""
        cursor = None
        while True:
            result = self.list_facts(user, page, cursor, agent_id, run_id, filters)
            yield from result.facts
            if (cursor := result.next_cursor) is None:
                return

    def get_fact(self, user: str, fact_id: int) -> Fact:
        return self._send(routes.get_fact(user, fact_id))

    def history(self, user: str, fact_id: int) -> list[Fact]:
        """The fact's versions, oldest first."""
        return self._send(routes.history(user, fact_id))

    def search(self, user: str, query: str, k: int = 10, agent_id: str | None = None,
               run_id: str | None = None, filters: dict[str, Any] | None = None
               ) -> list[SearchHit]:
        """The owner's k facts the server would retrieve for ``query`` (passing ``filters``,
        the filter language of the API), with scores."""
        return self._send(routes.search(user, query, k, agent_id, run_id, filters))

    def add_fact(self, user: str, text: str, conversation_id: str = "operator",
                 agent_id: str | None = None, run_id: str | None = None,
                 metadata: dict[str, Any] | None = None, expires_at: datetime | None = None,
                 pinned: bool = False) -> Fact:
        """A fact given directly (no source turn), by a key that may write the owner's scope,
        never served from ``expires_at`` (aware) on, ``pinned``: in every memory prompt of
        the owner, first; its ``event_id`` says when it is encoded."""
        return self._send(routes.add_fact(user, text, conversation_id, agent_id, run_id,
                                          metadata, expires_at, pinned))

    def edit_fact(self, user: str, fact_id: int, text: str | None = None,
                  metadata: dict[str, Any] | None = None,
                  expires_at: datetime | None | EllipsisType = ...,
                  pinned: bool | None = None) -> Fact:
        """The new version of the fact (new text, metadata, expiry and / or pinning:
        ``...`` keeps the old expiry, None never expires; ``pinned`` None keeps it; a new id,
        ``replaces`` the old one, now retired)."""
        return self._send(routes.edit_fact(user, fact_id, text, metadata, expires_at, pinned))

    def delete_fact(self, user: str, fact_id: int) -> Deleted:
        return self._send(routes.delete_fact(user, fact_id))

    def delete_facts(self, user: str, filters: dict[str, Any] | None,
                     agent_id: str | None = None, run_id: str | None = None,
                     limit: int | None = None) -> list[int]:
        """Delete the owner's live facts of the scope passing ``filters`` (a scope or a filter
        is required; at most ``limit``, lowest ids first): the ids retired."""
        return self._send(routes.delete_facts(user, filters, agent_id, run_id, limit))

    def add_turns(self, user: str, turns: list[dict[str, Any]], agent_id: str | None = None,
                  run_id: str | None = None) -> TurnsAdded:
        """Publish turns (``conversation_id``, ``turn_id``, ``speaker``, ``text``,
        ``timestamp`` each; a turn's own ``agent_id`` / ``run_id`` win over the call's): which
        were accepted, which refused and why, and the event that says how far they came."""
        return self._send(routes.add_turns(user, turns, agent_id, run_id))

    def event(self, user: str, event_id: str, wait: float = 0.0) -> Event:
        """How far an add has come; with ``wait`` (seconds, up to 60) the server answers once
        it is ``encoded`` or the time is up: read your own writes with ``wait``."""
        return self._send(routes.event(user, event_id, wait))

    def export(self, user: str, agent_id: str | None = None, run_id: str | None = None
               ) -> Iterator[dict[str, Any]]:
        """The owner's memory as records, streamed: the header first, then every version of
        every fact, oldest first (write them one JSON object per line to keep a file)."""
        call = routes.export(user, agent_id, run_id)
        with self._http.stream(call.method, call.path, params=call.params) as response:
            if response.status_code >= 400:
                response.read()
                _read(response, call)
            for raw in response.iter_lines():
                if raw:
                    yield json.loads(raw)

    def import_records(self, user: str, records: Iterable[dict[str, Any]]) -> list[Imported]:
        """Import an export's records (its header first) into ``user``, ``MAX_IMPORT`` facts
        a request; records the owner holds already are skipped, so a failed import can be
        run again."""
        stream = iter(records)
        header = _header(next(stream, None))
        return [self._send(routes.import_records(user, header, chunk))
                for chunk in _chunks(stream)]

    def forget(self, user: str) -> Forgotten:
        return self._send(routes.forget(user))


class AsyncMemoryClient:
    """The memory API of one server, over HTTP (asyncio); the same methods as
    ``MemoryClient``."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 data_dir: Path | None = None, retries: int = 3, max_wait_s: float = 10.0):
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"),
                                       headers=_headers(base_url, api_key, data_dir),
                                       timeout=timeout, transport=transport)
        self._retries, self._max_wait_s = retries, max_wait_s

    async def _send(self, call: routes.Call[T]) -> T:
        retrying = AsyncRetrying(sleep=lambda seconds: asyncio.sleep(seconds),
                                 **retry_policy(call.method, self._retries, self._max_wait_s))
        response: httpx.Response = await retrying(self._http.request, call.method, call.path,
                                  params=call.params, json=call.body,
                                  timeout=_waiting(self._http.timeout, call))
        return _read(response, call)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMemoryClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def list_facts(self, user: str, limit: int = 50, cursor: str | None = None,
                         agent_id: str | None = None, run_id: str | None = None,
                         filters: dict[str, Any] | None = None) -> FactPage:
        return await self._send(routes.list_facts(user, limit, cursor, agent_id, run_id,
                                                  filters))

    async def iter_facts(self, user: str, page: int = 200, agent_id: str | None = None,
                         run_id: str | None = None, filters: dict[str, Any] | None = None
                         ) -> AsyncIterator[Fact]:
        cursor = None
        while True:
            result = await self.list_facts(user, page, cursor, agent_id, run_id, filters)
            for fact in result.facts:
                yield fact
            if (cursor := result.next_cursor) is None:
                return

    async def get_fact(self, user: str, fact_id: int) -> Fact:
        return await self._send(routes.get_fact(user, fact_id))

    async def history(self, user: str, fact_id: int) -> list[Fact]:
        return await self._send(routes.history(user, fact_id))

    async def search(self, user: str, query: str, k: int = 10, agent_id: str | None = None,
                     run_id: str | None = None, filters: dict[str, Any] | None = None
                     ) -> list[SearchHit]:
        return await self._send(routes.search(user, query, k, agent_id, run_id, filters))

    async def add_fact(self, user: str, text: str, conversation_id: str = "operator",
                       agent_id: str | None = None, run_id: str | None = None,
                       metadata: dict[str, Any] | None = None,
                       expires_at: datetime | None = None, pinned: bool = False) -> Fact:
        return await self._send(routes.add_fact(user, text, conversation_id, agent_id, run_id,
                                                metadata, expires_at, pinned))

    async def edit_fact(self, user: str, fact_id: int, text: str | None = None,
                        metadata: dict[str, Any] | None = None,
                        expires_at: datetime | None | EllipsisType = ...,
                        pinned: bool | None = None) -> Fact:
        return await self._send(routes.edit_fact(user, fact_id, text, metadata, expires_at,
                                                 pinned))

    async def delete_fact(self, user: str, fact_id: int) -> Deleted:
        return await self._send(routes.delete_fact(user, fact_id))

    async def delete_facts(self, user: str, filters: dict[str, Any] | None,
                           agent_id: str | None = None, run_id: str | None = None,
                           limit: int | None = None) -> list[int]:
        return await self._send(routes.delete_facts(user, filters, agent_id, run_id, limit))

    async def add_turns(self, user: str, turns: list[dict[str, Any]],
                        agent_id: str | None = None, run_id: str | None = None) -> TurnsAdded:
        return await self._send(routes.add_turns(user, turns, agent_id, run_id))

    async def event(self, user: str, event_id: str, wait: float = 0.0) -> Event:
        return await self._send(routes.event(user, event_id, wait))

    async def export(self, user: str, agent_id: str | None = None, run_id: str | None = None
                     ) -> AsyncIterator[dict[str, Any]]:
        call = routes.export(user, agent_id, run_id)
        async with self._http.stream(call.method, call.path, params=call.params) as response:
            if response.status_code >= 400:
                await response.aread()
                _read(response, call)
            async for raw in response.aiter_lines():
                if raw:
                    yield json.loads(raw)

    async def import_records(self, user: str,
                             records: Iterable[dict[str, Any]] | AsyncIterable[dict[str, Any]]
                             ) -> list[Imported]:
        listed = [r async for r in records] if isinstance(records, AsyncIterable) else list(
            records)
        header = _header(listed[0] if listed else None)
        return [await self._send(routes.import_records(user, header, chunk))
                for chunk in _chunks(iter(listed[1:]))]

    async def forget(self, user: str) -> Forgotten:
        return await self._send(routes.forget(user))
