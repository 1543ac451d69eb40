"""``inferscale worker | serve | demo``: the long-running processes and the main job."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from inferscale.core.private_files import private_dir
from inferscale.core.settings import Settings


def _worker(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.workers.run import run_worker

    if args.group:
        settings = settings.model_copy(update={"consumer_group": args.group})
    private_dir(settings.data_dir)
    print(json.dumps(asyncio.run(run_worker(settings, drain=args.drain))))
    return 0


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.serving.serve import start_server, stop_server

    update = {k: v for k, v in (("server_host", args.host), ("server_port", args.port)) if v}
    vllm_args = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    private_dir(settings.data_dir)
    process = start_server(settings.model_copy(update=update), vllm_args)
    try:
        return process.wait()
    finally:
        stop_server(process)


def _demo(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.devstack.demo import SAMPLE, run_demo

    run_demo(settings, Path(args.file) if args.file else SAMPLE, keep=args.keep)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    p = sub.add_parser("worker", help="run an ingest worker (consumer group member)")
    p.add_argument("--drain", action="store_true", help="exit once the topic stays idle")
    p.add_argument("--group", help="consumer group (default from settings)")
    p.set_defaults(func=_worker)

    p = sub.add_parser("serve", help="vLLM OpenAI server with InferScale memory")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="extra vLLM arguments after --")
    p.set_defaults(func=_serve)

    p = sub.add_parser("demo", help="run the whole pipeline on embedded defaults")
    p.add_argument("--file", help="a LoCoMo-format conversation (default: the shipped sample)")
    p.add_argument("--keep", action="store_true", help="leave the embedded stack running")
    p.set_defaults(func=_demo)
