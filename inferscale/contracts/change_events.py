"""Change events: what the change topic carries (``INFERSCALE_CHANGES_TOPIC``), one record per
change to which facts of an owner are live, keyed by ``user_id`` (so an owner's changes stay in
order on one partition). Ids only by default: a consumer reads what it needs through the memory
API; with ``INFERSCALE_CHANGES_WITH_TEXT`` an ``added`` event carries the fact's text (read when
the event is published: none where the fact is gone by then, e.g. its owner was forgotten).

Delivery is at least once, in the order the changes were recorded (``change_id`` grows with
it): after a crash between publishing and marking them published, the relay publishes the same
records again, so a consumer that remembers the last ``change_id`` it applied per owner sees
every change once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from inferscale.contracts.scope import OwnerId, ScopeValue

KINDS = ("added", "superseded", "expired", "deleted", "forgotten")


class MemoryChange(BaseModel):
    """One change: ``added`` (a live fact stored: extracted, given, imported, or an edit's new
    version), ``superseded`` (retired by an edit; ``superseded_by``: the new version),
    ``expired`` (retired at its expiry), ``deleted`` (retired otherwise), ``forgotten`` (every
    fact of the owner deleted; no ``fact_id``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    version: Literal[1] = 1
    change_id: int = Field(ge=1)
    user_id: OwnerId
    kind: Literal["added", "superseded", "expired", "deleted", "forgotten"]
    fact_id: int | None = Field(default=None, ge=1)
    superseded_by: int | None = Field(default=None, ge=1)
    agent_id: ScopeValue | None = None
    run_id: ScopeValue | None = None
    at: AwareDatetime
    text: str | None = None  # an added fact's, where configured (see the module's docstring)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()
