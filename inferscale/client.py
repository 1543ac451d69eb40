"""A Python client of the memory API (``serving/memory_api.py``), sync and async.

>>> from inferscale.client import MemoryClient
>>> memory = MemoryClient("http://127.0.0.1:8000", api_key="...")
>>> facts = memory.list_facts("alice")["facts"]
>>> memory.edit_fact("alice", facts[0]["id"], "Alice moved to Lisbon in May 2025.")

Both clients build the same requests (``_Call``); only how they are sent differs. A refused
request raises ``MemoryAPIError`` with the server's status and message. With no ``api_key``
they send ``INFERSCALE_API_KEY``, or for a server on this machine (a loopback URL) the local
admin key ``inferscale serve`` made (``core/local_key.py``; ``data_dir``: where it is, by
default ``INFERSCALE_DATA_DIR`` or ``~/.inferscale``). ``agent_id`` /
``run_id`` scope what a call writes and filter what it reads (None: any).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from inferscale.core.local_key import key_for


class MemoryAPIError(Exception):
    """The server refused a request: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    body: dict[str, Any] | None = None


def _user(user: str) -> str:
    return f"/v1/memory/users/{quote(user, safe='')}"


def _scope(agent_id: str | None, run_id: str | None) -> dict[str, str]:
    return {name: value for name, value in (("agent_id", agent_id), ("run_id", run_id))
            if value is not None}


class _Calls:
    """The API's requests, one builder per route."""

    @staticmethod
    def list_facts(user: str, limit: int, cursor: str | None, agent_id: str | None = None,
                   run_id: str | None = None) -> _Call:
        params: dict[str, Any] = {"limit": limit, **_scope(agent_id, run_id)}
        if cursor is not None:
            params["cursor"] = cursor
        return _Call("GET", f"{_user(user)}/facts", params)

    @staticmethod
    def get_fact(user: str, fact_id: int) -> _Call:
        return _Call("GET", f"{_user(user)}/facts/{int(fact_id)}")

    @staticmethod
    def history(user: str, fact_id: int) -> _Call:
        return _Call("GET", f"{_user(user)}/facts/{int(fact_id)}/history")

    @staticmethod
    def search(user: str, query: str, k: int, agent_id: str | None = None,
               run_id: str | None = None) -> _Call:
        return _Call("POST", f"{_user(user)}/search",
                     body={"query": query, "k": k, **_scope(agent_id, run_id)})

    @staticmethod
    def add_fact(user: str, text: str, conversation_id: str, agent_id: str | None = None,
                 run_id: str | None = None) -> _Call:
        return _Call("POST", f"{_user(user)}/facts",
                     body={"text": text, "conversation_id": conversation_id,
                           **_scope(agent_id, run_id)})

    @staticmethod
    def edit_fact(user: str, fact_id: int, text: str) -> _Call:
        return _Call("PATCH", f"{_user(user)}/facts/{int(fact_id)}", body={"text": text})

    @staticmethod
    def delete_fact(user: str, fact_id: int) -> _Call:
        return _Call("DELETE", f"{_user(user)}/facts/{int(fact_id)}")

    @staticmethod
    def add_turns(user: str, turns: list[dict[str, Any]], agent_id: str | None = None,
                  run_id: str | None = None) -> _Call:
        return _Call("POST", f"{_user(user)}/turns",
                     body={"turns": turns, **_scope(agent_id, run_id)})

    @staticmethod
    def forget(user: str) -> _Call:
        return _Call("DELETE", _user(user))


CALLS = _Calls


def _result(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            payload = response.json()
            detail = payload.get("detail") or payload.get("error", {}).get("message")
        except ValueError:
            detail = None
        raise MemoryAPIError(response.status_code, str(detail or response.text))
    return response.json()


def _headers(base_url: str, api_key: str | None, data_dir: Path | None) -> dict[str, str]:
    key = api_key if api_key is not None else key_for(base_url, data_dir)
    return {"authorization": f"Bearer {key}"} if key else {}


class MemoryClient:
    """The memory API of one server, over HTTP (blocking)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0,
                 transport: httpx.BaseTransport | None = None, data_dir: Path | None = None):
        self._http = httpx.Client(base_url=base_url.rstrip("/"),
                                  headers=_headers(base_url, api_key, data_dir), timeout=timeout,
                                  transport=transport)

    def _send(self, call: _Call) -> Any:
        return _result(self._http.request(call.method, call.path, params=call.params,
                                          json=call.body))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def list_facts(self, user: str, limit: int = 50, cursor: str | None = None,
                   agent_id: str | None = None, run_id: str | None = None) -> dict:
        """One page of the owner's live facts and the cursor of the next (None: the last)."""
        return dict(self._send(CALLS.list_facts(user, limit, cursor, agent_id, run_id)))

    def iter_facts(self, user: str, page: int = 200, agent_id: str | None = None,
                   run_id: str | None = None) -> Iterator[dict]:
        """Every live fact of the owner, page by page."""
        cursor = None
        while True:
            result = self.list_facts(user, page, cursor, agent_id, run_id)
            yield from result["facts"]
            if (cursor := result["next_cursor"]) is None:
                return

    def get_fact(self, user: str, fact_id: int) -> dict:
        return dict(self._send(CALLS.get_fact(user, fact_id)))

    def history(self, user: str, fact_id: int) -> list[dict]:
        """The fact's versions, oldest first."""
        return list(self._send(CALLS.history(user, fact_id))["versions"])

    def search(self, user: str, query: str, k: int = 10, agent_id: str | None = None,
               run_id: str | None = None) -> list[dict]:
        """The owner's k facts the server would retrieve for ``query``, with scores."""
        return list(self._send(CALLS.search(user, query, k, agent_id, run_id))["hits"])

    def add_fact(self, user: str, text: str, conversation_id: str = "operator",
                 agent_id: str | None = None, run_id: str | None = None) -> dict:
        """A fact given directly (admin keys only)."""
        return dict(self._send(CALLS.add_fact(user, text, conversation_id, agent_id, run_id)))

    def edit_fact(self, user: str, fact_id: int, text: str) -> dict:
        """The new version of the fact (a new id; the old one is retired)."""
        return dict(self._send(CALLS.edit_fact(user, fact_id, text)))

    def delete_fact(self, user: str, fact_id: int) -> dict:
        return dict(self._send(CALLS.delete_fact(user, fact_id)))

    def add_turns(self, user: str, turns: list[dict[str, Any]], agent_id: str | None = None,
                  run_id: str | None = None) -> dict:
        """Publish turns (``conversation_id``, ``turn_id``, ``speaker``, ``text``,
        ``timestamp`` each; a turn's own ``agent_id`` / ``run_id`` win over the call's): which
        were accepted, which refused and why."""
        return dict(self._send(CALLS.add_turns(user, turns, agent_id, run_id)))

    def forget(self, user: str) -> dict:
        return dict(self._send(CALLS.forget(user)))


class AsyncMemoryClient:
    """The memory API of one server, over HTTP (asyncio)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 data_dir: Path | None = None):
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"),
                                       headers=_headers(base_url, api_key, data_dir),
                                       timeout=timeout, transport=transport)

    async def _send(self, call: _Call) -> Any:
        return _result(await self._http.request(call.method, call.path, params=call.params,
                                                json=call.body))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMemoryClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def list_facts(self, user: str, limit: int = 50, cursor: str | None = None,
                         agent_id: str | None = None, run_id: str | None = None) -> dict:
        return dict(await self._send(CALLS.list_facts(user, limit, cursor, agent_id, run_id)))

    async def iter_facts(self, user: str, page: int = 200, agent_id: str | None = None,
                         run_id: str | None = None) -> AsyncIterator[dict]:
        cursor = None
        while True:
            result = await self.list_facts(user, page, cursor, agent_id, run_id)
            for fact in result["facts"]:
                yield fact
            if (cursor := result["next_cursor"]) is None:
                return

    async def get_fact(self, user: str, fact_id: int) -> dict:
        return dict(await self._send(CALLS.get_fact(user, fact_id)))

    async def history(self, user: str, fact_id: int) -> list[dict]:
        return list((await self._send(CALLS.history(user, fact_id)))["versions"])

    async def search(self, user: str, query: str, k: int = 10, agent_id: str | None = None,
                     run_id: str | None = None) -> list[dict]:
        return list((await self._send(CALLS.search(user, query, k, agent_id, run_id)))["hits"])

    async def add_fact(self, user: str, text: str, conversation_id: str = "operator",
                       agent_id: str | None = None, run_id: str | None = None) -> dict:
        return dict(await self._send(CALLS.add_fact(user, text, conversation_id, agent_id,
                                                    run_id)))

    async def edit_fact(self, user: str, fact_id: int, text: str) -> dict:
        return dict(await self._send(CALLS.edit_fact(user, fact_id, text)))

    async def delete_fact(self, user: str, fact_id: int) -> dict:
        return dict(await self._send(CALLS.delete_fact(user, fact_id)))

    async def add_turns(self, user: str, turns: list[dict[str, Any]],
                        agent_id: str | None = None, run_id: str | None = None) -> dict:
        return dict(await self._send(CALLS.add_turns(user, turns, agent_id, run_id)))

    async def forget(self, user: str) -> dict:
        return dict(await self._send(CALLS.forget(user)))
