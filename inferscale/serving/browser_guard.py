"""From where a request may come: the browser-borne attacks refused on every route.

A web page the user visits can send requests to a server on their machine. Three rules, checked
before any route runs (pure logic over the request's method, path and headers):

- **Host**: the ``Host`` header must name the server: a loopback name or address,
  ``server_host``, or one of ``INFERSCALE_ALLOWED_HOSTS``. A DNS-rebinding page (its own name
  re-pointed at 127.0.0.1, so its requests are same-origin to the browser) sends its own name
  and is refused (CVE-2024-28224's class). Health probes (``/health``, ``/ping``) are exempt.
- **Origin**: a request a browser marks as coming from another origin (``Origin`` not the
  server's own, ``Origin: null``, or ``Sec-Fetch-Site`` cross-site / same-site without an
  allowed Origin) is refused unless that origin is in ``INFERSCALE_ALLOWED_ORIGINS``; top-level
  navigations are let through (their response goes to the user, not to the page). The refusal
  carries no CORS header, so the page cannot even read it.
- **Content type**: a body sent to the memory API (Mem0's routes too), chat completions or
  responses must be ``application/json``: the "simple" requests a page may send without a preflight
  (``text/plain``, forms, a ``no-cors`` Blob with no type) are refused.
"""

from __future__ import annotations

import hashlib
import re
from base64 import b64encode
from urllib.parse import urlsplit

from inferscale.core.local_key import is_loopback_host
from inferscale.core.settings import Settings
from inferscale.serving.guards import FrontendError
from inferscale.serving.mem0_api import MEM0_PREFIXES

PROBE_PATHS = frozenset({"/health", "/ping"})
JSON_BODY_PATHS = ("/v1/memory", "/v1/chat/completions", "/v1/responses", *MEM0_PREFIXES)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<name>[^:\[\]]+))(?::(?P<port>\d{1,5}))?$")


def host_name(header: str) -> str | None:
    """The host part of a ``Host`` header, lower case (None: not a host[:port] at all)."""
    match = _HOST.match(header.strip())
    if match is None:
        return None
    return (match["v6"] or match["name"]).lower().rstrip(".")


def allowed_host(settings: Settings, name: str) -> bool:
    if "*" in settings.allowed_hosts or is_loopback_host(name):
        return True
    own = settings.server_host.lower()
    return (own not in WILDCARD_HOSTS and name == own.strip("[]")) or name in {
        h.lower() for h in settings.allowed_hosts}


def check_request(settings: Settings, method: str, path: str, headers: dict[str, str]) -> None:
    """Refuse (``FrontendError``) a request that a browser page of another site, or one
    reached by a rebound DNS name, could have made; ``headers`` lower-case keyed."""
    host = headers.get("host")
    if path in PROBE_PATHS and method in ("GET", "HEAD"):
        return
    if host is not None:
        name = host_name(host)
        if name is None or not allowed_host(settings, name):
            raise FrontendError(403, f"Host {host[:100]!r} is not a name this server answers "
                                     "to (INFERSCALE_ALLOWED_HOSTS)")
    origin = headers.get("origin")
    if origin is not None:
        if not _allowed_origin(settings, origin, host):
            raise FrontendError(403, f"requests from origin {origin[:100]!r} are refused "
                                     "(INFERSCALE_ALLOWED_ORIGINS)")
    elif (headers.get("sec-fetch-site") in ("cross-site", "same-site")
          and headers.get("sec-fetch-mode") != "navigate"):
        raise FrontendError(403, "requests from another site are refused")
    if method in BODY_METHODS and path.startswith(JSON_BODY_PATHS) and _has_body(headers):
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise FrontendError(415, f"{path} takes application/json bodies only "
                                     f"(got {media[:60] or 'no content type'!r})")


def _allowed_origin(settings: Settings, origin: str, host: str | None) -> bool:
    if "*" in settings.allowed_origins or origin in settings.allowed_origins:
        return True
    if origin == "null" or host is None:
        return False
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()


def _has_body(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0") != "0" or "transfer-encoding" in headers


def page_headers(script: str) -> dict[str, str]:
    """Response headers of a page served with one inline ``script``: it runs, nothing else
    does; it may call this server only; no site may frame it; no referrer leaves it."""
    digest = b64encode(hashlib.sha256(script.encode()).digest()).decode()
    return {
        "content-security-policy": (
            f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'"),
        "x-frame-options": "DENY",
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
    }
