"""The ``inferscale`` command line: one module per command group, in a dispatch table.

Product groups are listed here; other packages (the lab's benchmarks and evaluations) add theirs
through the entry point group ``inferscale.commands``: a callable that takes the subparsers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points

from inferscale.cli import mcp_commands, memory_commands, ops_commands, run_commands
from inferscale.core.logs import configure
from inferscale.core.procs import sigterm_as_interrupt
from inferscale.core.settings import get_settings

COMMAND_GROUPS = (ops_commands.register, memory_commands.register, mcp_commands.register,
                  run_commands.register)
DESCRIPTION = ("InferScale: a memory layer for LLM serving. Users' facts are kept as KV and "
               "injected into vLLM, so only the question is prefilled.")
PLUGIN_GROUP = "inferscale.commands"
log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand, plugins' included."""
    parser = argparse.ArgumentParser(prog="inferscale", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMAND_GROUPS:
        register(sub)
    for plugin in entry_points(group=PLUGIN_GROUP):
        try:
            register = plugin.load()
        except ModuleNotFoundError as exc:  # its package is not installed (the lab: not in
            log.debug("command plugin %s not installed: %s", plugin.name, exc)  # the wheel)
            continue
        register(sub)
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
        from inferscale.core.endpoints import InfraError

        if isinstance(exc, InfraError | FileNotFoundError | ValueError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
