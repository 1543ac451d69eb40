"""Memory front end inside vLLM's API server
(``--middleware inferscale.serving.frontend.MemoryFrontend``).

A chat completion naming a memory owner (``user`` field or ``X-InferScale-User`` header) is
rewritten before vLLM sees it: checked (``guards.py``), its memory options read
(``request_options.py``), the prompt composed from the owner's top-k facts (``compose.py``) and
sent as token ids, with a signed injection plan for the encoded facts (``kv_transfer_params``)
and a ``cache_salt`` keyed by the server's secret and the facts served. Requests without an
owner pass through untouched (client ``kv_transfer_params`` refused on every route). Every
request, of any route, first passes the browser rules (``browser_guard.py``); memory requests
and engine-control routes are admitted by ``access.py``. At start-up it adds the memory API's
routes (``memory_api.py``) to vLLM's app and serves them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from inferscale.contracts.plan import PLAN_KEY, sign
from inferscale.kv.kv_metrics import KV_METRICS
from inferscale.pipeline.kafka import kafka_security
from inferscale.platform.settings import Settings, get_settings
from inferscale.serving.access import Access
from inferscale.serving.auto_recompute import (
    OUTCOMES,
    AutoRecompute,
    Decision,
    FirstTokenGate,
    ask_for_margin,
    client_top_logprobs,
)
from inferscale.serving.browser_guard import check_request
from inferscale.serving.compose import MemoryRuntime, chat_messages, compose
from inferscale.serving.guards import (
    FrontendError,
    parse_request,
    read_body,
    refuse_reserved_form_fields,
)
from inferscale.serving.memory_api import build_router
from inferscale.serving.metrics import FRONTEND_METRICS as M
from inferscale.serving.request_options import MemoryOptions, owner_and_options

log = logging.getLogger("inferscale.serving.frontend")

CHAT_PATH = "/v1/chat/completions"
# vLLM's engine-control routes (scaling, sleep, cache resets, RPC, profiling, adapters):
# admin keys only (or anonymous where anonymous access is the chosen policy).
CONTROL_PATHS = frozenset({
    "/scale_elastic_ep", "/is_scaling_elastic_ep", "/collective_rpc", "/sleep", "/wake_up",
    "/release_kv_cache_memory", "/reset_prefix_cache", "/reset_mm_cache",
    "/reset_encoder_cache", "/start_profile", "/stop_profile", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/fault_tolerance/apply"})
BODY_METHODS = ("POST", "PUT", "PATCH")
PARSE_IN_THREAD_BYTES = 64 * 1024
TIERS_TIMEOUT_S = 5.0
# Under recompute auto, the header with the margin of the attempt each outcome follows.
MARGIN_HEADERS = ("x-inferscale-first-margin", "x-inferscale-tail-margin")


async def _purge(app, locations: list[str]) -> int:
    """Drop blobs from every vLLM worker's memory tiers; returns how many they held. vLLM's
    prefix cache is left alone: its blocks of a forgotten memory are unreachable, as every
    memory prompt's salt names the facts it holds, and fact ids are never reused."""
    purged = sum(await app.state.engine_client.collective_rpc("inferscale_purge",
                                                              args=(locations,)))
    M.purged_blobs.inc(purged)
    return purged


def _client(scope) -> str | None:
    client = scope.get("client")
    return client[0] if client else None


class MemoryFrontend:
    """ASGI middleware: memory for owned chat completions, guard for every generation route."""

    def __init__(self, app, settings: Settings | None = None):
        self.app = app
        self.settings = settings or get_settings()
        self.access = Access(self.settings)
        self._salt_key = hashlib.sha256(
            b"inferscale cache salt\0" + (self.settings.plan_secret or "").encode()).digest()
        self._runtime: MemoryRuntime | None = None
        self._lock = asyncio.Lock()
        # vLLM adds --middleware outside its own --api-key check; run that check first here.
        tokens = [t for t in (self.settings.vllm_api_keys or [os.environ.get("VLLM_API_KEY", "")])
                  if t]
        self._invalidations: asyncio.Task | None = None
        self._app: Any = None  # vLLM's FastAPI app, known at start-up
        self._authenticated = self._handle
        if tokens:
            from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

            self._authenticated = AuthenticationMiddleware(self._handle, tokens=tokens)

    async def _rt(self) -> MemoryRuntime:
        async with self._lock:
            if self._runtime is None:
                loop = asyncio.get_running_loop()
                self._runtime = await loop.run_in_executor(None, MemoryRuntime, self.settings)
        return self._runtime

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan" and self._invalidations is None:
            self._app = scope["app"]
            self._app.include_router(build_router(self))
            self._invalidations = self._start_invalidation_consumer(self._app)
        if scope["type"] in ("http", "websocket"):
            try:
                check_request(self.settings, scope.get("method", "GET"), scope["path"],
                              _headers(scope))
            except FrontendError as exc:
                if scope["type"] == "websocket":  # closed before accepting: HTTP 403
                    return await send({"type": "websocket.close", "code": 1008})
                return await _error(send, exc.status, exc.message)
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        await self._authenticated(scope, receive, send)

    async def _handle(self, scope, receive, send):
        headers = _headers(scope)
        try:
            if scope["path"] in CONTROL_PATHS:
                self.access.authorize_control(headers, _client(scope))
            body = await read_body(receive, headers, self.settings.max_body_bytes)
            rewritten = await self._rewrite(scope["path"], body, headers, _client(scope))
        except FrontendError as exc:
            return await _error(send, exc.status, exc.message, exc.headers)
        except Exception as exc:  # noqa: BLE001 - e.g. the database is down: say so, live on
            log.exception("memory front end failed")
            return await _error(send, 503, f"memory unavailable: {type(exc).__name__}")
        client = _Downstream(receive)
        try:
            if rewritten.auto is None:
                return await self.app(_with_length(scope, rewritten.body),
                                      client.receiver(rewritten.body),
                                      _adding(send, rewritten.headers))
            await self._answer_auto(scope, client, send, rewritten)
        finally:
            client.close()

    async def _answer_auto(self, scope, client: _Downstream, send, rewritten: _Rewritten):
        """``"recompute": "auto"``: the m = 0 attempt behind a ``FirstTokenGate``; where the
        gate abandons it, the request answered again with the tail recomputed, behind a gate of
        its own where ``text_threshold`` is set; where that one abandons too, with every fact
        as text."""
        step = rewritten.auto
        assert step is not None and rewritten.retry is not None
        body, headers = rewritten.body, rewritten.headers
        margins: dict[str, str] = {}
        for outcome, margin_header in zip(OUTCOMES, (*MARGIN_HEADERS, None), strict=True):
            answered = {**headers, **margins, "x-inferscale-recompute-auto": outcome}
            if step is None or margin_header is None:
                M.auto_recompute.labels(outcome).inc()
                return await self.app(_with_length(scope, body), client.receiver(body),
                                      _adding(send, answered))
            gate = await self._decided_attempt(scope, client, send, body, step, answered,
                                               margin_header)
            if not gate.abandoned:
                if gate.decision is not None:
                    M.auto_recompute.labels(outcome).inc()
                return
            margins[margin_header] = f"{gate.margin:.3f}"
            step = step.then()
            try:
                body, headers = await rewritten.retry(outcome == "kept", step is not None)
            except FrontendError as exc:
                return await _error(send, exc.status, exc.message, exc.headers)
            except Exception as exc:  # noqa: BLE001 - as for the first attempt
                log.exception("memory front end failed composing a recompute")
                return await _error(send, 503, f"memory unavailable: {type(exc).__name__}")

    async def _decided_attempt(self, scope, client: _Downstream, send, body: bytes,
                               auto: AutoRecompute, headers: dict[str, str], margin_header: str
                               ) -> FirstTokenGate:
        """An attempt behind a gate. Non-streamed, a one-token probe decides first (abandoned,
        a non-streamed answer would have run to its ``max_tokens``); kept, the answer is then
        generated once, over the probe's prefix-cached blocks, through a gate that keeps it.
        Where the probe gives no decision (an error), the attempt runs gated as it is."""
        probe = _one_token(body)
        if probe is not None:
            trial = await self._gated_attempt(scope, client, _discard, probe, auto, headers,
                                              margin_header)
            if trial.abandoned:
                return trial
            if trial.decision is not None:
                auto = replace(auto, threshold=0.0)
        return await self._gated_attempt(scope, client, send, body, auto, headers, margin_header)

    async def _gated_attempt(self, scope, client: _Downstream, send, body: bytes,
                             auto: AutoRecompute, headers: dict[str, str], margin_header: str
                             ) -> FirstTokenGate:
        """One attempt behind a ``FirstTokenGate``: released to the client (with ``headers`` and
        its margin) or abandoned before the client sees a byte of it."""
        abort = asyncio.Event()

        def released_headers(_: Decision, margin: float | None) -> dict[str, str]:
            return {**headers, **({margin_header: f"{margin:.3f}"} if margin is not None
                                  else {})}

        gate = FirstTokenGate(auto, _adding(send, {}), released_headers)

        async def attempt_send(message):
            await gate(message)
            if gate.abandoned:
                abort.set()  # Starlette's disconnect listener (ASGI < 2.4) cancels the stream

        # Spec 2.3: Starlette also listens for the disconnect, which ``abort`` delivers.
        attempt = {**_with_length(scope, body),
                   "asgi": {**scope.get("asgi", {}), "spec_version": "2.3"}}
        try:
            await self.app(attempt, client.receiver(body, abort), attempt_send)
        except Exception:
            if not gate.abandoned:
                raise
        return gate

    def _bootstrap(self) -> str | None:
        from inferscale.platform.endpoints import InfraError, resolve_kafka_bootstrap

        try:
            return resolve_kafka_bootstrap(self.settings)
        except InfraError:
            return None

    def _start_invalidation_consumer(self, app) -> asyncio.Task | None:
        """Consume cache invalidations (forgets made anywhere) for this server's lifetime."""
        from inferscale.pipeline.invalidation import consume_invalidations

        bootstrap = self._bootstrap()
        if bootstrap is None:
            log.warning("no Kafka broker configured: forgets made elsewhere are not purged "
                        "from this server's memory tiers")
            return None
        return asyncio.create_task(consume_invalidations(
            bootstrap, self.settings.invalidation_topic, lambda locs: _purge(app, locs),
            security=kafka_security(self.settings)))

    # --- the memory API's service (``memory_api.MemoryService``) -------------------------------

    async def runtime(self) -> MemoryRuntime:
        return await self._rt()

    async def drop_blobs(self, user_id: str, locations: list[str]) -> int:
        """Remove retired facts' blobs from the durable tier, this server's memory tiers now and
        every other server's through an invalidation (no prefix-cache reset: a plan never names
        a retired fact's blob); returns how many this server's tiers held."""
        from inferscale.pipeline.invalidation import publish_invalidation

        if not locations:
            return 0
        rt = await self._rt()
        await asyncio.to_thread(rt.store.delete, locations)
        purged = sum(await self._app.state.engine_client.collective_rpc(
            "inferscale_purge", args=(locations,)))
        M.purged_blobs.inc(purged)
        if (bootstrap := self._bootstrap()) is not None:
            await publish_invalidation(bootstrap, self.settings.invalidation_topic, user_id,
                                       locations, kafka_security(self.settings))
        return int(purged)

    async def memory_tiers(self, locations: list[str]) -> list[list[str]] | None:
        """For each blob, the memory tiers of this server's vLLM workers that hold it (None:
        the workers did not answer within ``TIERS_TIMEOUT_S``)."""
        if not locations:
            return []
        try:
            per_worker = await asyncio.wait_for(self._app.state.engine_client.collective_rpc(
                "inferscale_tiers", args=(locations,)), TIERS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a listing must not fail for want of tier status
            log.warning("vLLM workers gave no tier status", exc_info=True)
            return None
        return [sorted({tier for worker in per_worker for tier in worker[i]})
                for i in range(len(locations))]

    async def forget(self, user_id: str) -> dict:
        """Forget a user: rows (with a tombstone), durable blobs, this server's memory tiers
        now, every other server's through an invalidation (``_purge``: no prefix-cache reset)."""
        from inferscale.pipeline.forget import forget_user
        from inferscale.pipeline.invalidation import publish_invalidation

        rt = await self._rt()
        forgotten = await forget_user(rt.engine, rt.store, user_id)
        purged = await _purge(self._app, forgotten.locations)
        if (bootstrap := self._bootstrap()) is not None:
            await publish_invalidation(bootstrap, self.settings.invalidation_topic, user_id,
                                       forgotten.locations, kafka_security(self.settings))
        log.info("forgot a user", extra={"facts": forgotten.facts, "blobs": forgotten.blobs})
        return {"user": user_id, "facts_deleted": forgotten.facts,
                "blobs_deleted": forgotten.blobs, "purged_from_memory": purged}

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
        if path != CHAT_PATH or not isinstance(data, dict):
            return _Rewritten(body)
        owner, options = owner_and_options(data, headers, self.settings)
        if owner is None:
            return _Rewritten(json.dumps(data).encode())
        self.access.authorize(headers, owner, scope=options.scope, client=client)
        messages, query = chat_messages(data)
        rt = await self._rt()
        if options.recompute != "auto":
            return _Rewritten(*await self._memory_body(rt, data, owner, options, messages, query))
        tail = self.settings.recompute_auto_tail
        recomputed = options.model_copy(update={"recompute": tail})
        if options.mode != "inject" or data.get("n") not in (None, 1) or tail == 0:
            return _Rewritten(*await self._memory_body(rt, data, owner, recomputed, messages,
                                                       query))
        auto = AutoRecompute(options.recompute_margin, client_top_logprobs(data), tail,
                             options.recompute_text_margin)
        original = dict(data)

        async def retry(tail_only: bool, gated: bool) -> tuple[bytes, dict[str, str]]:
            """The request composed again: the tail recomputed, or every fact as text."""
            again = dict(original)
            if gated:
                ask_for_margin(again)
            return await self._memory_body(
                rt, again, owner, recomputed if tail_only
                else recomputed.model_copy(update={"mode": "text"}), messages, query)

        ask_for_margin(data)
        body, extra = await self._memory_body(
            rt, data, owner, options.model_copy(update={"recompute": 0}), messages, query)
        return _Rewritten(body, extra, auto, retry)

    async def _memory_body(self, rt: MemoryRuntime, data: dict, owner: str,
                           options: MemoryOptions, messages: list[dict], query: str
                           ) -> tuple[bytes, dict[str, str]]:
        """The request as vLLM receives it: the composed prompt's token ids, the signed plan
        and the owner's cache salt (``data`` is changed in place); and the response headers
        that account for it."""
        prompt = await compose(rt, owner, options, messages, query)
        started = time.perf_counter()
        params: dict = {"prompt_token_ids": prompt.token_ids}
        checksums = scaled = None
        if prompt.plan is not None:
            params[PLAN_KEY] = sign(prompt.plan, self.settings.plan_secret or "")
            checksums = [s.checksum for s in prompt.plan.segments]
            scaled = prompt.plan.key_scales
        # Every memory prompt is salted per owner and the facts it holds (and their blobs, and
        # whether its keys are scaled), keyed by the server's secret: no other client can
        # compute it to probe the owner's prefix-cache blocks, and a forgotten or edited fact's
        # blocks are never reached again (fact ids are never reused).
        digest = hmac.new(self._salt_key, json.dumps(
            [owner, rt.fingerprint, prompt.fact_ids, checksums, scaled, data.get("cache_salt")]
        ).encode(), hashlib.sha256).hexdigest()
        data["cache_salt"] = f"inferscale-{digest[:32]}"
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


_DISCONNECT = {"type": "http.disconnect"}


class _Downstream:
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


def _one_token(body: bytes) -> bytes | None:
    """A non-streamed request made to generate one token (None: a streamed request, whose
    gate aborts it at its first token anyway)."""
    data = json.loads(body)
    if data.get("stream"):
        return None
    data["max_tokens"] = 1
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    return json.dumps(data).encode()


async def _discard(_message: dict) -> None:
    """The ``send`` of a probe: the client never sees it."""


def _with_length(scope: dict, body: bytes) -> dict:
    return {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                 if k.lower() != b"content-length"]
            + [(b"content-length", str(len(body)).encode())]}


def _adding(send, headers: dict[str, str]):
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


def _headers(scope) -> dict[str, str]:
    """A request's headers, lower-case keyed (a repeated header: its last value)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def _error(send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]
                + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]})
    await send({"type": "http.response.body", "body": json.dumps(
        {"error": {"message": message, "type": kind, "code": status}}).encode()})
