"""Composing a memory prompt: retrieve the owner's pinned facts and top-k facts and lay out the
token ids ``[preamble][pinned facts][injected facts][text facts][chat]`` with the signed
injection plan for the facts whose KV can be injected (best fact last, or in stored order; the
last ``recompute`` facts and any fact without usable KV as text). Pinned facts come first, in
id order, in every prompt of the owner, so the engine's prefix cache keeps them exact across
requests (``Plan.exact``); where one has no usable KV, every fact goes as text. In relevance
order a fact holding a lead blob goes first."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachetools import TTLCache

from inferscale.contracts.blob_name import PREAMBLE, FactId, fact_blob, lead_blob
from inferscale.contracts.layout import PromptPlan
from inferscale.contracts.plan import Plan, Segment
from inferscale.core.settings import Settings
from inferscale.kv.kv_metrics import KV_METRICS
from inferscale.serving.guards import FrontendError
from inferscale.serving.metrics import FRONTEND_METRICS as M
from inferscale.serving.request_options import MemoryOptions

if TYPE_CHECKING:
    from inferscale.db.reads import RetrievedFact

log = logging.getLogger("inferscale.serving.compose")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
SERVED_STAMP_S = 60.0  # how often a fact's "served at" is written, at most
STAMP_BATCH_S = 0.5  # how long served stamps wait to be written with others
TEXT_PART_TYPES = ("text", "input_text")


@dataclass
class MemoryPrompt:
    """What the front end decided for one request."""

    token_ids: list[int]
    fact_ids: list[FactId]  # prompt order: injected facts, then text facts
    pinned: list[FactId]  # the first of them, in every prompt of the owner
    retrieved: int  # how many facts retrieval ranked for the question
    plan: Plan | None
    facts_injected: int
    facts_text: int
    injected_tokens: int
    text_memory_tokens: int
    retrieval_ms: float


class MemoryRuntime:
    """Per-process state, created on the first memory request (inside the server's loop)."""

    def __init__(self, settings: Settings):
        from transformers import AutoTokenizer

        from inferscale.contracts.fingerprint import model_fingerprint
        from inferscale.contracts.layout import MemoryLayout
        from inferscale.core.model_prep import resolve_model_path
        from inferscale.db.engine import create_engine
        from inferscale.kv.store import KVStore
        from inferscale.pipeline.embedder import load_embedder
        from inferscale.serving.owner_index import OwnerIndex

        model_path = resolve_model_path(settings)
        self.settings = settings
        self.layout = MemoryLayout(AutoTokenizer.from_pretrained(model_path))
        self.fingerprint = model_fingerprint(model_path)
        self.embedder = load_embedder(settings)
        self.engine = create_engine(settings=settings)
        self.index = OwnerIndex(self.engine, self.fingerprint, settings.retrieval_index_bytes,
                                settings.filter_inline_cost, settings.filter_max_cost)
        self.store = KVStore.from_settings(settings, self.fingerprint, host_bytes=0)
        self._served: TTLCache[int, bool] = TTLCache(maxsize=1 << 17, ttl=SERVED_STAMP_S)
        self._unwritten: dict[str, tuple[dict[int, None], dict[int, None]]] = {}
        self._writing: asyncio.Task[None] | None = None

    def note_served(self, owner: str, served: list[int], missed: list[int]) -> None:
        """In the background, off the request: stamp the owner's ``served`` facts as served (each
        at most every ``SERVED_STAMP_S``, well within the eviction grace) and ask for the
        ``missed`` ones (served without KV) to be encoded again where their KV was evicted
        (``db/kv_budget.py``). Written ``STAMP_BATCH_S`` later, with every other request's
        of that time: one write per owner per batch, not one per request."""
        stamped = [i for i in served if i not in self._served or i in missed]
        if not stamped:
            return
        for fact_id in stamped:
            self._served[fact_id] = True
        unwritten = self._unwritten.setdefault(owner, ({}, {}))
        unwritten[0].update(dict.fromkeys(stamped))
        unwritten[1].update(dict.fromkeys(missed))
        if self._writing is None or self._writing.done():
            self._writing = asyncio.get_running_loop().create_task(self._write_later())

    async def _write_later(self) -> None:
        await asyncio.sleep(STAMP_BATCH_S)
        await self.write_served()

    async def write_served(self) -> None:
        """Write what ``note_served`` holds now, owner by owner (a failure is logged: the
        bookkeeping never touches an answer)."""
        from inferscale.db.kv_budget import note_served

        batch, self._unwritten = self._unwritten, {}
        for owner, (stamped, missed) in batch.items():
            try:
                async with self.engine.connect() as conn:
                    if not missed:  # one statement, atomic alone: no BEGIN / COMMIT round trips
                        await conn.execution_options(isolation_level="AUTOCOMMIT")
                    wanted = await note_served(conn, owner, self.fingerprint, list(stamped),
                                               list(missed))
                    await conn.commit()
                if wanted:
                    M.reencodes_wanted.inc(wanted)
            except Exception as exc:  # noqa: BLE001 - bookkeeping: the answer is unaffected
                log.warning("cannot record that %s's memory was served: %s", owner, exc)


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


def chat_messages(data: dict) -> tuple[list[dict], str]:
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


async def compose(rt: MemoryRuntime, owner: str, options: MemoryOptions, messages: list[dict],
                  query: str) -> MemoryPrompt:
    """Retrieve the owner's facts and lay out the prompt: best fact last, as the paper does, or
    in stored (conversation) order. Injected facts come first (external KV is a prefix); the
    last ``options.recompute`` facts and any fact without usable KV follow as text, in order."""
    from inferscale.serving.retrieval import retrieve

    mode = options.mode
    started = time.perf_counter()
    found = ([] if mode == "none" else
             await retrieve(rt.index, rt.embedder, owner, query, options.k, options.scope,
                            options.where, rt.settings.pinned_max))
    pins = [f for f in found if f.pinned]  # first, in id order
    facts = found[len(pins):]
    retrieval_ms = (time.perf_counter() - started) * 1000
    M.retrieval_seconds.observe(retrieval_ms / 1000)
    if found:
        rt.note_served(owner, [f.id for f in found], [f.id for f in found if not f.kv_location])
    if not isinstance(options.recompute, int):
        raise ValueError("the front end decides an auto recompute before composing")
    if options.order == "time":
        facts.sort(key=lambda f: f.id)
    elif pins:
        facts = facts[::-1]  # the first pinned fact leads
    else:
        # Never one of the facts a tail recompute (explicit or auto's) prefills: every attempt
        # and mode of a request reads the same order.
        facts = lead_first(facts[::-1],
                           max(options.recompute, rt.settings.recompute_auto_tail))
    head = facts[:max(len(facts) - options.recompute, 0)] if mode == "inject" else []
    pins_injectable = all(f.kv_location and f.token_ids for f in pins)
    injectable = ([f for f in pins + head if f.kv_location and f.token_ids]
                  if mode == "inject" and pins_injectable else [])
    as_text = [f for f in pins + facts if f not in injectable]
    if mode == "inject":
        M.fallbacks.labels("not_encoded").inc(sum(
            not (f.kv_location and f.token_ids) for f in pins + head))
    composing = time.perf_counter()
    injected_segments = [list(f.token_ids) for f in injectable if f.token_ids]  # every one
    text_segments, prompt = await asyncio.get_running_loop().run_in_executor(
        None, _layout, rt, [f.text for f in as_text], injected_segments, messages)
    plan = None
    if mode == "inject":
        plan_segments = [Segment.of(PREAMBLE, 0, rt.layout.preamble_ids)]
        plan_segments += [
            Segment.of(lead_blob(f.id), start, ids, f.kv_lead_checksum)
            if i == 0 and options.lead and f.kv_lead_checksum else
            Segment.of(fact_blob(f.id), start, ids, f.kv_checksum)
            for i, (f, ids, (start, _)) in enumerate(zip(
                injectable, injected_segments, prompt.fact_spans, strict=False))]
        exact = prompt.fact_spans[len(pins) - 1][1] if pins and injectable else 0
        plan = Plan(rt.fingerprint, plan_segments, options.key_scales, exact)
        M.facts.labels("lead").inc(sum(s.name.lead for s in plan_segments))
    injected = min(plan.end, len(prompt.token_ids) - 1) if plan else 0
    KV_METRICS.stage_seconds.labels("compose").observe(time.perf_counter() - composing)
    fact_ids = [f.id for f in injectable + as_text]
    return MemoryPrompt(prompt.token_ids, fact_ids, [f.id for f in pins], len(facts), plan,
                        len(injectable), len(as_text), injected, sum(map(len, text_segments)),
                        retrieval_ms)


def lead_first(facts: list[RetrievedFact], tail: int) -> list[RetrievedFact]:
    """Facts best last, with the least relevant one holding a lead blob (for the served model) moved
    first (never one of the best ``tail``): a request needs one lead blob, and most facts have
    none (``lead_share``). The same order in every memory mode, so injected and prefilled
    answers read the same prompt. Where none holds one, the first fact is injected from its
    own blob."""
    head = len(facts) - tail
    leader = next((i for i, f in enumerate(facts[:max(head, 0)])
                   if f.kv_lead_checksum), None)
    if leader is None:
        return facts
    return [facts[leader], *facts[:leader], *facts[leader + 1:]]


def _layout(rt: MemoryRuntime, texts: list[str], injected: list[list[int]], messages: list[dict]
            ) -> tuple[list[list[int]], PromptPlan]:
    """Tokenise the text facts and the chat (blocking: runs in an executor)."""
    text_segments = [rt.layout.fact_segment(text) for text in texts]
    return text_segments, rt.layout.compose(injected + text_segments, messages)
