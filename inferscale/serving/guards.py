"""What the memory front end refuses before any memory work: oversized or unparsable bodies,
client-supplied ``kv_transfer_params`` (at any depth, or as a form field), and requests whose
API key may not act for the memory owner (or, on engine-control routes, for every owner)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from inferscale.platform.settings import Settings

RESERVED_KEYS = ("kv_transfer_params",)
FORM_RESERVED = (b"kv_transfer_params", b"vllm_xargs")


class FrontendError(Exception):
    """A request the front end refuses, with its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def authorize(settings: Settings, headers: dict[str, str], owner: str) -> None:
    """With API keys configured, the bearer key must exist and may act for ``owner``; without,
    memory is readable only where anonymous access was chosen (default: loopback servers)."""
    if not settings.api_keys:
        if settings.anonymous_memory:
            return
        raise FrontendError(401, "memory requests need an API key: this server has no "
                                 "INFERSCALE_API_KEYS and INFERSCALE_ALLOW_ANONYMOUS is off")
    auth = headers.get("authorization", "")
    key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
    if key not in settings.api_keys:
        raise FrontendError(401, "missing or unknown API key")
    allowed = settings.api_keys[key]
    if owner not in allowed and "*" not in allowed:
        raise FrontendError(403, f"this API key may not read the memory of {owner!r}")


def authorize_control(settings: Settings, headers: dict[str, str]) -> None:
    """Engine-control routes need a key that may act for every owner ("*")."""
    if not settings.api_keys and settings.anonymous_memory:
        return
    try:
        authorize(settings, headers, "*")
    except FrontendError as exc:
        raise FrontendError(exc.status, "engine-control routes need an admin key "
                                        f"(one that may act for '*'): {exc.message}") from None


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
