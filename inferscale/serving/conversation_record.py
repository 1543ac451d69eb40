"""Memory that records its own conversations (``"record": true``, or ``record_conversations``).

A memory-bearing chat completion or response (``/v1/responses``) that asks for it is published,
once it has completed with 200, as turns of its owner through the same Kafka path as any
producer: the user's new messages (those after the last assistant message) and the answer, in
the request's agent / run scope, conversation ``run_id`` (else ``"chat"``). Turn ids come from
the request id (the client's ``X-Request-Id``, else a fresh one), so a retried request records
once (turns are unique per owner, conversation and id). The response says up front which turns
it records (``x-inferscale-recorded-turns``); publishing happens after the last byte, off the
answer, through the outbox that retries until the broker takes them (``recording_outbox.py``),
never seen by the client. A response that does not
complete (the client went away, an error status, a stream cut short) records nothing. Under
recompute auto only the answering attempt reaches the capture (the gates drop the others).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from inferscale.contracts.events import TurnEvent
from inferscale.serving.auto_recompute import event_payload
from inferscale.serving.guards import FrontendError
from inferscale.serving.request_options import MemoryOptions

log = logging.getLogger("inferscale.serving.conversation_record")
Send = Callable[[dict[str, Any]], Awaitable[None]]
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_ANSWER_BYTES = 4 << 20  # a body past this is not recorded (an answer is a few kB)
CONVERSATION = "chat"  # the conversation of recorded turns without a run


def request_id(headers: dict[str, str]) -> str:
    """The client's ``X-Request-Id`` (400 where it is not 1-128 letters, digits or ``._:-``),
    else a fresh one."""
    given = headers.get("x-request-id")
    if given is None:
        return uuid.uuid4().hex
    if not REQUEST_ID.match(given):
        raise FrontendError(400, "X-Request-Id must be 1-128 letters, digits or '._:-' to "
                                 "record a conversation under it")
    return given


@dataclass(frozen=True)
class Recording:
    """The turns one request records: its new user messages now, the answer once known."""

    owner: str
    options: MemoryOptions
    request: str
    asked: list[str]  # the user's new messages, in order

    @property
    def conversation(self) -> str:
        return self.options.run_id or CONVERSATION

    @property
    def turn_ids(self) -> list[str]:
        return [f"{self.request}.u{i}" for i in range(len(self.asked))] + [f"{self.request}.a"]

    def turns(self, answer: str, when: datetime | None = None) -> list[TurnEvent]:
        """The turns to publish, the answer last."""
        when = when or datetime.now(UTC)
        texts = [("user", text) for text in self.asked] + [("assistant", answer)]
        return [TurnEvent(user_id=self.owner, conversation_id=self.conversation, turn_id=turn,
                          speaker=speaker, text=text, timestamp=when,
                          agent_id=self.options.agent_id, run_id=self.options.run_id)
                for turn, (speaker, text) in zip(self.turn_ids, texts, strict=True)]

    def headers(self) -> dict[str, str]:
        return {"x-inferscale-recorded-turns": ",".join(self.turn_ids),
                "x-inferscale-recorded-conversation": self.conversation}


def new_messages(messages: list[dict]) -> list[str]:
    """The user messages after the last assistant message (what this request adds)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return [m["content"] for m in messages[last + 1:] if m["role"] == "user" and m["content"]]


def answer_text(body: bytes, streamed: bool) -> str | None:
    """The answer's text: a whole chat completion's first choice, a Responses API response's
    message text; of a whole event stream, the chat deltas joined or the completed response's
    text. None where there is none, or the stream was cut short (no ``[DONE]``, no
    ``response.completed``)."""
    if not streamed:
        try:
            payload = json.loads(body)
        except ValueError:
            return None
        return _completed_text(payload) if isinstance(payload, dict) else None
    if b"data: [DONE]" not in body:
        for event in body.split(b"\n\n"):
            payload = event_payload(event)
            if payload is not None and payload.get("type") == "response.completed":
                response = payload.get("response")
                return _completed_text(response) if isinstance(response, dict) else None
        return None
    parts = []
    for event in body.split(b"\n\n"):
        payload = event_payload(event)
        try:
            choice = payload["choices"][0] if payload is not None else None
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(content, str):
            parts.append(content)
    return "".join(parts) or None


def _completed_text(payload: dict[str, Any]) -> str | None:
    """A whole chat completion's first choice, or a Responses API response's output text."""
    if payload.get("object") == "response":
        texts = [part.get("text") for item in payload.get("output") or []
                 if isinstance(item, dict) and item.get("type") == "message"
                 for part in item.get("content") or []
                 if isinstance(part, dict) and part.get("type") == "output_text"]
        text = "".join(t for t in texts if isinstance(t, str))
        return text or None
    try:
        content = payload["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) and content else None


@dataclass
class AnswerCapture:
    """A ``send`` that passes every message on and keeps the answer's bytes; once the response
    has completed with 200, ``done`` gets the answer's text (not where it has none)."""

    send: Send
    done: Callable[[str], object]
    _status: int = 0
    _streamed: bool = False
    _body: bytearray = field(default_factory=bytearray)
    _overflow: bool = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self._status = message["status"]
            content_type = dict(message.get("headers") or []).get(b"content-type", b"")
            self._streamed = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and self._status == 200:
            chunk = message.get("body", b"")
            if len(self._body) + len(chunk) > MAX_ANSWER_BYTES:
                self._overflow = True
            elif not self._overflow:
                self._body += chunk
        await self.send(message)
        if (message["type"] == "http.response.body" and not message.get("more_body", False)
                and self._status == 200 and not self._overflow):
            text = answer_text(bytes(self._body), self._streamed)
            if text is not None:
                self.done(text)
