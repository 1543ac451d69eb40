"""The soak's load: questions through the OpenAI API (the official client), memory edits and
deletes through the memory API, and turns published to the broker, each logged with the time it
happened (wall clock, the host's: the server's database shares it).

Invariants: a request's log entry carries what the server said it used (the fact ids header), so
the end-of-run checks can compare every answer with the edit log; a turn is logged as published
only once the broker acknowledged it (a send that fails while the broker restarts is sent again);
an edit is logged when the API answered, so any request that starts later must not see the old
fact.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass

import openai

from inferscale.client import AsyncMemoryClient, MemoryAPIError
from inferscale.core.settings import Settings
from inferscale.lab.bench.soak_population import Population, User
from inferscale.pipeline.kafka import kafka_security, make_producer


@dataclass(frozen=True)
class Answer:
    """One question and how it was answered (``kind``: see :func:`answer_kind`)."""

    user: str
    started: float
    ttft: float | None
    kind: str
    fact_ids: tuple[int, ...]
    error: str | None = None
    pair: str | None = None  # the same prompt asked inject then text: both carry one id


@dataclass(frozen=True)
class Edit:
    """A fact retired through the memory API (``new_id``: its new version, None: deleted)."""

    user: str
    op: str
    fact_id: int
    new_id: int | None
    done: float


def answer_kind(mode: str, headers: dict[str, str]) -> str:
    """How a request was answered, from its response headers: ``text-prefill`` (asked as
    text, the baseline), ``text-auto`` / ``recomputed`` (recompute auto answered again with
    every fact as text / the tail recomputed), ``no-memory`` (the user had no facts yet),
    ``text-fallback`` (no fact had KV), ``partial`` (some had), ``injected`` (all had)."""
    if mode == "text":
        return "text-prefill"
    decision = headers.get("x-inferscale-recompute-auto")
    if decision == "text":
        return "text-auto"
    if decision == "recomputed":
        return "recomputed"
    facts = int(headers.get("x-inferscale-facts", "0"))
    injected = int(headers.get("x-inferscale-facts-injected", "0"))
    if facts == 0:
        return "no-memory"
    return "injected" if injected == facts else "partial" if injected else "text-fallback"


def error_class(exc: BaseException) -> str:
    """A failed request's class: its HTTP status, a timeout, a refused / dropped connection."""
    if isinstance(exc, openai.APIStatusError):
        return f"http-{exc.status_code}"
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    if isinstance(exc, MemoryAPIError):
        return f"memory-api-{exc.status}"
    return type(exc).__name__


async def ask(client: openai.AsyncOpenAI, user: str, question: str, mode: str, k: int,
              pair: str | None = None, max_tokens: int = 16) -> Answer:
    """One streamed question (a fresh cache salt: no prefix-cache reuse between requests);
    TTFT = the first chunk with content."""
    started, began = time.time(), time.perf_counter()
    try:
        async with client.chat.completions.with_streaming_response.create(
                model="inferscale", messages=[{"role": "user", "content": question}],
                stream=True, max_tokens=max_tokens, temperature=0, user=user,
                extra_body={"inferscale": {"mode": mode, "k": k},
                            "cache_salt": uuid.uuid4().hex}) as response:
            headers = {h: v for h, v in response.headers.items() if h.startswith("x-inferscale")}
            ttft = None
            async for chunk in await response.parse():
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - began
            ttft = ttft if ttft is not None else time.perf_counter() - began
    except (openai.OpenAIError, OSError) as exc:
        return Answer(user, started, None, "error", (), error_class(exc), pair)
    ids = tuple(int(i) for i in headers.get("x-inferscale-fact-ids", "").split(",") if i)
    return Answer(user, started, ttft, answer_kind(mode, headers), ids, None, pair)


async def edit(memory: AsyncMemoryClient, user: User, rng: random.Random) -> Edit | str | None:
    """Edit or delete (even odds) one of the user's live facts; the edit, an error class, or
    None where the user has no facts yet."""
    try:
        facts = (await memory.list_facts(user.id, limit=50))["facts"]
        if not facts:
            return None
        fact = rng.choice(facts)
        if rng.random() < 0.5:
            new = await memory.edit_fact(user.id, fact["id"], f"{fact['text']} (corrected)")
            return Edit(user.id, "edit", fact["id"], int(new["id"]), time.time())
        await memory.delete_fact(user.id, fact["id"])
        return Edit(user.id, "delete", fact["id"], None, time.time())
    except MemoryAPIError as exc:
        return error_class(exc)
    except (OSError, openai.OpenAIError, Exception) as exc:  # noqa: BLE001 - e.g. server down
        return error_class(exc)


@dataclass
class LoadLog:
    """Everything the load did, in order."""

    answers: list[Answer]
    edits: list[Edit]
    edit_errors: list[tuple[float, str]]
    published: dict[tuple[str, str], float]
    publish_retries: int = 0


async def client_loop(url: str, api_key: str, population: Population, log: LoadLog,
                      rate: float, k: int, edit_share: float, pair_share: float,
                      stop: asyncio.Event, seed: int) -> None:
    """One client: Poisson arrivals at ``rate`` per second (waiting for each answer); a share of
    the operations are memory edits, a share of the questions are asked again as text."""
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                                timeout=120)
    async with AsyncMemoryClient(url, api_key=api_key) as memory:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
                break
            except TimeoutError:
                pass
            user = population.pick()
            if rng.random() < edit_share:
                outcome = await edit(memory, user, rng)
                if isinstance(outcome, Edit):
                    log.edits.append(outcome)
                elif outcome is not None:
                    log.edit_errors.append((time.time(), outcome))
                continue
            question = rng.choice(user.questions)
            pair = uuid.uuid4().hex if rng.random() < pair_share else None
            answer = await ask(client, user.id, question, "inject", k, pair)
            log.answers.append(answer)
            if pair is not None and answer.error is None:
                log.answers.append(await ask(client, user.id, question, "text", k, pair))
    await client.close()


async def publish_loop(settings: Settings, bootstrap: str, population: Population,
                       log: LoadLog, rate: float, stop: asyncio.Event) -> None:
    """Turns at ``rate`` per second, each the next turn of a user drawn by activity; a send the
    broker does not acknowledge (it is restarting) is sent again with a new producer."""
    began, n = time.monotonic(), 0
    producer = None
    try:
        while not stop.is_set():
            await asyncio.sleep(max(0.0, began + n / rate - time.monotonic()))
            event = population.pick().take(1)[0]
            while not stop.is_set():
                try:
                    if producer is None:
                        producer = make_producer(bootstrap, kafka_security(settings))
                        await producer.start()
                    await producer.send_and_wait(settings.turns_topic, event.to_bytes(),
                                                 key=event.user_id.encode())
                    log.published[(event.user_id, event.turn_id)] = time.time()
                    break
                except Exception:  # noqa: BLE001 - the broker is restarting: send it again
                    log.publish_retries += 1
                    if producer is not None:
                        await producer.stop()
                    producer = None
                    await asyncio.sleep(1.0)
            n += 1
    finally:
        if producer is not None:
            await producer.stop()
