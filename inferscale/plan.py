"""Injection plan: which stored KV goes to which prompt positions, signed by the front end.

Only the memory front end inside the server makes plans; the connector refuses any plan whose
HMAC does not verify, so an HTTP client can neither name blobs nor borrow another user's facts.
Plans carry fact ids (never paths) and the token ids each segment must match in the prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

PLAN_KEY = "inferscale"
LEAD = ".lead"  # blob name suffix of a fact's lead encoding
PREAMBLE = "preamble"  # blob and segment name of the preamble's own KV, one per model


def lead_name(fact_id: int | str) -> str:
    """The blob name of a fact's lead encoding: its KV encoded after the preamble alone, exact
    where the fact is served first."""
    return f"{fact_id}{LEAD}"


class PlanError(ValueError):
    """A plan that must not be used."""


@dataclass(frozen=True)
class Segment:
    """One stored span: ``name`` is a fact id, a lead blob (``lead_name``) or "preamble"; it
    starts at ``start``."""

    name: str
    start: int
    token_ids: list[int]
    checksum: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class Plan:
    """Contiguous segments from position 0: the preamble, then injected facts; ``key_scales``:
    the strength in [0, 1] the connector scales the facts' keys with (each of its per-layer key
    scales raised to it, ``key_scales.py``; 0: unscaled)."""

    fingerprint: str
    segments: list[Segment]
    key_scales: float = 0.0

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def check_layout(self) -> None:
        position = 0
        for segment in self.segments:
            if segment.start != position or not segment.token_ids:
                raise PlanError("segments must be contiguous, non-empty, from position 0")
            position = segment.end


def _mac(body: dict, secret: str) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret.encode(), canonical, hashlib.sha256).hexdigest()


def sign(plan: Plan, secret: str) -> dict:
    """The plan as a JSON-able dict with its signature."""
    body = {"fingerprint": plan.fingerprint, "key_scales": plan.key_scales,
            # (dataclasses.asdict deep-copies every id list)
            "segments": [{"name": s.name, "start": s.start, "token_ids": s.token_ids,
                          "checksum": s.checksum} for s in plan.segments]}
    return {**body, "sig": _mac(body, secret)}


def _segment(raw: object) -> Segment:
    if not isinstance(raw, dict) or set(raw) - {"name", "start", "token_ids", "checksum"}:
        raise PlanError("malformed plan: a segment must be an object")
    name, start, ids, checksum = (raw.get(k) for k in ("name", "start", "token_ids", "checksum"))
    if not isinstance(name, str) or type(start) is not int or start < 0:
        raise PlanError("malformed plan: segment name/start")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise PlanError("malformed plan: segment token_ids")
    if checksum is not None and not isinstance(checksum, str):
        raise PlanError("malformed plan: segment checksum")
    return Segment(name, start, ids, checksum)


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
    key_scales = body.get("key_scales", 0.0)
    if not isinstance(fingerprint, str) or not isinstance(segments, list) or not (
            type(key_scales) in (int, float) and 0 <= key_scales <= 1):
        raise PlanError("malformed plan: fingerprint/segments/key_scales")
    plan = Plan(fingerprint=fingerprint, segments=[_segment(s) for s in segments],
                key_scales=float(key_scales))
    plan.check_layout()
    return plan
