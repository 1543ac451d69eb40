"""``inferscale mcp`` / ``inferscale-mcp``: the memory API's MCP server (``mcp_tools.py``) over
stdio (the default: an MCP client starts it) or streamable HTTP on loopback (``--http``,
``mcp_http.py``).

It talks to a running InferScale server (``--server``, default ``INFERSCALE_SERVER_URL`` or
http://127.0.0.1:8000) with one key: ``--api-key``, else ``INFERSCALE_API_KEY``, else a loopback
server's local admin key (``keys.py``). Over HTTP, MCP clients must present that same key.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from inferscale_client.keys import key_for
from inferscale_client.memory_client import AsyncMemoryClient

SERVER_ENV = "INFERSCALE_SERVER_URL"
DEFAULT_SERVER = "http://127.0.0.1:8000"
DEFAULT_PORT = 8765


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help=f"the InferScale server's URL (default: {SERVER_ENV} "
                                          f"or {DEFAULT_SERVER})")
    parser.add_argument("--api-key", help="a key that may act for the owners (default: "
                                          "INFERSCALE_API_KEY, or a loopback server's local key)")
    parser.add_argument("--user", help="the one owner the tools act for (a call naming "
                                       "another is refused); unset: each call names its owner, "
                                       "any the key may act for")
    parser.add_argument("--http", action="store_true",
                        help="serve streamable HTTP on 127.0.0.1 instead of stdio")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="--http: the port")


def run(args: argparse.Namespace, data_dir: Path | None = None) -> int:
    """Serve until the client leaves (stdio) or an interrupt (HTTP); ``data_dir``: where a
    loopback server's local key is."""
    from inferscale_client.mcp_tools import build_server

    url = args.server or os.environ.get(SERVER_ENV) or DEFAULT_SERVER
    key = args.api_key if args.api_key is not None else key_for(url, data_dir)
    server = build_server(lambda: AsyncMemoryClient(url, api_key=key or ""), args.user)
    if not args.http:
        server.run("stdio")
        return 0
    if not key:
        print("error: --http needs a key for MCP clients to present: --api-key, "
              "INFERSCALE_API_KEY, or a loopback server's local key", file=sys.stderr)
        return 2
    from inferscale_client.mcp_http import serve_http

    serve_http(server, key, args.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``inferscale-mcp`` console script."""
    parser = argparse.ArgumentParser(prog="inferscale-mcp", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
