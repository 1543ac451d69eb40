"""``inferscale bench | eval | calibrate``: the lab's commands, registered with the CLI as a
plugin (entry point group ``inferscale.commands``) so the product never imports the lab."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from inferscale.core.settings import Settings
from inferscale.devstack.demo import SAMPLE
from inferscale.serving.request_options import STRENGTH, default_recompute


def _bench(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.core.model_prep import resolve_model_path

    out = Path(args.out)
    data = Path(args.data)
    if args.which == "encode":
        from inferscale.lab.bench import encode_rate as encode

        encode.run(resolve_model_path(settings), data, out, facts=args.n)
    elif args.which == "ttft":
        from inferscale.lab.bench import ttft

        ttft.run(settings, data, out, n_queries=args.n, ks=tuple(args.k))
    elif args.which == "hybrid":
        from inferscale.lab.bench import hybrid

        hybrid.run(settings, data, out, n_queries=args.n, ks=tuple(args.k))
    elif args.which == "throughput":
        from inferscale.lab.bench import throughput

        throughput.run(settings, data, out)
    elif args.which == "ingest":
        from inferscale.lab.bench import ingest_rate as ingest

        ingest.run(settings, data, out, limit=args.n)
    elif args.which == "freshness":
        from inferscale.lab.bench import freshness

        freshness.run(settings, out, n=args.n)
    elif args.which == "load":
        from inferscale.lab.bench import load

        load.run(settings, data, out)
    elif args.which == "extract":
        from inferscale.lab.bench import extract_compare as extract

        extract.run(resolve_model_path(settings), data, out, turns=args.n)
    elif args.which == "retrieval":
        from inferscale.lab.bench import retrieval_latency as retrieval

        retrieval.run(settings, data, out, n_queries=args.n, ks=tuple(args.k))
    elif args.which == "memory-api":
        from inferscale.lab.bench import memory_api_latency

        memory_api_latency.run(settings, data, out, repeats=args.n)
    elif args.which == "flood":
        from inferscale.lab.bench import flood

        flood.run(settings, out)
    elif args.which == "pagein":
        from inferscale.lab.bench import pagein

        pagein.run(settings, resolve_model_path(settings), out, ks=tuple(args.k))
    elif args.which == "cost":
        from inferscale.lab.bench import cost

        if args.ttft_report is None:
            raise SystemExit("bench cost needs --ttft-report (a bench ttft report)")
        cost.run(settings, data, resolve_model_path(settings), out, Path(args.ttft_report),
                 users=args.users or 10_000, hours=args.hours, rate=args.rate or 2.0)
    elif args.which == "soak":
        from inferscale.lab.bench import soak

        given: dict[str, Any] = {name: value for name, value in (
            ("minutes", args.minutes), ("users", args.users), ("request_rate", args.rate),
            ("clients", args.clients), ("turn_rate", args.turn_rate),
            ("budget_mb", args.budget_mb), ("user_budget_mb", args.user_budget_mb),
            ("faults", tuple(args.faults) if args.faults is not None else None),
            ("fault_s", args.fault_s))
            if value is not None}
        report = soak.run(settings, data, out, soak.SoakConfig(**given))
        return 0 if report["checks"]["passed"] else 1
    elif args.which == "pinned":
        from inferscale.lab.bench import pinned

        pinned.run(settings, data, out, k=settings.top_k, p=args.pinned)
    elif args.which == "routes":
        from inferscale.lab.bench import routes

        routes.run(settings, data, out)
    elif args.which == "inject":
        from transformers import AutoConfig

        from inferscale.lab.bench import inject

        config = (AutoConfig.from_pretrained(resolve_model_path(settings))
                  if args.shape == "served" else inject.SHAPES[args.shape]())
        inject.run(config, out, ks=tuple(args.k), requests=args.n, model=not args.no_model)
    return 0


def _eval(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale.lab import evaluate

    windows = args.w or [settings.window]
    if args.dataset == "drift":
        from inferscale.lab import drift

        drift.run(settings, Path(args.data), Path(args.out), conversation=args.conversation,
                  questions=args.questions, ks=tuple(args.k), strategies=tuple(args.strategies),
                  w=windows[0], max_turns=args.max_turns, seed=args.seed,
                  threads=args.threads, name=args.name, anchor=args.anchor,
                  order=args.order,
                  transform=Path(args.transform_profile) if args.transform_profile else None)
        return 0
    evaluate.run(settings, Path(args.data), Path(args.out),
                 conversations=tuple(args.conversations),
                 questions=args.questions, ks=tuple(args.k), windows=tuple(windows),
                 contexts=tuple(args.context or [settings.encode_context]),
                 recomputes=tuple(args.recompute or [default_recompute(settings)]),
                 order=args.order, oracle=args.oracle,
                 leads=tuple(choice == "on" for choice in args.lead),
                 max_tokens=args.max_tokens, max_turns=args.max_turns, seed=args.seed,
                 key_scales=tuple(args.key_scales), prefix_hit=args.prefix_hit)
    return 0


def _recompute_choice(raw: str) -> int | str:
    """``--recompute`` values: a count of facts, or auto."""
    if raw == "auto":
        return raw
    try:
        return int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or auto, got {raw!r}") from None


def _key_scales_choice(raw: str) -> float | None:
    """``--key-scales`` values: on (None: the server's own strength), off (0) or a strength."""
    if raw in ("on", "off"):
        return None if raw == "on" else 0.0
    try:  # the strengths a request's "key_scales" takes
        return STRENGTH.validate_python(float(raw))
    except ValueError:  # pydantic's ValidationError is one
        raise argparse.ArgumentTypeError(
            f"expected on, off or a number in [0, 1], got {raw!r}") from None


def _calibrate(args: argparse.Namespace, settings: Settings) -> int:
    if args.what == "transform":
        from inferscale.lab import fit_transform

        if args.data is None:
            raise SystemExit("calibrate transform needs --data")
        fit_transform.run(settings, Path(args.data), Path(args.out) if args.out else None,
                          conversations=tuple(args.conversations), facts=args.facts,
                          w=settings.window, seed=args.seed, threads=args.threads)
        return 0
    if args.what == "recompute":
        from inferscale.lab import fit_recompute

        if args.data is None and args.records is None:
            raise SystemExit("calibrate recompute needs --data (or --records of an earlier run)")
        fit_recompute.run(settings, Path(args.data) if args.data else None,
                          Path(args.runs_out), records=Path(args.records) if args.records
                          else None, conversations=tuple(args.conversations),
                          questions=args.questions, ks=tuple(args.k), tails=tuple(args.tails),
                          max_turns=args.max_turns or None, seed=args.seed, target=args.target,
                          max_answered_again=args.max_answered_again,
                          max_text_share=args.max_text_share,
                          profile_out=Path(args.out) if args.out else None)
        return 0
    if args.data is None:
        raise SystemExit("calibrate key-scales needs --data")
    from inferscale.lab import calibrate

    calibrate.run(settings, Path(args.data), Path(args.out) if args.out else None,
                  conversations=tuple(args.conversations), questions=args.questions,
                  ks=tuple(args.k),
                  max_turns=args.max_turns, epochs=args.epochs, lr=args.lr, seed=args.seed,
                  threads=args.threads)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    p = sub.add_parser("bench", help="benchmarks (figures side by side with the baseline)")
    p.add_argument("which", choices=["encode", "ttft", "hybrid", "throughput", "ingest",
                                     "freshness", "load", "extract", "retrieval", "pagein",
                                     "inject", "cost", "memory-api", "soak", "pinned",
                                     "flood", "routes"])
    p.add_argument("--data", default=str(SAMPLE),
                   help="a LoCoMo-format file")
    p.add_argument("--out", default="bench-out", help="output folder for JSON and plots")
    p.add_argument("-n", type=int, default=20,
                   help="facts / queries / turns (extract) per configuration")
    p.add_argument("--k", type=int, nargs="+", default=[0, 5, 10, 20, 50],
                   help="ttft, hybrid, retrieval, pagein, inject: facts retrieved per question")
    p.add_argument("--shape", default="served",
                   choices=["served", "llama-3.1-8b", "qwen3-8b", "gemma-3-12b"],
                   help="inject: K/V and model shapes (random values): the served model's or "
                        "a named model's")
    p.add_argument("--no-model", action="store_true",
                   help="inject: skip the model-forward baseline")
    p.add_argument("--ttft-report", help="cost: the bench ttft report (ttft.json) whose "
                                         "medians time hot and cold requests")
    p.add_argument("--users", type=int,
                   help="cost: simulated users (10,000); soak: users (60)")
    p.add_argument("--hours", type=float, default=6.0, help="cost: simulated hours")
    p.add_argument("--rate", type=float,
                   help="cost: requests per second (2); soak: questions and memory edits per "
                        "second, all clients (1)")
    p.add_argument("--minutes", type=float, help="soak: how long the load runs (30)")
    p.add_argument("--clients", type=int, help="soak: concurrent OpenAI-API clients (4)")
    p.add_argument("--turn-rate", type=float, help="soak: turns published per second (0.1)")
    p.add_argument("--budget-mb", type=float, help="soak: the durable tier's KV budget (80)")
    p.add_argument("--user-budget-mb", type=float, help="soak: each user's KV budget (3)")
    p.add_argument("--faults", nargs="*", choices=["worker", "broker", "postgres", "server",
                                                   "disk_full", "slow_store"],
                   help="soak: faults, spread evenly over the run (default: all six)")
    p.add_argument("--fault-s", type=float,
                   help="soak: how long a full disk or a slow store lasts (60)")
    p.add_argument("--pinned", type=int, default=5,
                   help="pinned: facts pinned (5), against the server's top_k plus as many "
                        "retrieved")
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
    p.add_argument("--recompute", type=_recompute_choice, nargs="+",
                   help="tail recompute: best m facts prefilled after the injected ones, or "
                        "auto (default: the server's, INFERSCALE_RECOMPUTE_TAIL)")
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
    p.add_argument("--prefix-hit", action="store_true",
                   help="fidelity: also answer each text prompt again from vLLM's prefix cache "
                        "(TTFT of a hit; agreement of that second exact path)")
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
                        "recompute after injection; '%<format>[:<lead format>]': stored so (a "
                        "KV format, or fr<mean bits> / tc<quality> with --transform-profile)")
    p.add_argument("--threads", type=int, default=2, help="drift: torch CPU threads")
    p.add_argument("--name", default="drift", help="drift: report name (<out>/<name>.json)")
    p.add_argument("--transform-profile", help="drift: the profile of 'fr<bits>' / "
                                               "'tc<quality>' formats (calibrate transform)")
    p.add_argument("--anchor", help="drift: a fixed memory line after the preamble (layout "
                                    "variant, text and inject alike)")
    p.set_defaults(func=_eval)

    p = sub.add_parser("calibrate", help="fit what the fidelity machinery needs for the served "
                                         "model: key scales (HF, offline), recompute auto's "
                                         "margins (through the server) or a transform-coding "
                                         "profile (HF, offline)")
    p.add_argument("what", nargs="?", choices=["key-scales", "recompute", "transform"],
                   default="key-scales")
    p.add_argument("--data", help="a LoCoMo-format JSON file")
    p.add_argument("--out", help="key-scales: the scales file (default: <data_dir>/key_scales/"
                                 "<model>.json; its points at other fact counts are kept); "
                                 "recompute: the profile (default: <data_dir>/calibration/"
                                 "<fingerprint>.json, which the server reads); transform: the "
                                 "profile (default: transform-<model>.safetensors)")
    p.add_argument("--conversations", type=int, nargs="+", default=[1, 2],
                   help="conversation indexes to fit on (keep evaluation ones out)")
    p.add_argument("--questions", type=int, default=40,
                   help="key-scales: questions per conversation; recompute: in all")
    p.add_argument("--k", type=int, nargs="+", default=[20, 50],
                   help="facts per served prompt (key-scales: one fitted point each, other "
                        "points already in the output file are kept)")
    p.add_argument("--max-turns", type=int, default=150,
                   help="each conversation's first N turns (recompute: 0 for whole ones)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--records", help="recompute: fit on an earlier run's report (an eval "
                                     "fidelity JSON, .gz too) instead of answering again")
    p.add_argument("--tails", type=int, nargs="+", default=[2, 4],
                   help="recompute: tail sizes (facts) to try")
    p.add_argument("--target", type=float, default=0.95,
                   help="recompute: first-token agreement with text prefill to reach")
    p.add_argument("--max-answered-again", type=float, default=0.5,
                   help="recompute: bound on the share of requests recomputed or sent to text")
    p.add_argument("--max-text-share", type=float, default=0.5,
                   help="recompute: bound on the share of requests answered as text (they agree "
                        "by construction; 0.2: at least 80%% served as KV)")
    p.add_argument("--facts", type=int, default=150,
                   help="transform: facts per conversation to fit on (a seeded sample)")
    p.add_argument("--runs-out", default="bench-out/calibrate",
                   help="recompute: where the calibration run's answers and logs go")
    p.set_defaults(func=_calibrate)
