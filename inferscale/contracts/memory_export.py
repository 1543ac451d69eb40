"""An owner's memory as JSON Lines: what ``GET /v1/memory/users/{user}/export`` streams and
``POST /v1/memory/users/{user}/import`` takes back (into the same owner or another, on this
server or another).

The first line is an ``ExportHeader``; every other line an ``ExportedFact``: each version of
each fact, live or retired, oldest first (ids ascending), with its text, provenance, scope,
metadata and history (``deleted_at``, ``superseded_by``: another record's id in the same
export). Embeddings and KV are not exported: they belong to the server's embedder and models,
and the importing server makes its own.

A fact version is named across databases by the header's ``origin`` (the exporting database's
identity), the owner exported and its id: ``import_key``. An import is idempotent: a record
whose key the owner already holds is skipped; an import may come in several requests (each
with the header), and a retired version's ``superseded_by`` is resolved once the version that
replaced it has come too.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from inferscale.contracts.metadata import Metadata, is_text
from inferscale.contracts.scope import OwnerId, ScopeValue

MAX_FACT_CHARS = 4000  # a fact's text, wherever it comes in
MAX_IMPORT = 1000  # records per import request


def _text(value: str) -> str:
    if "\x00" in value or not is_text(value):
        raise ValueError("text is valid text without NUL")
    return value


FactText = Annotated[str, Field(min_length=1, max_length=MAX_FACT_CHARS), AfterValidator(_text)]
Label = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_text)]


class ExportHeader(BaseModel):
    """The export's first line."""

    model_config = ConfigDict(extra="ignore")
    format: Literal["inferscale.memory"] = "inferscale.memory"
    version: Literal[1] = 1
    user_id: OwnerId
    origin: str = Field(pattern="^[0-9a-f]{32}$")  # the exporting database's identity
    exported_at: AwareDatetime
    agent_id: ScopeValue | None = None  # the scope exported (None: every scope)
    run_id: ScopeValue | None = None


class ExportedFact(BaseModel):
    """One version of a fact."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    id: int = Field(ge=1, lt=2**63)
    text: FactText
    conversation_id: Label
    turn_ids: list[Label] = Field(default_factory=list, max_length=64)
    extractor: Label
    agent_id: ScopeValue | None = None
    run_id: ScopeValue | None = None
    metadata: Metadata = Field(default_factory=dict)
    ts: AwareDatetime
    created_at: AwareDatetime
    deleted_at: AwareDatetime | None = None
    superseded_by: int | None = Field(default=None, ge=1, lt=2**63)
    expires_at: AwareDatetime | None = None  # never served after
    pinned: bool = False  # in every memory prompt of the owner (at most pinned_max served)

    @model_validator(mode="after")
    def _history(self) -> ExportedFact:
        if self.superseded_by is not None and (self.deleted_at is None
                                               or self.superseded_by <= self.id):
            raise ValueError("superseded_by names a later version of a retired fact")
        return self


def import_key(header: ExportHeader, fact_id: int) -> str:
    """The name of the version ``fact_id`` of the export's owner in its origin database."""
    return hashlib.sha256(json.dumps([header.origin, header.user_id, fact_id]).encode()
                          ).hexdigest()


def line(record: BaseModel | dict[str, Any]) -> bytes:
    """One JSON Lines line."""
    body = record.model_dump(mode="json") if isinstance(record, BaseModel) else record
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
