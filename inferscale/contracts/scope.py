"""Scopes beyond the owner: a fact belongs to its owner and, optionally, to an agent and a run
(session), taken from the turn it came from (turn event v2; migration 0011).

A :class:`Scope` used as a filter selects an owner's facts whose fields equal every field it
sets; a field left None matches any value (a filter setting nothing matches every fact). Scope
values and owner ids follow one id rule (the turn event's too): 1-256 characters, no control
characters (Postgres cannot store NUL; the others have no place in an id and hide in logs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Final

from pydantic import Field, TypeAdapter

SCOPE_FIELDS: Final = ("agent_id", "run_id")
MAX_SCOPE_CHARS: Final = 256
MAX_OWNER_CHARS: Final = 256
ID_PATTERN: Final = r"^[^\x00-\x1f\x7f]+$"  # no control characters
SCOPE_PATTERN: Final = ID_PATTERN
ScopeValue = Annotated[str, Field(min_length=1, max_length=MAX_SCOPE_CHARS,
                                  pattern=SCOPE_PATTERN)]  # as request and API fields take it
OwnerId = Annotated[str, Field(min_length=1, max_length=MAX_OWNER_CHARS, pattern=ID_PATTERN)]


@dataclass(frozen=True)
class Scope:
    """An owner's facts of one agent and / or one run (None: any)."""

    agent_id: str | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        """Raises pydantic's ValidationError for a value no turn could carry."""
        for _, value in self.items():
            _SCOPE_VALUE.validate_python(value, strict=True)

    def items(self) -> list[tuple[str, str]]:
        """The fields this scope sets, as (name, value)."""
        return [(name, value) for name in SCOPE_FIELDS
                if (value := getattr(self, name)) is not None]


_SCOPE_VALUE: TypeAdapter[str] = TypeAdapter(ScopeValue)
_OWNER_ID: TypeAdapter[str] = TypeAdapter(OwnerId)


def _valid(adapter: TypeAdapter[str], value: object) -> bool:
    try:
        adapter.validate_python(value, strict=True)
    except ValueError:  # pydantic's ValidationError
        return False
    return True


def is_scope_value(value: object) -> bool:
    """Whether ``value`` is an agent or run id some fact could hold."""
    return _valid(_SCOPE_VALUE, value)


def is_owner_id(value: object) -> bool:
    """Whether ``value`` is a memory owner id (the one check every entry point applies)."""
    return _valid(_OWNER_ID, value)
ANY: Final = Scope()
