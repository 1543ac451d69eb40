"""Blob names: the one place that names KV blobs and parses the names back.

A blob is a fact's (``12``), its lead encoding's (``12.lead``: the fact encoded after the
preamble alone, exact where it is served first) or the preamble's (``preamble``, one per model).
In the durable tier it lies at ``<model fingerprint[:16]>/<shard>/<name>.safetensors``, the
shard the first two hex digits of the SHA-1 of the fact id (a lead blob shares its fact's) or of
``preamble``. Fact ids are canonical decimals of a non-negative bigint; any other text is no
blob name (parsing answers None), so names written by earlier versions read back and hostile
names never reach a path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import NewType

FactId = NewType("FactId", int)  # a ``facts.id``: bigint, never reused

LEAD = ".lead"
SUFFIX = ".safetensors"
_PREAMBLE = "preamble"
_MAX_FACT_ID = 2**63 - 1  # Postgres bigint


@dataclass(frozen=True)
class BlobName:
    """A fact's blob, its lead blob (``lead``), or the preamble's (``fact_id`` None)."""

    fact_id: FactId | None
    lead: bool = False

    def __post_init__(self) -> None:
        if self.fact_id is None and self.lead:
            raise ValueError("the preamble has no lead blob")
        if self.fact_id is not None and not (
                type(self.fact_id) is int and 0 <= self.fact_id <= _MAX_FACT_ID):
            raise ValueError(f"not a fact id: {self.fact_id!r}")

    def __str__(self) -> str:
        if self.fact_id is None:
            return _PREAMBLE
        return f"{self.fact_id}{LEAD}" if self.lead else str(self.fact_id)

    @classmethod
    def parse(cls, text: str) -> BlobName | None:
        """The name ``text`` spells (as ``str`` writes it), None for any other text."""
        if text == _PREAMBLE:
            return PREAMBLE
        digits = text.removesuffix(LEAD)
        if not (0 < len(digits) <= len(str(_MAX_FACT_ID)) and digits.isascii()
                and digits.isdigit() and (digits == "0" or digits[0] != "0")):
            return None
        fact_id = int(digits)
        return cls(FactId(fact_id), digits != text) if fact_id <= _MAX_FACT_ID else None

    def location(self, fingerprint: str) -> str:
        """Where this blob lies in the durable tier for the model ``fingerprint`` (or its
        16-character prefix)."""
        base = _PREAMBLE if self.fact_id is None else str(self.fact_id)
        shard = hashlib.sha1(base.encode()).hexdigest()[:2]
        return f"{fingerprint[:16]}/{shard}/{self}{SUFFIX}"


PREAMBLE = BlobName(None)


def fact_blob(fact_id: FactId) -> BlobName:
    """The name of a fact's own blob: its KV encoded after its context window."""
    return BlobName(fact_id)


def lead_blob(fact_id: FactId) -> BlobName:
    """The name of a fact's lead blob: its KV encoded after the preamble alone."""
    return BlobName(fact_id, lead=True)


def parse_location(location: str) -> BlobName | None:
    """The name of the blob at a durable-tier location (``<model>/<shard>/<name>.safetensors``),
    None for anything else."""
    path = PurePosixPath(location)
    if len(path.parts) != 3 or not path.name.endswith(SUFFIX):
        return None
    return BlobName.parse(path.name.removesuffix(SUFFIX))


def location_model(location: str) -> str:
    """The model folder (a fingerprint's 16-character prefix) a durable-tier location lies in."""
    return PurePosixPath(location).parts[0]


def with_leads(locations: Iterable[str]) -> list[str]:
    """The locations and, after each fact blob's, where its lead blob would be (once each)."""
    out: dict[str, None] = {}
    for location in locations:
        out[location] = None
        name = parse_location(location)
        if name is not None and name.fact_id is not None and not name.lead:
            out[lead_blob(name.fact_id).location(location_model(location))] = None
    return list(out)


def holds_lead(fact_id: FactId, share: float) -> bool:
    """Whether a fact is among the ``share`` of facts given a lead blob: decided by a hash of its
    id (ids come in runs per conversation), the same on every worker and every re-encoding."""
    digest = hashlib.blake2b(str(fact_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < share * 2**64
