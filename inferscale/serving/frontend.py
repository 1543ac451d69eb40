"""Memory front end inside vLLM's API server
(``--middleware inferscale.serving.frontend.MemoryFrontend``).

A chat completion or a response (``/v1/responses``: ``responses_input.py`` makes its chat)
naming a memory owner (``user`` field or ``X-InferScale-User`` header) is rewritten before vLLM
sees it: checked (``guards.py``), its memory options read
(``request_options.py``), the prompt composed from the owner's top-k facts (``compose.py``) and
sent as token ids, with a signed injection plan for the encoded facts (``kv_transfer_params``)
and a ``cache_salt`` (``cache_salt.py``: what of vLLM's prefix cache it may reuse). Requests
without an owner pass through untouched (client ``kv_transfer_params`` refused on every route).
Every request, of any route, first passes the browser rules (``browser_guard.py``) and its
route's admission (``route_policy.py``: an allow-list by name; any other route needs an admin
key); memory requests are admitted by ``access.py``; every body, of any method, is capped
before it is parsed. At start-up it adds the memory
API's routes (``memory_api.py``, and Mem0's: ``mem0_api.py``) to vLLM's app, served by
``memory_service.py``; its ASGI plumbing is ``asgi.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from starlette._utils import get_route_path

from inferscale.contracts.plan import PLAN_KEY, sign
from inferscale.core.local_key import is_loopback_host
from inferscale.core.settings import Settings, get_settings
from inferscale.kv.kv_metrics import KV_METRICS
from inferscale.serving.asgi import (
    Downstream,
    adding,
    client_address,
    discard,
    request_headers,
    send_error,
    with_length,
)
from inferscale.serving.auto_recompute import (
    OUTCOMES,
    Api,
    AutoRecompute,
    Decision,
    FirstTokenGate,
    ask_for_margin,
    client_top_logprobs,
    one_token,
)
from inferscale.serving.browser_guard import BODY_METHODS, check_request
from inferscale.serving.cache_salt import CacheSalts
from inferscale.serving.compose import MemoryRuntime, chat_messages, compose
from inferscale.serving.conversation_record import (
    AnswerCapture,
    Recording,
    new_messages,
    request_id,
)
from inferscale.serving.guards import (
    FrontendError,
    parse_request,
    read_body,
    refuse_reserved_form_fields,
)
from inferscale.serving.mem0_api import token_as_bearer
from inferscale.serving.memory_api import memory_endpoints, serve_memory
from inferscale.serving.memory_ops import named_scope, publish_turns
from inferscale.serving.memory_service import EngineMemory
from inferscale.serving.metrics import FRONTEND_METRICS as M
from inferscale.serving.recording_outbox import RecordingOutbox
from inferscale.serving.request_options import (
    MemoryOptions,
    owner_and_options,
    refuse_memory_elsewhere,
    request_owner,
)
from inferscale.serving.responses_input import response_messages, stored_history
from inferscale.serving.route_policy import Kind, RoutePolicy

log = logging.getLogger("inferscale.serving.frontend")

MEMORY_ROUTES: dict[str, Api] = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}
PARSE_IN_THREAD_BYTES = 64 * 1024
# Under recompute auto, the header with the margin of the attempt each outcome follows.
MARGIN_HEADERS = ("x-inferscale-first-margin", "x-inferscale-tail-margin")


class MemoryFrontend:
    """ASGI middleware: memory for owned chat completions and responses, guard for every
    generation route."""

    def __init__(self, app, settings: Settings | None = None):
        self.app = app
        self.settings = settings or get_settings()
        self.memory = EngineMemory(self.settings)
        self.access = self.memory.access
        self.recordings = RecordingOutbox(lambda turns: publish_turns(self.memory, turns),
                                          self.settings.record_outbox_turns)
        self.salts = CacheSalts(self.settings.plan_secret or "")
        self._routes: RoutePolicy | None = None  # built at the first request (routes added)
        self._server: object = None  # vLLM's app (its Responses store), known at start-up
        # vLLM's own --api-key check is ours (``serve.py`` keeps it from vLLM's command line, so
        # that memory keys are not refused by it): it runs before any memory work, and admits
        # vLLM's keys and the memory keys alike.
        self._bound = False
        self._authenticated = self._handle
        if self.settings.vllm_api_keys:
            from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

            self._authenticated = AuthenticationMiddleware(
                self._handle, tokens=[*self.settings.vllm_api_keys, *self.settings.api_keys])

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan" and not self._bound:
            self._bound = True
            self._server = scope["app"]
            serve_memory(scope["app"], self.memory)
            self.memory.bind(scope["app"])
            receive = self._draining(receive)
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope = token_as_bearer(scope)
        if self._routes is None:
            self._routes = RoutePolicy(scope["app"].routes, memory_endpoints())
        kind = self._routes.kind(scope)
        try:
            check_request(self.settings, scope.get("method", "GET"), get_route_path(scope),
                          request_headers(scope))
            self._admit_route(kind, scope)
        except FrontendError as exc:
            if scope["type"] == "websocket":  # closed before accepting: HTTP 403
                return await send({"type": "websocket.close", "code": 1008})
            return await send_error(send, exc.status, exc.message, exc.headers)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        await self._authenticated(scope, receive, send)

    def _admit_route(self, kind: Kind | None, scope) -> None:
        """The route's own admission, before any body is read: admin routes need an admin key,
        /metrics what ``metrics_access`` says, a body sent to a memory route a known key."""
        headers, client = request_headers(scope), client_address(scope)
        if kind == "admin" or (kind == "metrics" and self.settings.metrics_access != "any"
                               and not (self.settings.metrics_access == "loopback"
                                        and is_loopback_host(client or ""))):
            self.access.authorize_control(headers, client)
        elif kind == "memory" and scope.get("method") in BODY_METHODS:
            self.access.caller(headers, client)

    async def _handle(self, scope, receive, send):
        headers = request_headers(scope)
        try:
            body = await read_body(receive, headers, self.settings.max_body_bytes)
            rewritten = await self._rewrite(get_route_path(scope), body, headers,
                                            client_address(scope))
        except FrontendError as exc:
            return await send_error(send, exc.status, exc.message, exc.headers)
        except Exception as exc:  # noqa: BLE001 - e.g. the database is down: say so, live on
            log.exception("memory front end failed")
            return await send_error(send, 503, f"memory unavailable: {type(exc).__name__}")
        client = Downstream(receive)
        if rewritten.recording is not None:
            send = self._recorder(send, rewritten.recording)
        try:
            if rewritten.auto is None:
                return await self.app(with_length(scope, rewritten.body),
                                      client.receiver(rewritten.body),
                                      adding(send, rewritten.headers))
            await self._answer_auto(scope, client, send, rewritten)
        finally:
            client.close()

    def _recorder(self, send, recording: Recording):
        """``send`` that says which turns the response records and, once it has completed,
        hands them to the outbox that publishes them (``recording_outbox.py``)."""
        return AnswerCapture(adding(send, recording.headers()),
                             lambda answer: self.recordings.put(recording.turns(answer)))

    def _draining(self, receive):
        """The lifespan's ``receive``: at shutdown, the recorded turns still held are given
        ``record_drain_s`` to reach the broker before the server goes."""
        async def receive_draining():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.recordings.close(self.settings.record_drain_s)
            return message

        return receive_draining

    async def _answer_auto(self, scope, client: Downstream, send, rewritten: _Rewritten):
        """``"recompute": "auto"``: the m = 0 attempt behind a ``FirstTokenGate``; where the
        gate abandons it, the request answered again with the tail recomputed, behind a gate of
        its own where ``text_threshold`` is set; where that one abandons too, with every fact
        as text (at once, the tail skipped, where the first margin is under
        ``direct_threshold``)."""
        step = rewritten.auto
        assert step is not None and rewritten.retry is not None
        body, headers = rewritten.body, rewritten.headers
        margins: dict[str, str] = {}
        outcomes = iter(zip(OUTCOMES, (*MARGIN_HEADERS, None), strict=True))
        for outcome, margin_header in outcomes:
            answered = {**headers, **margins, "x-inferscale-recompute-auto": outcome}
            if step is None or margin_header is None:
                M.auto_recompute.labels(outcome).inc()
                return await self.app(with_length(scope, body), client.receiver(body),
                                      adding(send, answered))
            gate = await self._decided_attempt(scope, client, send, body, step, answered,
                                               margin_header)
            if not gate.abandoned:
                if gate.decision is not None:
                    M.auto_recompute.labels(outcome).inc()
                return
            margins[margin_header] = f"{gate.margin:.3f}"
            tail = outcome == "kept" and not step.skips_tail(gate.margin)
            if outcome == "kept" and not tail:
                next(outcomes)  # the tail attempt is skipped: every fact as text next
            step = step.then() if tail else None
            try:
                body, headers = await rewritten.retry(tail, step is not None)
            except FrontendError as exc:
                return await send_error(send, exc.status, exc.message, exc.headers)
            except Exception as exc:  # noqa: BLE001 - as for the first attempt
                log.exception("memory front end failed composing a recompute")
                return await send_error(send, 503, f"memory unavailable: {type(exc).__name__}")

    async def _decided_attempt(self, scope, client: Downstream, send, body: bytes,
                               auto: AutoRecompute, headers: dict[str, str], margin_header: str
                               ) -> FirstTokenGate:
        """An attempt behind a gate. Non-streamed, a one-token probe decides first (abandoned,
        a non-streamed answer would have run to its ``max_tokens``); kept, the answer is then
        generated once, over the probe's prefix-cached blocks, through a gate that keeps it.
        Where the probe gives no decision (an error), the attempt runs gated as it is."""
        probe = one_token(body, auto.api)
        if probe is not None:
            trial = await self._gated_attempt(scope, client, discard, probe, auto, headers,
                                              margin_header)
            if trial.abandoned:
                return trial
            if trial.decision is not None:
                auto = replace(auto, threshold=0.0)
        return await self._gated_attempt(scope, client, send, body, auto, headers, margin_header)

    async def _gated_attempt(self, scope, client: Downstream, send, body: bytes,
                             auto: AutoRecompute, headers: dict[str, str], margin_header: str
                             ) -> FirstTokenGate:
        """One attempt behind a ``FirstTokenGate``: released to the client (with ``headers`` and
        its margin) or abandoned before the client sees a byte of it."""
        abort = asyncio.Event()

        def released_headers(_: Decision, margin: float | None) -> dict[str, str]:
            return {**headers, **({margin_header: f"{margin:.3f}"} if margin is not None
                                  else {})}

        gate = FirstTokenGate(auto, adding(send, {}), released_headers)

        async def attempt_send(message):
            await gate(message)
            if gate.abandoned:
                abort.set()  # Starlette's disconnect listener (ASGI < 2.4) cancels the stream

        # Spec 2.3: Starlette also listens for the disconnect, which ``abort`` delivers.
        attempt = {**with_length(scope, body),
                   "asgi": {**scope.get("asgi", {}), "spec_version": "2.3"}}
        try:
            await self.app(attempt, client.receiver(body, abort), attempt_send)
        except Exception:
            if not gate.abandoned:
                raise
        return gate

    async def _rewrite(self, path: str, body: bytes, headers: dict[str, str],
                       client: str | None) -> _Rewritten:
        content_type = headers.get("content-type", "")
        if content_type.startswith(("multipart/", "application/x-www-form-urlencoded")):
            refuse_reserved_form_fields(body)
            return _Rewritten(body)
        if not body.strip():
            return _Rewritten(body)
        data = (await asyncio.to_thread(parse_request, body)
                if len(body) > PARSE_IN_THREAD_BYTES else parse_request(body))
        api = MEMORY_ROUTES.get(path)
        if api is None or not isinstance(data, dict):
            refuse_memory_elsewhere(path, data, headers)
            return _Rewritten(body)
        record = (self.access.caller(headers, client)[0].record
                  if request_owner(data, headers) is not None else None)
        owner, options = owner_and_options(data, headers, self.settings, record)
        if owner is None:
            return _Rewritten(json.dumps(data).encode())
        self.access.authorize(headers, owner, scope=named_scope(options.scope, options.where),
                              client=client, write=options.record)
        messages, query = chat_messages(await self._chat(api, data))
        recording = (Recording(owner, options, request_id(headers), new_messages(messages))
                     if options.record else None)
        rt = await self.memory.runtime()
        if options.recompute != "auto":
            return _Rewritten(*await self._memory_body(rt, data, owner, options, messages, query),
                              recording=recording)
        tail = self.settings.recompute_auto_tail
        recomputed = options.model_copy(update={"recompute": tail})
        if options.mode != "inject" or data.get("n") not in (None, 1) or tail == 0:
            return _Rewritten(*await self._memory_body(rt, data, owner, recomputed, messages,
                                                       query), recording=recording)
        auto = AutoRecompute(options.recompute_margin, client_top_logprobs(data, api), tail,
                             options.recompute_text_margin,
                             self.settings.recompute_auto_direct_margin, api)
        original = dict(data)

        async def retry(tail_only: bool, gated: bool) -> tuple[bytes, dict[str, str]]:
            """The request composed again: the tail recomputed, or every fact as text."""
            again = dict(original)
            if gated:
                ask_for_margin(again, api)
            return await self._memory_body(
                rt, again, owner, recomputed if tail_only
                else recomputed.model_copy(update={"mode": "text"}), messages, query)

        ask_for_margin(data, api)
        body, extra = await self._memory_body(
            rt, data, owner, options.model_copy(update={"recompute": 0}), messages, query)
        return _Rewritten(body, extra, auto, retry, recording)

    async def _chat(self, api: Api, data: dict) -> dict:
        """The request as a chat: itself, or a response's conversation (``responses_input``)."""
        if api == "chat":
            return data
        previous = data.get("previous_response_id")
        history = (await stored_history(self._server, previous) if isinstance(previous, str)
                   else None)
        return {"messages": response_messages(data, history)}

    async def _memory_body(self, rt: MemoryRuntime, data: dict, owner: str,
                           options: MemoryOptions, messages: list[dict], query: str
                           ) -> tuple[bytes, dict[str, str]]:
        """The request as vLLM receives it: the composed prompt's token ids, the signed plan
        and the owner's cache salt (``data`` is changed in place); and the response headers
        that account for it."""
        prompt = await compose(rt, owner, options, messages, query)
        started = time.perf_counter()
        params: dict = {"prompt_token_ids": prompt.token_ids}
        if prompt.plan is not None:
            params[PLAN_KEY] = sign(prompt.plan, self.settings.plan_secret or "")
        data["cache_salt"] = self.salts.salt(owner, rt.fingerprint, options, prompt.retrieved,
                                             prompt.pinned, prompt.fact_ids,
                                             data.get("cache_salt"))
        data["kv_transfer_params"] = params
        M.requests.labels(options.mode).inc()
        M.facts.labels("injected").inc(prompt.facts_injected)
        M.facts.labels("text").inc(prompt.facts_text)
        M.injected_tokens.inc(prompt.injected_tokens)
        M.prefilled_memory_tokens.inc(prompt.text_memory_tokens)
        body = json.dumps(data).encode()
        KV_METRICS.stage_seconds.labels("sign").observe(time.perf_counter() - started)
        return body, {
            "x-inferscale-mode": options.mode,
            "x-inferscale-recompute": str(options.recompute),
            "x-inferscale-facts": str(prompt.facts_injected + prompt.facts_text),
            "x-inferscale-facts-injected": str(prompt.facts_injected),
            "x-inferscale-fact-ids": ",".join(map(str, prompt.fact_ids)),
            "x-inferscale-facts-pinned": str(len(prompt.pinned)),
            "x-inferscale-prompt-tokens": str(len(prompt.token_ids)),
            "x-inferscale-injected-tokens": str(prompt.injected_tokens),
            "x-inferscale-prefilled-tokens": str(len(prompt.token_ids) - prompt.injected_tokens),
            "x-inferscale-retrieval-ms": f"{prompt.retrieval_ms:.1f}",
        }


@dataclass(frozen=True)
class _Rewritten:
    """A request as vLLM receives it, the headers its response gets and, under recompute
    auto, how to compose it again (the tail recomputed, or every fact as text)."""

    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    auto: AutoRecompute | None = None
    # (tail only, else every fact as text; whether a gate reads the answer's margin)
    retry: Callable[[bool, bool], Awaitable[tuple[bytes, dict[str, str]]]] | None = None
    recording: Recording | None = None  # the turns this request records once answered
