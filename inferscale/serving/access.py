"""Who may read or change memory: API keys as permissions, and a rate limit per key.

Every memory request (the memory API's routes, a chat completion that names an owner) and every
engine-control route is admitted here, and nowhere else. A key grants owners ("*": any) and,
optionally, only some agents / runs of theirs and only reads (``settings.KeyGrant``); a scoped
key must name a scope it holds (a filter it may not widen), and acts on a fact only where the
fact's own scope is one it holds. Without keys, memory is served only where the operator chose
anonymous access (``INFERSCALE_ALLOW_ANONYMOUS``); ``inferscale serve`` otherwise makes a local
admin key (``core/local_key.py``), so a server never runs open by accident. Keys are
compared in constant time and never logged; the limiter is keyed by a digest of the key (admin
keys, the operator's and the local one, are not limited; anonymous callers are, per address).
Every memory route counts against it, weighted by its cost (an import counts its records);
lookups of ids that are not the caller's count on a limit of their own, and reads that wait
hold at most ``max_waits_per_key`` connections per key. The counts live in
``rate_limit_storage`` (one process's memory, or a store replicas share).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from limits import RateLimitItem, parse_many
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from inferscale.contracts.scope import ANY, Scope
from inferscale.core.settings import KeyGrant, Settings
from inferscale.serving.guards import FrontendError

ANONYMOUS = KeyGrant(owners=["*"])


def bearer_key(headers: dict[str, str]) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (None: none given)."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def holds(grant: KeyGrant, scope: Scope) -> bool:
    """Whether the key may act in ``scope``: each field it limits is set to one it holds."""
    return ((grant.agents is None or scope.agent_id in grant.agents)
            and (grant.runs is None or scope.run_id in grant.runs))


class Access:
    """The server's admission of memory requests (one per server process)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._keys = [(key.encode(), grant) for key, grant in settings.api_keys.items()]
        self._limits: list[RateLimitItem] = (parse_many(settings.rate_limit)
                                             if settings.rate_limit else [])
        self._limiter = MovingWindowRateLimiter(storage_from_string(settings.rate_limit_storage))
        self._waiting: Counter[str] = Counter()

    def caller(self, headers: dict[str, str], client: str | None) -> tuple[KeyGrant, str]:
        """The grant of the request's key and who it counts against in the rate limit; 401
        for a missing or unknown key."""
        if not self._keys:
            if self.settings.allow_anonymous:
                return ANONYMOUS, f"address:{client}"
            raise FrontendError(401, "memory requests need an API key: this server has no "
                                     "INFERSCALE_API_KEYS and INFERSCALE_ALLOW_ANONYMOUS is off")
        given = (bearer_key(headers) or "").encode()
        # Every key compared, in constant time each: the time says nothing of which is close.
        found = [grant for key, grant in self._keys if hmac.compare_digest(key, given)]
        if not given or not found:
            raise FrontendError(401, "missing or unknown API key")
        return found[0], "key:" + hashlib.sha256(given).hexdigest()[:32]

    def known(self, headers: dict[str, str], client: str | None, cost: int = 1) -> KeyGrant:
        """The grant of a known key, counted in the rate limit (``cost`` requests' worth);
        401 / 429 otherwise."""
        grant, who = self.caller(headers, client)
        self._count(grant, who, cost)
        return grant

    def authorize(self, headers: dict[str, str], owner: str, *, scope: Scope | None = ANY,
                  write: bool = False, client: str | None = None, cost: int = 1) -> KeyGrant:
        """Admit a request acting for ``owner`` in ``scope`` (None: the caller checks the
        scope of what it touches with ``holds``), a write where ``write``, worth ``cost``
        requests of the rate limit (an import counts its records): 401 / 403 with the reason,
        429 over the rate limit; returns the key's grant."""
        grant, who = self.caller(headers, client)
        if owner not in grant.owners and "*" not in grant.owners:
            raise FrontendError(403, f"this API key may not act for {owner!r}")
        if write and grant.read_only:
            raise FrontendError(403, "this API key may only read memory")
        if scope is not None and not holds(grant, scope):
            raise FrontendError(403, f"this API key acts only for agents {grant.agents} / "
                                     f"runs {grant.runs} (None: any): name one of them")
        self._count(grant, who, cost)
        return grant

    def missed(self, headers: dict[str, str], client: str | None) -> None:
        """A lookup of an id that is not the caller's (answered 404): counted on a limit of
        its own, so that ids cannot be probed at the full rate; 429 past it."""
        grant, who = self.caller(headers, client)
        self._count(grant, who, 1, "missed")

    @contextmanager
    def waiting(self, headers: dict[str, str], client: str | None) -> Iterator[None]:
        """A request that holds a connection while it waits: at most ``max_waits_per_key``
        at once per caller (admin keys aside); 429 past it."""
        grant, who = self.caller(headers, client)
        if not _unlimited(grant, who) and self._waiting[who] >= self.settings.max_waits_per_key:
            raise FrontendError(429, f"at most {self.settings.max_waits_per_key} waiting reads "
                                     "at once per key", {"retry-after": "1"})
        self._waiting[who] += 1
        try:
            yield
        finally:
            self._waiting[who] -= 1
            if not self._waiting[who]:
                del self._waiting[who]

    def authorize_control(self, headers: dict[str, str], client: str | None = None) -> None:
        """Engine-control routes and operator-only memory routes: admin keys only (anyone
        where anonymous access is the chosen policy)."""
        grant, _ = self.caller(headers, client)
        if not grant.admin:
            raise FrontendError(403, "this route needs an admin key (any owner, every scope, "
                                     "edits)")

    def _count(self, grant: KeyGrant, who: str, cost: int, what: str = "memory") -> None:
        if _unlimited(grant, who):
            return
        for limit in self._limits:  # a request costs at most a whole window (never refused
            # whatever the caller waits: an import of 1,000 records under 100/second)
            if not self._limiter.hit(limit, what, who, cost=min(max(1, cost), limit.amount)):
                reset = self._limiter.get_window_stats(limit, what, who).reset_time
                retry = max(1, math.ceil(reset - time.time()))
                raise FrontendError(429, f"rate limit {limit} exceeded for this key",
                                    {"retry-after": str(retry)})


def _unlimited(grant: KeyGrant, who: str) -> bool:
    """An operator's own key (admin, not the anonymous policy): no limit applies."""
    return grant.admin and who.startswith("key:")
