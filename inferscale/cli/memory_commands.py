"""``inferscale publish | forget | memory``: turns in, a user's memory seen, edited and out."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from inferscale.core.settings import Settings


def _publish(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.core.endpoints import resolve_kafka_bootstrap
    from inferscale.pipeline.kafka import ensure_topics, kafka_security, publish_turns
    from inferscale.pipeline.sources import read_turns

    bootstrap = resolve_kafka_bootstrap(settings)
    topic = args.topic or settings.turns_topic

    async def go() -> int:
        security = kafka_security(settings)
        await ensure_topics(bootstrap, [topic, settings.dead_letter_topic], security=security)
        return await publish_turns(bootstrap, topic, read_turns(Path(args.file)),
                                   security=security)

    count = asyncio.run(go())
    print(f"published {count} turns to {topic}")
    return 0


def _json(result: object) -> str:
    """A client result (a model, or a list of them) as JSON."""
    import json

    from pydantic_core import to_jsonable_python

    return json.dumps(to_jsonable_python(result), indent=2)


def _forget(args: argparse.Namespace, settings: Settings) -> int:
    server = args.server or settings.server_url
    if server:  # the server forgets and purges its own memory tiers
        from inferscale.client import MemoryAPIError, MemoryClient

        with MemoryClient(server, args.api_key, timeout=120,
                          data_dir=settings.data_dir) as memory:
            try:
                print(_json(memory.forget(args.user)))
            except MemoryAPIError as exc:
                print(exc, file=sys.stderr)
                return 1
        return 0

    from inferscale.core.endpoints import resolve_kafka_bootstrap
    from inferscale.db.engine import create_engine
    from inferscale.kv.store import KVStore
    from inferscale.pipeline.invalidation import publish_invalidation
    from inferscale.pipeline.kafka import kafka_security
    from inferscale.serving.forget import forget_user

    async def go():
        engine = create_engine(settings=settings)
        try:
            store = KVStore.from_settings(settings, fingerprint="", host_bytes=0)
            forgotten = await forget_user(engine, store, args.user)
        finally:
            await engine.dispose()
        await publish_invalidation(resolve_kafka_bootstrap(settings),
                                   settings.invalidation_topic, args.user, forgotten.locations,
                                   security=kafka_security(settings))
        return forgotten

    forgotten = asyncio.run(go())
    print(f"forgot user {args.user!r}: {forgotten.facts} facts, {forgotten.blobs} KV blobs; "
          "running servers purge their memory tiers through the invalidation topic")
    return 0


def _memory(args: argparse.Namespace, settings: Settings) -> int:
    """``inferscale memory ACTION``: the memory API of a running server, through the client."""
    from inferscale.client import MemoryAPIError, MemoryClient

    server = args.server or settings.server_url
    if not server:
        raise ValueError("inferscale memory needs --server (or INFERSCALE_SERVER_URL)")
    needs = {"show": "fact", "edit": "fact", "delete": "fact", "history": "fact",
             "search": "query"}
    if (what := needs.get(args.action)) and getattr(args, what) is None:
        raise ValueError(f"inferscale memory {args.action} needs --{what}")
    if args.action == "edit" and args.text is None:
        raise ValueError("inferscale memory edit needs --text")
    with MemoryClient(server, args.api_key, data_dir=settings.data_dir) as memory:
        calls = {
            "list": lambda: memory.list_facts(args.user, args.limit, args.cursor,
                                              args.agent_id, args.run_id),
            "show": lambda: memory.get_fact(args.user, args.fact),
            "search": lambda: memory.search(args.user, args.query, args.k, args.agent_id,
                                            args.run_id),
            "edit": lambda: memory.edit_fact(args.user, args.fact, args.text),
            "delete": lambda: memory.delete_fact(args.user, args.fact),
            "history": lambda: memory.history(args.user, args.fact),
        }
        try:
            print(_json(calls[args.action]()))
        except MemoryAPIError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    p = sub.add_parser("publish", help="publish a JSONL or LoCoMo JSON file of turns to Kafka")
    p.add_argument("--file", required=True)
    p.add_argument("--topic")
    p.set_defaults(func=_publish)

    p = sub.add_parser("forget", help="remove a user's turns, facts and KV from every tier")
    p.add_argument("--user", required=True)
    p.add_argument("--server", help="a running server's URL: it forgets and purges its caches")
    p.add_argument("--api-key", help="bearer key for --server (default: INFERSCALE_API_KEY, or "
                                     "this machine's admin key for a loopback server)")
    p.set_defaults(func=_forget)

    p = sub.add_parser("memory", help="see, search, edit or delete a user's facts on a server")
    p.add_argument("action", choices=["list", "show", "search", "edit", "delete", "history"])
    p.add_argument("--user", required=True)
    p.add_argument("--fact", type=int, help="show, edit, delete, history: the fact's id")
    p.add_argument("--text", help="edit: the fact's new text")
    p.add_argument("--query", help="search: what to retrieve for")
    p.add_argument("--k", type=int, default=10, help="search: how many facts")
    p.add_argument("--limit", type=int, default=50, help="list: facts per page")
    p.add_argument("--cursor", help="list: the page after this cursor")
    p.add_argument("--agent-id", help="list, search: only this agent's facts")
    p.add_argument("--run-id", help="list, search: only this run's facts")
    p.add_argument("--server", help="the server's URL (default INFERSCALE_SERVER_URL)")
    p.add_argument("--api-key", help="a bearer key that may act for the user (default: "
                                     "INFERSCALE_API_KEY, or this machine's admin key for a "
                                     "loopback server)")
    p.set_defaults(func=_memory)
