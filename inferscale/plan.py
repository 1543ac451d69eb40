"""Injection plan: which stored KV goes to which prompt positions, signed by the front end.

Only the memory front end inside the server makes plans; the connector refuses any plan whose
HMAC does not verify, so an HTTP client can neither name blobs nor borrow another user's facts.
Plans carry fact ids (never paths) and the token ids each segment must match in the prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass

PLAN_KEY = "inferscale"


class PlanError(ValueError):
    """A plan that must not be used."""


@dataclass(frozen=True)
class Segment:
    """One stored span: ``name`` is a fact id or "preamble"; it starts at ``start``."""

    name: str
    start: int
    token_ids: list[int]
    checksum: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class Plan:
    """Contiguous segments from position 0: the preamble, then injected facts."""

    fingerprint: str
    segments: list[Segment]

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
    body = {"fingerprint": plan.fingerprint, "segments": [asdict(s) for s in plan.segments]}
    return {**body, "sig": _mac(body, secret)}


def verify(data: dict, secret: str) -> Plan:
    """Parse and authenticate a signed plan; raise PlanError otherwise."""
    if not isinstance(data, dict) or "sig" not in data:
        raise PlanError("unsigned plan")
    body = {k: v for k, v in data.items() if k != "sig"}
    if not hmac.compare_digest(str(data["sig"]), _mac(body, secret)):
        raise PlanError("bad plan signature")
    try:
        plan = Plan(fingerprint=str(body["fingerprint"]),
                    segments=[Segment(**s) for s in body["segments"]])
    except (KeyError, TypeError) as exc:
        raise PlanError(f"malformed plan: {exc}") from None
    plan.check_layout()
    return plan
