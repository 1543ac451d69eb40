"""Memory front end inside vLLM's API server
(``--middleware inferscale.serving.frontend.MemoryFrontend``).

A chat completion naming a memory owner (``user`` field or ``X-InferScale-User`` header) is
rewritten before vLLM sees it: the last user message is embedded, the owner's top-k facts are
retrieved, the prompt is composed with the memory layout and sent as token ids, with a signed
injection plan for the encoded facts (``kv_transfer_params``) and a per-memory ``cache_salt``.
Requests without an owner pass through untouched. Per request, ``"inferscale": {"mode": ...,
"k": ..., "recompute": ..., "order": ..., "lead": ..., "key_scales": ...}`` in the body (or
``X-InferScale-Memory`` / ``-K`` / ``-Recompute`` / ``-Order`` / ``-Lead`` / ``-Key-Scales``
headers) overrides the defaults; modes: ``inject`` (default), ``text`` (same facts prefilled
as text), ``none``; ``recompute``: the last m facts are prefilled after the injected ones;
``order``: ``relevance`` (best last) or ``time`` (stored order); ``lead``: the first injected
fact uses its lead encoding (after the preamble alone: exact there) where it has one;
``key_scales``: how strongly the connector applies its per-layer key scales to the injected
facts, true / false or a strength in [0, 1] (each scale raised to it; ``key_scales.py``; a
no-op where it has none).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from inferscale.contracts.layout import PromptPlan
from inferscale.contracts.plan import PLAN_KEY, PREAMBLE, Plan, Segment, lead_name, sign
from inferscale.platform.settings import Settings, get_settings
from inferscale.serving.metrics import FRONTEND_METRICS as M
from inferscale.serving.metrics import KV_METRICS

log = logging.getLogger("inferscale.serving.frontend")

MODES = ("inject", "text", "none")
ORDERS = ("relevance", "time")
MAX_K = 200
CHAT_PATH = "/v1/chat/completions"
FORGET_PATH = "/v1/memory/forget"
# vLLM's engine-control routes (scaling, sleep, cache resets, RPC, profiling, adapters):
# admin keys only (or anonymous where anonymous access is the chosen policy).
CONTROL_PATHS = frozenset({
    "/scale_elastic_ep", "/is_scaling_elastic_ep", "/collective_rpc", "/sleep", "/wake_up",
    "/release_kv_cache_memory", "/reset_prefix_cache", "/reset_mm_cache",
    "/reset_encoder_cache", "/start_profile", "/stop_profile", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/fault_tolerance/apply"})
PREFIX_RESET_TRIES = 50  # vLLM resets its prefix cache only between requests
BODY_METHODS = ("POST", "PUT", "PATCH")
# Keys that reach the engine's Request.kv_transfer_params (directly or via SamplingParams
# extra_args); only the front end may set them, on any route.
RESERVED_KEYS = ("kv_transfer_params",)
FORM_RESERVED = (b"kv_transfer_params", b"vllm_xargs")
PARSE_IN_THREAD_BYTES = 64 * 1024
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = ("text", "input_text")


class FrontendError(Exception):
    """A request the front end refuses, with its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class MemoryPrompt:
    """What the front end decided for one request."""

    token_ids: list[int]
    fact_ids: list[int]  # prompt order: injected facts, then text facts
    plan: Plan | None
    facts_injected: int
    facts_text: int
    injected_tokens: int
    text_memory_tokens: int
    retrieval_ms: float


class _Runtime:
    """Per-process state, created on the first memory request (inside the server's loop)."""

    def __init__(self, settings: Settings):
        from transformers import AutoTokenizer

        from inferscale.contracts.fingerprint import model_fingerprint
        from inferscale.contracts.layout import MemoryLayout
        from inferscale.db.engine import create_engine
        from inferscale.kv.store import KVStore
        from inferscale.pipeline.embedder import load_embedder
        from inferscale.platform.model_prep import resolve_model_path
        from inferscale.serving.owner_index import OwnerIndex

        model_path = resolve_model_path(settings)
        self.settings = settings
        self.layout = MemoryLayout(AutoTokenizer.from_pretrained(model_path))
        self.fingerprint = model_fingerprint(model_path)
        self.embedder = load_embedder(settings)
        self.engine = create_engine(settings=settings)
        self.index = OwnerIndex(self.engine, settings.retrieval_index_bytes)
        self.store = KVStore.from_settings(settings, self.fingerprint, host_bytes=0)


@dataclass(frozen=True)
class MemoryOptions:
    """Per-request memory choices: mode, how many facts, their order, how many of the last
    to recompute."""

    mode: str
    k: int
    recompute: int = 0
    order: str = "relevance"
    lead: bool = True  # the first injected fact uses its lead encoding, where it has one
    key_scales: float = 1.0  # the strength the connector applies its key scales with (0: not)


def _int_option(name: str, raw: object) -> int:
    try:
        value = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        raise FrontendError(400, f"{name} must be an integer, got {str(raw)[:40]!r}") from None
    if not 0 <= value <= MAX_K:
        raise FrontendError(400, f"{name} must be between 0 and {MAX_K}")
    return value


def _bool_option(name: str, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
        return raw.lower() in ("true", "1")
    raise FrontendError(400, f"{name} must be true or false, got {str(raw)[:40]!r}")


def _strength_option(name: str, raw: object) -> float:
    """true / false, or a number in [0, 1] (a header's text too)."""
    if isinstance(raw, bool) or (isinstance(raw, str) and raw.lower() in ("true", "false")):
        return 1.0 if _bool_option(name, raw) else 0.0
    try:
        value = float(raw) if isinstance(raw, (int, float, str)) else math.nan
    except (ValueError, OverflowError):
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise FrontendError(400, f"{name} must be true, false or a number in [0, 1], "
                                 f"got {str(raw)[:40]!r}")
    return value


def _owner_and_options(data: dict, headers: dict[str, str], settings: Settings
                       ) -> tuple[str | None, MemoryOptions]:
    owner = headers.get("x-inferscale-user") or data.get("user")
    options = data.pop("inferscale", None) or {}
    if not isinstance(options, dict):
        raise FrontendError(400, "'inferscale' must be an object like {\"mode\": \"inject\"}")
    mode = str(options.get("mode") or headers.get("x-inferscale-memory") or settings.memory_mode)
    if mode not in MODES:
        raise FrontendError(400, f"unknown memory mode {mode!r}; use one of {MODES}")
    k = _int_option("k", options.get("k", headers.get("x-inferscale-k", settings.top_k)))
    recompute = _int_option("recompute", options.get(
        "recompute", headers.get("x-inferscale-recompute", settings.recompute_tail)))
    order = options.get("order") or headers.get("x-inferscale-order") or settings.fact_order
    if not isinstance(order, str) or order not in ORDERS:
        raise FrontendError(400, f"unknown fact order; use one of {ORDERS}")
    lead = _bool_option("lead", options.get(
        "lead", headers.get("x-inferscale-lead", settings.lead_encoding)))
    key_scales = _strength_option("key_scales", options.get(
        "key_scales", headers.get("x-inferscale-key-scales",
                                  settings.key_scale_strength if settings.key_scales != "off"
                                  else 0.0)))
    if owner is not None and (not isinstance(owner, str) or not owner or len(owner) > 256):
        raise FrontendError(400, "the memory owner must be a non-empty string of <= 256 chars")
    return owner, MemoryOptions(mode, k, recompute, order, lead, key_scales)


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


def _text(content: object) -> str:
    """OpenAI message content (a string, text parts or null) as one string."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict)
                 and part.get("type") in TEXT_PART_TYPES]
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) == len(content):  # every part a text part
            return "\n".join(strings)
    raise FrontendError(400, "memory requests take text content: a string or a list of "
                             "{\"type\": \"text\", \"text\": ...} parts")


def _messages(data: dict) -> tuple[list[dict], str]:
    """The chat as plain ``{"role", "content"}`` messages (developer = system) and the question."""
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise FrontendError(400, "'messages' must be a non-empty list")
    messages = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in MESSAGE_ROLES:
            raise FrontendError(400, f"each message needs a role in {MESSAGE_ROLES}")
        role = "system" if m["role"] == "developer" else m["role"]
        messages.append({"role": role, "content": _text(m.get("content"))})
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise FrontendError(400, "no user message to answer")
    return messages, users[-1]


async def compose(rt: _Runtime, owner: str, options: MemoryOptions, messages: list[dict],
                  query: str) -> MemoryPrompt:
    """Retrieve the owner's facts and lay out the prompt: best fact last, as the paper does, or
    in stored (conversation) order. Injected facts come first (external KV is a prefix); the
    last ``options.recompute`` facts and any fact without usable KV follow as text, in order."""
    from inferscale.serving.retrieval import retrieve

    mode = options.mode
    started = time.perf_counter()
    facts = ([] if mode == "none" else
             await retrieve(rt.index, rt.embedder, owner, query, options.k))
    retrieval_ms = (time.perf_counter() - started) * 1000
    M.retrieval_seconds.observe(retrieval_ms / 1000)
    if options.order == "time":
        facts.sort(key=lambda f: f.id)
    else:
        facts.reverse()
    head = facts[:max(len(facts) - options.recompute, 0)] if mode == "inject" else []
    injectable = [f for f in head if f.kv_location and f.token_ids
                  and f.model_fingerprint == rt.fingerprint]
    as_text = [f for f in facts if f not in injectable]
    for f in head:
        if f not in injectable:
            M.fallbacks.labels("other_model" if f.kv_location else "not_encoded").inc()
    composing = time.perf_counter()
    injected_segments = [list(f.token_ids) for f in injectable if f.token_ids]  # every one
    text_segments, prompt = await asyncio.get_running_loop().run_in_executor(
        None, _layout, rt, [f.text for f in as_text], injected_segments, messages)
    plan = None
    if mode == "inject":
        plan_segments = [Segment.of(PREAMBLE, 0, rt.layout.preamble_ids)]
        plan_segments += [
            Segment.of(lead_name(f.id), start, ids, f.kv_lead_checksum)
            if i == 0 and options.lead and f.kv_lead_checksum else
            Segment.of(str(f.id), start, ids, f.kv_checksum)
            for i, (f, ids, (start, _)) in enumerate(zip(
                injectable, injected_segments, prompt.fact_spans, strict=False))]
        plan = Plan(rt.fingerprint, plan_segments, options.key_scales)
    injected = min(plan.end, len(prompt.token_ids) - 1) if plan else 0
    KV_METRICS.stage_seconds.labels("compose").observe(time.perf_counter() - composing)
    fact_ids = [f.id for f in injectable + as_text]
    return MemoryPrompt(prompt.token_ids, fact_ids, plan, len(injectable), len(as_text), injected,
                        sum(map(len, text_segments)), retrieval_ms)


async def _purge(app, locations: list[str]) -> tuple[int, bool]:
    """Drop blobs from every vLLM worker's memory tiers and reset vLLM's prefix cache (which
    vLLM does only between requests: retried). Returns (blobs dropped, prefix cache reset)."""
    engine_client = app.state.engine_client
    purged = sum(await engine_client.collective_rpc("inferscale_purge", args=(locations,)))
    M.purged_blobs.inc(purged)
    for _ in range(PREFIX_RESET_TRIES):
        if await engine_client.reset_prefix_cache():
            return purged, True
        await asyncio.sleep(0.1)
    return purged, False


def _layout(rt: _Runtime, texts: list[str], injected: list[list[int]], messages: list[dict]
            ) -> tuple[list[list[int]], PromptPlan]:
    """Tokenise the text facts and the chat (blocking: runs in an executor)."""
    text_segments = [rt.layout.fact_segment(text) for text in texts]
    return text_segments, rt.layout.compose(injected + text_segments, messages)


def _parse_json(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge ints, deep nesting
        raise FrontendError(400, f"request body is not JSON this server accepts: "
                                 f"{type(exc).__name__}") from None


def _parse_request(body: bytes) -> object:
    """The JSON body, refused if it carries a reserved key anywhere (blocking: both scale with
    the body, so large bodies run this in a thread)."""
    data = _parse_json(body)
    if _has_reserved_key(data):
        raise FrontendError(400, "kv_transfer_params is reserved for the InferScale front end")
    return data


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


async def _read_body(receive, headers: dict[str, str], limit: int) -> bytes:
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


class MemoryFrontend:
    """ASGI middleware: memory for owned chat completions, guard for every generation route."""

    def __init__(self, app):
        self.app = app
        self.settings = get_settings()
        self._runtime: _Runtime | None = None
        self._lock = asyncio.Lock()
        # vLLM adds --middleware outside its own --api-key check; run that check first here.
        tokens = [t for t in (self.settings.vllm_api_keys or [os.environ.get("VLLM_API_KEY", "")])
                  if t]
        self._invalidations: asyncio.Task | None = None
        self._authenticated = self._handle
        if tokens:
            from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

            self._authenticated = AuthenticationMiddleware(self._handle, tokens=tokens)

    async def _rt(self) -> _Runtime:
        async with self._lock:
            if self._runtime is None:
                loop = asyncio.get_running_loop()
                self._runtime = await loop.run_in_executor(None, _Runtime, self.settings)
        return self._runtime

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan" and self._invalidations is None:
            self._invalidations = self._start_invalidation_consumer(scope["app"])
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        await self._authenticated(scope, receive, send)

    async def _handle(self, scope, receive, send):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            if scope["path"] in CONTROL_PATHS:
                authorize_control(self.settings, headers)
            body = await _read_body(receive, headers, self.settings.max_body_bytes)
            if scope["path"] == FORGET_PATH:
                return await _json(send, 200, await self._forget(scope, body, headers))
            body, extra_headers = await self._rewrite(scope["path"], body, headers)
        except FrontendError as exc:
            return await _error(send, exc.status, exc.message)
        except Exception as exc:  # noqa: BLE001 - e.g. the database is down: say so, live on
            log.exception("memory front end failed")
            return await _error(send, 503, f"memory unavailable: {type(exc).__name__}")

        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:  # after the body, the app only listens for the disconnect
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send_with_headers(message):
            if message["type"] == "http.response.start" and extra_headers and (
                    message["status"] < 400):  # a refused request says nothing of memory
                message = {**message, "headers": list(message.get("headers", []))
                           + [(k.encode(), v.encode()) for k, v in extra_headers.items()]}
            await send(message)

        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                      if k.lower() != b"content-length"]
                 + [(b"content-length", str(len(body)).encode())]}
        await self.app(scope, replay, send_with_headers)

    def _bootstrap(self) -> str | None:
        from inferscale.devstack.infra import InfraError, resolve_kafka_bootstrap

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
            bootstrap, self.settings.invalidation_topic, lambda locs: _purge(app, locs)))

    async def _forget(self, scope, body: bytes, headers: dict[str, str]) -> dict:
        """Forget a user: rows (with a tombstone), durable blobs, this server's memory tiers and
        prefix cache now, every other server's through an invalidation."""
        from inferscale.pipeline.forget import forget_user
        from inferscale.pipeline.invalidation import publish_invalidation

        data = _parse_json(body)
        user = data.get("user") if isinstance(data, dict) else None
        if not isinstance(user, str) or not user or len(user) > 256:
            raise FrontendError(400, 'forget takes {"user": "<memory owner>"}')
        authorize(self.settings, headers, user)
        rt = await self._rt()
        forgotten = await forget_user(rt.engine, rt.store, user)
        purged, reset = await _purge(scope["app"], forgotten.locations)
        if (bootstrap := self._bootstrap()) is not None:
            await publish_invalidation(bootstrap, self.settings.invalidation_topic, user,
                                       forgotten.locations)
        log.info("forgot a user", extra={"facts": forgotten.facts, "blobs": forgotten.blobs})
        return {"user": user, "facts_deleted": forgotten.facts, "blobs_deleted": forgotten.blobs,
                "purged_from_memory": purged,
                "prefix_cache_reset": reset}

    async def _rewrite(self, path: str, body: bytes, headers: dict[str, str]
                       ) -> tuple[bytes, dict[str, str]]:
        content_type = headers.get("content-type", "")
        if content_type.startswith(("multipart/", "application/x-www-form-urlencoded")):
            if any(name in unquote_to_bytes(body.replace(b"+", b" ")) for name in FORM_RESERVED):
                raise FrontendError(400, "kv_transfer_params and vllm_xargs are reserved for "
                                         "the InferScale front end")
            return body, {}
        if not body.strip():
            return body, {}
        data = (await asyncio.to_thread(_parse_request, body)
                if len(body) > PARSE_IN_THREAD_BYTES else _parse_request(body))
        if path != CHAT_PATH or not isinstance(data, dict):
            return body, {}
        owner, options = _owner_and_options(data, headers, self.settings)
        if owner is None:
            return json.dumps(data).encode(), {}
        authorize(self.settings, headers, owner)
        messages, query = _messages(data)
        rt = await self._rt()
        prompt = await compose(rt, owner, options, messages, query)
        started = time.perf_counter()
        params: dict = {"prompt_token_ids": prompt.token_ids}
        checksums = scaled = None
        if prompt.plan is not None:
            params[PLAN_KEY] = sign(prompt.plan, self.settings.plan_secret or "")
            checksums = [s.checksum for s in prompt.plan.segments]
            scaled = prompt.plan.key_scales
        # Every memory prompt is salted per owner (and memory version, and whether its keys are
        # scaled): no other user or variant can probe or reuse its prefix-cache blocks.
        digest = hashlib.sha256(json.dumps(
            [owner, rt.fingerprint, checksums, scaled, data.get("cache_salt")]).encode()
        ).hexdigest()
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
            "x-inferscale-facts": str(prompt.facts_injected + prompt.facts_text),
            "x-inferscale-facts-injected": str(prompt.facts_injected),
            "x-inferscale-fact-ids": ",".join(map(str, prompt.fact_ids)),
            "x-inferscale-prompt-tokens": str(len(prompt.token_ids)),
            "x-inferscale-injected-tokens": str(prompt.injected_tokens),
            "x-inferscale-prefilled-tokens": str(len(prompt.token_ids) - prompt.injected_tokens),
            "x-inferscale-retrieval-ms": f"{prompt.retrieval_ms:.1f}",
        }


ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
               413: "request_too_large", 503: "service_unavailable"}


async def _json(send, status: int, payload: dict) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def _error(send, status: int, message: str) -> None:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    await _json(send, status, {"error": {"message": message, "type": kind, "code": status}})
