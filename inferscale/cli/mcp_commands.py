"""``inferscale mcp``: the memory API as an MCP server (``inferscale_client/mcp_main.py``, which
the client distribution also installs as ``inferscale-mcp``)."""

from __future__ import annotations

import argparse

from inferscale.core.settings import Settings


def _mcp(args: argparse.Namespace, settings: Settings) -> int:
    from inferscale_client.mcp_main import run

    return run(args, settings.data_dir)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this group's subcommands."""
    from inferscale_client.mcp_main import add_arguments

    p = sub.add_parser("mcp", help="serve the memory API as MCP tools (stdio, or --http)")
    add_arguments(p)
    p.set_defaults(func=_mcp)
