"""ASGI plumbing of the memory front end: the client's side of a connection shared by a
request's attempts, a request re-sent with a new body, headers added to a response, and error
responses in the OpenAI shape."""

from __future__ import annotations

import asyncio
import json

_DISCONNECT = {"type": "http.disconnect"}


class Downstream:
    """The client's side of one connection, shared by a request's attempts: each attempt reads
    its (rewritten) body once, then waits for the client to disconnect or, where it is
    abandoned, for its ``abort``."""

    def __init__(self, receive):
        self._receive = receive
        self._pending: asyncio.Future | None = None  # a read of the client, kept across attempts
        self._gone = False

    def receiver(self, body: bytes, abort: asyncio.Event | None = None):
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await self._next(abort)

        return receive

    async def _next(self, abort: asyncio.Event | None) -> dict:
        if self._gone:
            return _DISCONNECT
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._receive())
        aborted = asyncio.ensure_future(abort.wait()) if abort is not None else None
        try:
            await asyncio.wait([f for f in (self._pending, aborted) if f is not None],
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if aborted is not None:
                aborted.cancel()
        if not self._pending.done():
            return _DISCONNECT  # aborted: the client's next message waits for the next attempt
        message, self._pending = self._pending.result(), None
        self._gone = message["type"] == "http.disconnect"
        return message

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


async def discard(_message: dict) -> None:
    """The ``send`` of a probe: the client never sees it."""


def with_length(scope: dict, body: bytes) -> dict:
    return {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                 if k.lower() != b"content-length"]
            + [(b"content-length", str(len(body)).encode())]}


def adding(send, headers: dict[str, str]):
    """``send`` with ``headers`` added to a successful response's start (a refused request
    says nothing of memory)."""
    async def send_with_headers(message):
        if message["type"] == "http.response.start" and headers and message["status"] < 400:
            message = {**message, "headers": list(message.get("headers", []))
                       + [(k.encode(), v.encode()) for k, v in headers.items()]}
        await send(message)

    return send_with_headers


ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
               413: "request_too_large", 415: "unsupported_media_type",
               429: "rate_limit_error", 503: "service_unavailable"}


def request_headers(scope) -> dict[str, str]:
    """A request's headers, lower-case keyed (a repeated header: its last value)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def send_error(send, status: int, message: str,
                     headers: dict[str, str] | None = None) -> None:
    """An error response in the OpenAI shape (its type named after the status)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]
                + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]})
    await send({"type": "http.response.body", "body": json.dumps(
        {"error": {"message": message, "type": kind, "code": status}}).encode()})


def client_address(scope) -> str | None:
    """The address of the connection's peer (None: not known)."""
    client = scope.get("client")
    return client[0] if client else None
