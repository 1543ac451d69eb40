"""What the memory front end refuses before any memory work: oversized or unparsable bodies and
client-supplied ``kv_transfer_params`` (at any depth, or as a form field). Who may call is
``access.py``'s; from where, ``browser_guard.py``'s."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

RESERVED_KEYS = ("kv_transfer_params",)
FORM_RESERVED = (b"kv_transfer_params", b"vllm_xargs")


class FrontendError(Exception):
    """A request the front end refuses, with its HTTP status."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def parse_json(body: bytes) -> object:
    """The body as JSON, or a 400 (bad JSON, huge numbers, nesting past the recursion limit)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge ints, deep nesting
        raise FrontendError(400, f"request body is not JSON this server accepts: "
                                 f"{type(exc).__name__}") from None


def parse_request(body: bytes) -> object:
    """The JSON body, refused if it carries a reserved key anywhere (blocking: both scale with
    the body, so large bodies run this in a thread)."""
    data = parse_json(body)
    if _has_reserved_key(data):
        raise FrontendError(400, "kv_transfer_params is reserved for the InferScale front end")
    return data


def refuse_reserved_form_fields(body: bytes) -> None:
    """A form body (multipart or urlencoded) may not name a reserved field."""
    if any(name in unquote_to_bytes(body.replace(b"+", b" ")) for name in FORM_RESERVED):
        raise FrontendError(400, "kv_transfer_params and vllm_xargs are reserved for the "
                                 "InferScale front end")


def _has_reserved_key(data: object) -> bool:
    """Whether a reserved key appears at any depth (iterative: no recursion limit)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if any(key in item for key in RESERVED_KEYS):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def read_body(receive: Callable[[], Awaitable[dict[str, Any]]], headers: dict[str, str],
                    limit: int) -> bytes:
    """The whole request body, refused with 413 as soon as it is known to exceed ``limit``."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise FrontendError(413, f"request body over {limit} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise FrontendError(400, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise FrontendError(413, f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)
