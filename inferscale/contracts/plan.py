"""Injection plan: which stored KV goes to which prompt positions, signed by the front end.

Only the memory front end inside the server makes plans; the connector refuses any plan whose
HMAC does not verify, so an HTTP client can neither name blobs nor borrow another user's facts.
Plans carry blob names (``blob_name.py``: fact ids, never paths) and, per segment, the length
and a digest of the token ids it must match in the prompt and in its blob (not the ids: at
k = 50 signing and checking 2,243 ids as JSON took 1.4 ms per request).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferscale.contracts.blob_name import BlobName

PLAN_KEY = "inferscale"


class PlanError(ValueError):
    """A plan that must not be used."""


def token_digest(token_ids: Sequence[int]) -> str:
    """BLAKE2b-128 of token ids as little-endian int64s (``OverflowError`` past int64)."""
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Segment:
    """One stored span: the blob ``name`` (a fact's, a lead blob or the preamble's) starts at
    ``start`` and holds ``length`` tokens whose ``token_digest`` is ``digest``."""

    name: BlobName
    start: int
    length: int
    digest: str
    checksum: str | None = None

    @classmethod
    def of(cls, name: BlobName, start: int, token_ids: Sequence[int],
           checksum: str | None = None) -> Segment:
        return cls(name, start, len(token_ids), token_digest(token_ids), checksum)

    @property
    def end(self) -> int:
        return self.start + self.length

    def matches(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` are this segment's tokens."""
        return len(token_ids) == self.length and token_digest(token_ids) == self.digest


@dataclass(frozen=True)
class Plan:
    """Contiguous segments from position 0: the preamble, then injected facts; ``key_scales``:
    the strength in [0, 1] the connector scales the facts' keys with (each of its per-layer key
    scales raised to it, ``key_scales.py``; 0: unscaled); ``exact``: positions ``[0, exact)``
    (the preamble and pinned facts) are to come from the engine's prefix cache, exact, to its
    last whole block: where the cache holds less, nothing is injected and the engine prefills
    the prompt (which caches them, exact, for the next request)."""

    fingerprint: str
    segments: list[Segment]
    key_scales: float = 0.0
    exact: int = 0

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def check_layout(self) -> None:
        position = 0
        for segment in self.segments:
            if segment.start != position or segment.length < 1:
                raise PlanError("segments must be contiguous, non-empty, from position 0")
            position = segment.end
        if not 0 <= self.exact <= position:
            raise PlanError("exact must lie within the segments")


def _mac(body: dict[str, Any], secret: str) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret.encode(), canonical, hashlib.sha256).hexdigest()


def sign(plan: Plan, secret: str) -> dict[str, Any]:
    """The plan as a JSON-able dict with its signature."""
    body = {"fingerprint": plan.fingerprint, "key_scales": plan.key_scales, "exact": plan.exact,
            "segments": [{"name": str(s.name), "start": s.start, "length": s.length,
                          "digest": s.digest, "checksum": s.checksum} for s in plan.segments]}
    return {**body, "sig": _mac(body, secret)}


_SEGMENT_KEYS = ("name", "start", "length", "digest", "checksum")


def _segment(raw: object) -> Segment:
    if not isinstance(raw, dict) or set(raw) - set(_SEGMENT_KEYS):
        raise PlanError("malformed plan: a segment must be an object")
    name, start, length, digest, checksum = (raw.get(k) for k in _SEGMENT_KEYS)
    blob = BlobName.parse(name) if isinstance(name, str) else None
    if blob is None or type(start) is not int or start < 0:
        raise PlanError("malformed plan: segment name/start")
    if type(length) is not int or not isinstance(digest, str):
        raise PlanError("malformed plan: segment length/digest")
    if checksum is not None and not isinstance(checksum, str):
        raise PlanError("malformed plan: segment checksum")
    return Segment(blob, start, length, digest, checksum)


def verify(data: object, secret: str) -> Plan:
    """Parse and authenticate a signed plan; raise PlanError (and nothing else) otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("sig"), str):
        raise PlanError("unsigned plan")
    body = {k: v for k, v in data.items() if k != "sig"}
    try:
        mac = _mac(body, secret)
    except (TypeError, ValueError, RecursionError) as exc:
        raise PlanError(f"malformed plan: {type(exc).__name__}") from None
    if not hmac.compare_digest(data["sig"].encode("utf-8", "surrogatepass"), mac.encode()):
        raise PlanError("bad plan signature")
    fingerprint, segments = body.get("fingerprint"), body.get("segments")
    key_scales, exact = body.get("key_scales", 0.0), body.get("exact", 0)
    if not isinstance(fingerprint, str) or not isinstance(segments, list) or not (
            type(key_scales) in (int, float) and 0 <= key_scales <= 1) or type(exact) is not int:
        raise PlanError("malformed plan: fingerprint/segments/key_scales/exact")
    plan = Plan(fingerprint=fingerprint, segments=[_segment(s) for s in segments],
                key_scales=float(key_scales), exact=exact)
    plan.check_layout()
    return plan
