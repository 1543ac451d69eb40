"""Which routes of the server anyone may call: an allow-list by name, matched as the router
matches.

Every route of vLLM's app is one of four kinds, read off the route the request reaches (found
with the router's own ``matches``, on the route path: a ``--root-path`` stripped as Starlette
strips it, so ``/api/reset_prefix_cache`` is ``/reset_prefix_cache``):

- ``memory``: the memory API's routes (both dialects); each admits its caller itself
  (``memory_ops.Admission``);
- ``public``: generation and information (``PUBLIC_ROUTES``), open to whoever passes vLLM's own
  ``--api-key`` check and the browser rules; a chat completion or response that names an owner
  is admitted as memory;
- ``metrics``: ``/metrics``, readable as ``INFERSCALE_METRICS_ACCESS`` says;
- ``admin``: everything else, present or future (engine control, dev-mode routes, weight
  updates, ``/invocations``, whatever a new vLLM adds): an admin key only.

A request that reaches no route passes on (the app answers 404).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from starlette.routing import BaseRoute, Match

Kind = Literal["memory", "public", "metrics", "admin"]

METRICS_PATH = "/metrics"
# Generation and information: what a client of an OpenAI-compatible server calls.
PUBLIC_ROUTES = frozenset({
    "/health", "/ping", "/version", "/load", "/v1/models",
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
    "/tokenize", "/detokenize",
    "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/completions",
    "/v1/chat/completions/render", "/v1/completions/render",
    "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
    "/v1/messages", "/v1/messages/count_tokens",
})


class RoutePolicy:
    """The kind of each route of one app (built once the app's routes are all added)."""

    def __init__(self, routes: Iterable[BaseRoute], memory_endpoints: Iterable[object]):
        memory = set(map(id, memory_endpoints))
        self._routes = [(route, _kind(route, memory)) for route in routes]

    def kinds(self) -> dict[str, set[Kind]]:
        """Every route path and its kinds (one path may serve several methods)."""
        found: dict[str, set[Kind]] = {}
        for route, kind in self._routes:
            found.setdefault(getattr(route, "path", repr(route)), set()).add(kind)
        return found

    def kind(self, scope: dict) -> Kind | None:
        """The kind of the route this request reaches (a route of another method counts: the
        app answers 405 there); None: no route, the app answers 404."""
        partial: Kind | None = None
        for route, kind in self._routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return kind
            if match == Match.PARTIAL and partial is None:
                partial = kind
        return partial


def _kind(route: BaseRoute, memory: set[int]) -> Kind:
    if id(getattr(route, "endpoint", None)) in memory:
        return "memory"
    path = getattr(route, "path", None)
    if path == METRICS_PATH:
        return "metrics"
    return "public" if path in PUBLIC_ROUTES else "admin"
