"""Tail recompute where the answer is at stake (``"recompute": "auto"``).

A request is answered first with every fact injected (m = 0). Its response is held back until
the first generated token is known with its top-2 logprob margin (the front end asks vLLM for
two top logprobs). Where the margin reaches the threshold, the held response is released and
the rest streams through; otherwise the attempt is abandoned before the client has seen a byte
of it (its later sends are dropped and its receive reports a disconnect, on which Starlette
cancels the stream and vLLM aborts the request) and the request is answered again with the
best m facts prefilled after the injected ones. On 529 LoCoMo dev questions every first token
m = 0 got wrong had a margin of at most 1 nat, and a threshold of 0.5 recomputes ~22% of
requests for the agreement of recomputing all of them (``docs/results/fidelity.md``). Where the
tail-recomputed answer is itself a near tie (margin under ``text_threshold``), that attempt is
abandoned the same way and the request answered a third time with every fact as text: ties are
what injected and prefilled answers still disagree on. Where the first margin is under
``direct_threshold`` the tail attempt is skipped: such a request goes to text at once and pays
two attempts, not three (``docs/results/models.md``: a fallback cost 1.4-1.75x text prefill
with all three).

Logprobs the client did not ask for are removed from what it receives (to the count it asked
for where it asked for fewer). Both memory routes are read: chat completions (``"chat"``) and
the Responses API (``"responses"``: logprobs asked for by ``include``, events named by an
``event:`` line). Pure logic over ASGI messages: the front end wires it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

Send = Callable[[dict[str, Any]], Awaitable[None]]
Decision = Literal["kept", "recomputed"]
Outcome = Literal["kept", "recomputed", "text"]  # which attempt answered
OUTCOMES: tuple[Outcome, ...] = ("kept", "recomputed", "text")
Api = Literal["chat", "responses"]  # the memory route's request and answer shapes
PROBE_TOP_LOGPROBS = 2
RESPONSE_LOGPROBS = "message.output_text.logprobs"  # the Responses API's ``include`` for them


@dataclass(frozen=True)
class AutoRecompute:
    """How one request is answered under ``"recompute": "auto"``."""

    threshold: float  # nats: a first-token top-2 margin below it recomputes the tail
    client_top_logprobs: int | None  # what the client asked for (None: no logprobs)
    tail: int  # facts recomputed by the second attempt
    text_threshold: float = 0.0  # nats: the second attempt's margin below it: all as text
    direct_threshold: float = 0.0  # nats: the first attempt's margin below it: text at once
    api: Api = "chat"

    def then(self) -> AutoRecompute | None:
        """The gate of the tail-recomputed attempt (None: that attempt answers)."""
        if self.text_threshold <= 0:
            return None
        return replace(self, threshold=self.text_threshold, text_threshold=0.0,
                       direct_threshold=0.0)

    def skips_tail(self, margin: float | None) -> bool:
        """Whether an abandoned first attempt's margin is so low that the tail would not save
        it: the request goes to text at once (it pays two attempts, not three)."""
        return margin is not None and margin < self.direct_threshold


def client_top_logprobs(data: dict[str, Any], api: Api = "chat") -> int | None:
    """The top logprobs the client asked for (None: none at all)."""
    if api == "responses":
        include = data.get("include")
        asked = isinstance(include, list) and RESPONSE_LOGPROBS in include
    else:
        asked = bool(data.get("logprobs"))
    if not asked:
        return None
    top = data.get("top_logprobs")
    return top if isinstance(top, int) and top >= 0 else 0


def ask_for_margin(data: dict[str, Any], api: Api = "chat") -> None:
    """Make the request return the logprobs the decision needs (in place)."""
    top = max(client_top_logprobs(data, api) or 0, PROBE_TOP_LOGPROBS)
    if api == "responses":
        include = data.get("include")
        include = list(include) if isinstance(include, list) else []
        data["include"] = include if RESPONSE_LOGPROBS in include else [*include,
                                                                       RESPONSE_LOGPROBS]
    else:
        data["logprobs"] = True
    data["top_logprobs"] = top


def one_token(body: bytes, api: Api = "chat") -> bytes | None:
    """A non-streamed request made to generate one token (None: a streamed request, whose
    gate aborts it at its first token anyway)."""
    data = json.loads(body)
    if data.get("stream"):
        return None
    if api == "responses":
        data["max_output_tokens"] = 1
    else:
        data["max_tokens"] = 1
        if "max_completion_tokens" in data:
            data["max_completion_tokens"] = 1
    return json.dumps(data).encode()


def _first_entry(payload: dict[str, Any]) -> object:
    """The logprob entry of the first generated token in a chat completion or chunk, a
    Responses API response or its text delta event (None: none there)."""
    if "choices" in payload:
        choices = payload["choices"]
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return None
        logprobs = choices[0].get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    elif payload.get("type") == "response.output_text.delta":
        entries = payload.get("logprobs")
    elif payload.get("object") == "response":
        parts = [part for item in _list(payload.get("output")) if isinstance(item, dict)
                 and item.get("type") == "message" for part in _list(item.get("content"))]
        first = parts[0] if parts and isinstance(parts[0], dict) else {}
        entries = first.get("logprobs")
    else:
        return None
    return entries[0] if isinstance(entries, list) and entries else None


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def first_margin(payload: dict[str, Any]) -> float | None:
    """The top-2 logprob margin of the first generated token (``_first_entry``; None: no
    generated token yet). One candidate only: an infinite margin."""
    entry = _first_entry(payload)
    top = entry.get("top_logprobs") if isinstance(entry, dict) else None
    values = sorted((float(t["logprob"]) for t in top if isinstance(t, dict)
                     and isinstance(t.get("logprob"), int | float)), reverse=True) \
        if isinstance(top, list) else []
    if not values:
        return None
    return values[0] - values[1] if len(values) > 1 else float("inf")


def strip_logprobs(payload: dict[str, Any], keep: int | None) -> dict[str, Any]:
    """``payload`` with the logprobs the client did not ask for removed (in place)."""
    if "choices" not in payload:
        _strip_response(payload, keep)
        return payload
    for choice in payload.get("choices") or []:
        if not isinstance(choice, dict) or "logprobs" not in choice:
            continue
        if keep is None:
            choice["logprobs"] = None
            continue
        _trim((choice["logprobs"] or {}).get("content") or [], keep)
    return payload


def _strip_response(node: object, keep: int | None) -> None:
    """A Responses API payload's every ``logprobs`` list emptied (``keep`` None) or its top
    logprobs cut to ``keep``, and a response object's ``top_logprobs`` set back (in place)."""
    if isinstance(node, list):
        for item in node:
            _strip_response(item, keep)
        return
    if not isinstance(node, dict):
        return
    if node.get("object") == "response" and "top_logprobs" in node:
        node["top_logprobs"] = keep or 0
    for key, value in node.items():
        if key == "logprobs" and isinstance(value, list):
            node[key] = [] if keep is None else _trim(value, keep)
        else:
            _strip_response(value, keep)


def _trim(entries: list, keep: int) -> list:
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("top_logprobs"), list):
            entry["top_logprobs"] = entry["top_logprobs"][:keep]
    return entries


def event_payload(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one server-sent event's ``data: {...}`` line (after an ``event:``
    line or none; None: any other event)."""
    line = next((line for line in event.strip().split(b"\n") if line.startswith(b"data: {")),
                None)
    if line is None:
        return None
    try:
        payload = json.loads(line[len(b"data: "):])
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _with_payload(event: bytes, payload: dict[str, Any]) -> bytes:
    """``event`` with its ``data:`` line replaced by ``payload`` (its other lines kept)."""
    lines = [b"data: " + json.dumps(payload).encode() if line.startswith(b"data: {") else line
             for line in event.strip(b"\n").split(b"\n")]
    return b"\n".join(lines)


class FirstTokenGate:
    """The ``send`` of the m = 0 attempt: holds the response until the first token's margin
    decides (``decision``); then releases it through ``send`` (with ``headers`` added), or
    drops it and every later message (the attempt is ``abandoned``)."""

    def __init__(self, auto: AutoRecompute, send: Send,
                 headers: Callable[[Decision, float | None], dict[str, str]]):
        self.auto = auto
        self.decision: Decision | None = None
        self.margin: float | None = None
        self._send = send
        self._headers = headers
        self._start: dict[str, Any] | None = None
        self._streaming = False
        self._held = b""  # body bytes not yet released (whole events, then a partial one)
        self._passing = False  # an error response: passed through untouched

    @property
    def abandoned(self) -> bool:
        return self.decision == "recomputed"

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.abandoned:
            return
        if message["type"] == "http.response.start":
            self._start = message
            self._passing = message["status"] >= 400
            content_type = dict(message.get("headers") or []).get(b"content-type", b"")
            self._streaming = content_type.startswith(b"text/event-stream")
            if self._passing:
                await self._send(message)
            return
        if message["type"] != "http.response.body" or self._passing:
            return await self._send(message)
        self._held += message.get("body", b"")
        more = message.get("more_body", False)
        if self.decision is None:
            self._decide(final=not more)
            if self.decision is None or self.abandoned:
                return
            await self._release_start()
        await self._release(final=not more)

    def _decide(self, final: bool) -> None:
        """Look for the first token in what is held; at the end without one: keep."""
        if self._streaming:
            for event in self._held.split(b"\n\n")[:-1]:  # complete events only
                payload = event_payload(event)
                if payload is not None and (margin := first_margin(payload)) is not None:
                    return self._settle(margin)
        elif final:
            try:
                payload = json.loads(self._held)
            except ValueError:
                payload = None
            if isinstance(payload, dict) and (margin := first_margin(payload)) is not None:
                return self._settle(margin)
        if final:
            self.decision = "kept"

    def _settle(self, margin: float) -> None:
        self.margin = margin
        self.decision = "kept" if margin >= self.auto.threshold else "recomputed"

    async def _release_start(self) -> None:
        assert self._start is not None  # a body comes after its start
        extra = self._headers("kept", self.margin)
        headers = [(k, v) for k, v in self._start.get("headers") or []
                   if k.lower() != b"content-length" or self._streaming]
        headers += [(k.encode(), v.encode()) for k, v in extra.items()]
        if not self._streaming:
            headers.append((b"content-length", str(len(self._stripped_body())).encode()))
        await self._send({**self._start, "headers": headers})

    def _stripped_body(self) -> bytes:
        try:
            payload = json.loads(self._held)
        except ValueError:
            return self._held
        if not isinstance(payload, dict):
            return self._held
        return json.dumps(strip_logprobs(payload, self.auto.client_top_logprobs)).encode()

    async def _release(self, final: bool) -> None:
        """Send what is held: the whole body once complete (non-streaming), else every
        complete event, stripped."""
        if not self._streaming:
            if final:
                body, self._held = self._stripped_body(), b""
                await self._send({"type": "http.response.body", "body": body,
                                  "more_body": False})
            return
        *events, self._held = self._held.split(b"\n\n")
        if final and self._held:
            events.append(self._held)
            self._held = b""
        out = []
        for event in events:
            payload = event_payload(event)
            if payload is not None:
                event = _with_payload(event, strip_logprobs(payload,
                                                            self.auto.client_top_logprobs))
            out.append(event + b"\n\n")
        if out or final:
            await self._send({"type": "http.response.body", "body": b"".join(out),
                              "more_body": not final})
