"""The memory API over HTTP on the real server, through ``inferscale.client``: listing, reading,
searching (with and without a metadata filter) and exporting an owner with 10,000 facts (rows as
an encoded owner's; the first search also loads the owner's vectors into the server's index);
an edit's way to being served: the PATCH, the next chat request (the new version, as text) and
the time until a worker has encoded the new version and a chat request injects it as KV (asked
without tail recompute, which would prefill the one fact retrieved as text); and an add's way
to being ready, read from its event with ``wait``: a fact given directly, and a turn (stored,
extracted, encoded by the worker)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from pathlib import Path

import httpx

from inferscale.client import AsyncMemoryClient
from inferscale.core.settings import Settings
from inferscale.devstack.chat_client import stream_chat
from inferscale.devstack.stack import server_process, worker_process
from inferscale.lab.bench.common import (
    percentile,
    print_table,
    settings_differing,
    write_report,
)
from inferscale.lab.bench.retrieval_latency import store_owner
from inferscale.lab.bench.ttft import ingest_user, prepare_user

FACTS_PER_OWNER = 10_000
KV_TIMEOUT_S = 300.0


def _summary(samples: list[float]) -> dict:
    ms = [s * 1e3 for s in samples]
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": percentile(ms, 99),
            "max_ms": max(ms)}


async def _timed(call, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - began)
    return samples


async def _reads(url: str, user: str, questions: list[str], repeats: int) -> dict:
    """List (first page, a page deep in, every page), get and search the 10,000-fact owner."""
    async with AsyncMemoryClient(url, timeout=300) as memory:
        began = time.perf_counter()
        await memory.search(user, questions[0], k=10)  # loads the owner's vectors
        cold_search = time.perf_counter() - began
        first = await memory.list_facts(user, limit=500)
        cursors = [first["next_cursor"]]  # cursors[i]: the page after i + 1 pages
        while cursors[-1] is not None:
            cursors.append((await memory.list_facts(user, limit=500,
                                                    cursor=cursors[-1]))["next_cursor"])
        deep_cursor = cursors[FACTS_PER_OWNER // 500 - 2]  # the last full page
        pages = {"list 50 (first page)": lambda: memory.list_facts(user, limit=50),
                 "list 500 (first page)": lambda: memory.list_facts(user, limit=500),
                 "list 500 (last pages)": lambda: memory.list_facts(user, limit=500,
                                                                    cursor=deep_cursor),
                 "get one fact": lambda: memory.get_fact(user, first["facts"][7]["id"])}
        result = {name: _summary(await _timed(call, repeats)) for name, call in pages.items()}
        every = await _timed(lambda: _count(memory, user), 3)
        result[f"every fact ({FACTS_PER_OWNER // 500} pages of 500)"] = _summary(every)
        searches = []
        for question in questions[:repeats]:
            began = time.perf_counter()
            await memory.search(user, question, k=10)
            searches.append(time.perf_counter() - began)
        result["search k=10 (warm)"] = _summary(searches)
        result["search k=10 (first: loads the owner)"] = _summary([cold_search])
        tenth = {"metadata": {"n": 3}}  # 1,000 of the 10,000 facts
        filtered = []
        for question in questions[:repeats]:
            began = time.perf_counter()
            hits = await memory.search(user, question, k=10, filters=tenth)
            filtered.append(time.perf_counter() - began)
            if len(hits) != 10:
                raise RuntimeError(f"a filtered search found {len(hits)} facts, not 10")
        result["search k=10, metadata filter (1 in 10 facts)"] = _summary(filtered)
        exports = []
        for _ in range(3):
            began = time.perf_counter()
            lines = sum([1 async for _ in memory.export(user)])
            exports.append(time.perf_counter() - began)
            if lines != FACTS_PER_OWNER + 1:
                raise RuntimeError(f"exported {lines} lines, not {FACTS_PER_OWNER + 1}")
        result[f"export ({FACTS_PER_OWNER} facts, JSON Lines)"] = _summary(exports)
    return result


async def _count(memory: AsyncMemoryClient, user: str) -> int:
    count = sum([1 async for _ in memory.iter_facts(user, page=500)])
    if count != FACTS_PER_OWNER:
        raise RuntimeError(f"listed {count} facts, stored {FACTS_PER_OWNER}")
    return count


async def _edits(url: str, user: str, edits: int) -> list[dict]:
    """Edit ``edits`` facts one after another: the PATCH, the next chat request (must serve the
    new version and not the old), and the time until the new version is injected as KV."""
    rows = []
    async with AsyncMemoryClient(url, timeout=300) as memory, httpx.AsyncClient(
            timeout=300) as http:
        facts = [f async for f in memory.iter_facts(user)][:edits]
        for n, fact in enumerate(facts):
            new_text = f"{fact['text']} (corrected, edit {n})"
            began = time.perf_counter()
            new = await memory.edit_fact(user, fact["id"], new_text)
            patched = time.perf_counter()
            chat = await stream_chat(http, url, user, new_text, "inject", 1, max_tokens=1)
            served = [int(i) for i in chat.headers["x-inferscale-fact-ids"].split(",") if i]
            as_text = time.perf_counter()
            while True:
                if (await memory.get_fact(user, new["id"]))["kv"]["encoded"]:
                    break
                if time.perf_counter() - began > KV_TIMEOUT_S:
                    raise TimeoutError(f"fact {new['id']} not encoded in {KV_TIMEOUT_S}s")
                await asyncio.sleep(0.05)
            encoded = time.perf_counter()
            kv_chat = await stream_chat(http, url, user, new_text, "inject", 1, max_tokens=1,
                                        options={"recompute": 0})  # its KV, no tail
            rows.append({"patch_s": patched - began, "served_as_text_s": as_text - began,
                         "new_version_served": served == [new["id"]],
                         "old_version_served": fact["id"] in served,
                         "encoded_s": encoded - began,
                         "injected_after_encode": kv_chat.headers[
                             "x-inferscale-facts-injected"] == "1"})
            print(f"edit {n}: PATCH {rows[-1]['patch_s'] * 1e3:.0f} ms, served as text after "
                  f"{rows[-1]['served_as_text_s'] * 1e3:.0f} ms, as KV after "
                  f"{rows[-1]['encoded_s']:.2f} s", flush=True)
    return rows


async def _adds(url: str, user: str, adds: int) -> list[dict]:
    """Add ``adds`` facts and ``adds`` turns one after another, each read from its event with
    ``wait`` until it is encoded (the worker running): the add's answer, ready."""
    rows = []
    async with AsyncMemoryClient(url, timeout=300) as memory:
        for n in range(adds):
            for kind in ("fact", "turn"):
                text = f"Add {n}: the bench's {kind} number {n} is about kites."
                began = time.perf_counter()
                if kind == "fact":
                    event_id = (await memory.add_fact(user, text)).event_id
                else:
                    event_id = (await memory.add_turns(user, [{
                        "conversation_id": "adds", "turn_id": f"add-{n}", "speaker": "Ines",
                        "text": text, "timestamp": "2025-05-01T12:00:00Z"}])).event_id
                answered = time.perf_counter()
                while (event := await memory.event(user, str(event_id), wait=60)
                       ).stage != "encoded":
                    if time.perf_counter() - began > KV_TIMEOUT_S:
                        raise TimeoutError(f"{kind} {n} not encoded in {KV_TIMEOUT_S}s")
                rows.append({"kind": kind, "answered_s": answered - began,
                             "ready_s": time.perf_counter() - began,
                             "facts": len(event.facts)})
    return rows


def run(settings: Settings, data: Path, out_dir: Path, repeats: int = 20) -> dict:
    """Both phases on one server: reads of the 10,000-fact owner (no worker running), then edits
    of a small owner encoded by a worker that stays up to encode the new versions."""
    settings, small_user, questions, turns = prepare_user(settings, data, turns_limit=40)
    big_user = f"bench-memory-api-{uuid.uuid4().hex[:8]}"

    store_owner(settings, big_user, FACTS_PER_OWNER)
    out_dir.mkdir(parents=True, exist_ok=True)
    with server_process(settings, out_dir / "server.log") as url:
        reads = asyncio.run(_reads(url, big_user, questions, repeats))
        with worker_process(settings, out_dir / "worker.log"):
            ingest_user(settings, small_user, turns)
            edits = asyncio.run(_edits(url, small_user, min(repeats, len(turns))))
            adds = asyncio.run(_adds(url, small_user, min(repeats, 10)))
        asyncio.run(AsyncMemoryClient(url).forget(big_user))
    print_table(["memory API call (10,000 facts)", "n", "p50 ms", "p99 ms", "max ms"],
                [[name, r["n"], r["p50_ms"], r["p99_ms"], r["max_ms"]]
                 for name, r in reads.items()])
    stages = {"PATCH returns": "patch_s", "next chat serves the new version (as text)":
              "served_as_text_s", "new version encoded (worker), injectable": "encoded_s"}
    print_table(["edit, from the PATCH's start", "n", "p50 ms", "p99 ms", "max ms"],
                [[label, *_summary([e[key] for e in edits]).values()]
                 for label, key in stages.items()])
    add_summary = {f"{kind}: {label}": _summary([a[key] for a in adds if a["kind"] == kind])
                   for kind in ("fact", "turn")
                   for label, key in (("add answered", "answered_s"),
                                      ("ready (event encoded)", "ready_s"))}
    print_table(["add, from the request's start", "n", "p50 ms", "p99 ms", "max ms"],
                [[label, *r.values()] for label, r in add_summary.items()])
    report = {"settings_differing": settings_differing(settings),
              "data": {"file": str(data), "small_owner_turns": len(turns),
                       "questions": len(questions), "big_owner": "random vectors, fake KV rows"},
              "facts_per_owner": FACTS_PER_OWNER, "reads": reads, "edits": edits,
              "edit_summary": {label: _summary([e[key] for e in edits])
                               for label, key in stages.items()},
              "every_edit_served_new_never_old": all(
                  e["new_version_served"] and not e["old_version_served"] for e in edits),
              "every_encoded_edit_injected": all(e["injected_after_encode"] for e in edits),
              "adds": adds, "add_summary": add_summary}
    write_report(out_dir, "memory-api", report)
    return report
