"""``inferscale publish | forget``: turns in, a user's memory out."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from inferscale.platform.settings import Settings


def _publish(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.devstack.infra import resolve_kafka_bootstrap
    from inferscale.pipeline.kafka import ensure_topics, publish_turns
    from inferscale.pipeline.sources import read_turns

    bootstrap = resolve_kafka_bootstrap(settings)
    topic = args.topic or settings.turns_topic

    async def go() -> int:
        await ensure_topics(bootstrap, [topic, settings.dead_letter_topic])
        return await publish_turns(bootstrap, topic, read_turns(Path(args.file)))

    count = asyncio.run(go())
    print(f"published {count} turns to {topic}")
    return 0


def _forget(args: argparse.Namespace, settings: Settings) -> int:
    server = args.server or settings.server_url
    if server:  # the server forgets and purges its own memory tiers and prefix cache
        import httpx

        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        response = httpx.post(f"{server.rstrip('/')}/v1/memory/forget", json={"user": args.user},
                              headers=headers, timeout=120)
        print(response.text)
        return 0 if response.status_code == 200 else 1

    from inferscale.db.engine import create_engine
    from inferscale.devstack.infra import resolve_kafka_bootstrap
    from inferscale.kv.store import KVStore
    from inferscale.pipeline.forget import forget_user
    from inferscale.pipeline.invalidation import publish_invalidation

    async def go():
        engine = create_engine(settings=settings)
        try:
            store = KVStore.from_settings(settings, fingerprint="", host_bytes=0)
            forgotten = await forget_user(engine, store, args.user)
        finally:
            await engine.dispose()
        await publish_invalidation(resolve_kafka_bootstrap(settings),
                                   settings.invalidation_topic, args.user, forgotten.locations)
        return forgotten

    forgotten = asyncio.run(go())
    print(f"forgot user {args.user!r}: {forgotten.facts} facts, {forgotten.blobs} KV blobs; "
          "running servers purge their memory tiers and prefix caches through the invalidation "
          "topic")
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
    p.add_argument("--api-key", help="bearer key for --server")
    p.set_defaults(func=_forget)
