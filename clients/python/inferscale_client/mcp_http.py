"""The MCP server over streamable HTTP, on loopback only, for clients that cannot spawn it.

Two guards before any MCP message: the caller presents the server's key
(``Authorization: Bearer``, compared in constant time; 401 otherwise), and the SDK's DNS-rebinding
protection admits only this server's own loopback ``Host`` and ``Origin`` values (421 / 403), so
a web page whose name is re-pointed at 127.0.0.1 cannot drive the tools.
"""

from __future__ import annotations

import hmac

from mcp.server import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

HOST = "127.0.0.1"
PATH = "/mcp"


class RequireKey:
    """ASGI middleware: HTTP requests without ``Authorization: Bearer <key>`` get 401."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refusal = JSONResponse({"error": "a valid bearer key is required"}, 401,
                                       headers={"www-authenticate": "Bearer"})
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def loopback_only(port: int) -> TransportSecuritySettings:
    """DNS-rebinding protection: this port's loopback names as ``Host``, their URLs as
    ``Origin`` (a request with no ``Origin``, as non-browser clients send, passes)."""
    hosts = [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts,
                                     allowed_origins=[f"http://{host}" for host in hosts])


def http_app(server: MCPServer, key: str, port: int) -> ASGIApp:
    """The MCP endpoint (``/mcp``) behind both guards."""
    app = server.streamable_http_app(streamable_http_path=PATH,
                                     transport_security=loopback_only(port), host=HOST)
    return RequireKey(app, key)


def serve_http(server: MCPServer, key: str, port: int) -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(http_app(server, key, port), host=HOST, port=port,
                                  log_level="warning")).run()
