"""The filter language over an owner's facts (Mem0 v2's filters are the reference): parsed and
bounded here, evaluated here in Python (the server's in-process index) and compiled to SQL by
``db/filter_sql.py``; both give the same answer for every filter and fact (a property test).

A filter is a JSON object: ``{"AND": [f, ...]}``, ``{"OR": [f, ...]}``, ``{"NOT": f}`` (or a
list, negating their conjunction), or conditions ``{field: condition, ...}`` (all must hold; a
logical key beside them is one more condition). Fields: ``user_id``, ``agent_id``, ``run_id``
(strings, null where unset), ``created_at`` / ``updated_at`` (the fact version's time: a version
never changes, so both are when it was stored), ``metadata`` (``{key: condition, ...}``) and
any other name, a metadata key. A condition is a value (``eq``), ``"*"`` (the field is set; for
metadata, the key is present) or ``{operator: value, ...}`` (all must hold):

- ``eq`` / ``ne``: JSON equality with type (``1`` equals ``1.0``; ``true`` is not ``1``);
  ``ne`` is ``NOT eq`` (so a missing key is ``ne`` anything);
- ``gt`` / ``gte`` / ``lt`` / ``lte``: numbers against numbers (exact decimal), strings against
  strings (code point order), times against ISO 8601 times; any other pairing is false;
- ``in`` / ``nin``: ``eq`` one of a list / none of it;
- ``contains``: a string holds the substring, or an array holds the element (by ``eq``).

Numbers compare as exact decimals of their JSON text (as ``jsonb`` does). Filters are bounded
(depth, conditions, list and string sizes), and Mem0's fields or operators with no meaning here
(``app_id``, ``categories``, ``keywords``, ``icontains`` ...) are refused, named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, Final, NamedTuple

from inferscale.contracts.metadata import is_text

ID_FIELDS: Final = ("user_id", "agent_id", "run_id")
TIME_FIELDS: Final = ("created_at", "updated_at")
LOGICAL: Final = ("AND", "OR", "NOT")
OPERATORS: Final = ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "contains")
ORDER_OPS: Final = ("gt", "gte", "lt", "lte")
UNSUPPORTED: Final = {
    "app_id": "facts have no app here (owners, agents and runs)",
    "categories": "facts have no categories here (use a metadata key)",
    "keywords": "keyword search is not offered (search ranks by meaning)",
    "memory_ids": "read facts by id instead",
    "icontains": "case-insensitive matching is not offered (use contains)",
}
MAX_DEPTH: Final = 8
MAX_CONDITIONS: Final = 64
MAX_LIST: Final = 100
MAX_STRING: Final = 1024
WILDCARD: Final = "*"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class FilterError(ValueError):
    """A filter this server does not accept, and why."""


class Subject(NamedTuple):
    """What a filter reads of a fact."""

    user_id: str
    agent_id: str | None
    run_id: str | None
    created_at: datetime
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class Condition:
    """``field`` (an id or time field, or ``("metadata", key)``) ``op`` ``value``; ``op`` is
    ``exists`` for the wildcard."""

    kind: str  # "id", "time", "meta"
    name: str  # the id / time field, or the metadata key
    op: str
    value: Any = None


@dataclass(frozen=True)
class AllOf:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class AnyOf:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Not:
    part: Node


Node = Condition | AllOf | AnyOf | Not
EVERYTHING: Final[Node] = AllOf(())


def parse_filter(raw: object) -> Node:
    """The filter ``raw`` (JSON) as a tree; FilterError naming what is refused."""
    counter = [0]
    return _node(raw, 1, counter)


def _node(raw: object, depth: int, counter: list[int]) -> Node:
    if depth > MAX_DEPTH:
        raise FilterError(f"filters nest at most {MAX_DEPTH} deep")
    if not isinstance(raw, dict):
        raise FilterError("a filter is a JSON object")
    parts: list[Node] = []
    for key, value in raw.items():
        if key in ("AND", "OR"):
            if not isinstance(value, list) or not value:
                raise FilterError(f"{key} takes a non-empty list of filters")
            children = tuple(_node(v, depth + 1, counter) for v in value)
            parts.append(AllOf(children) if key == "AND" else AnyOf(children))
        elif key == "NOT":
            items = value if isinstance(value, list) else [value]
            if not items:
                raise FilterError("NOT takes a filter or a non-empty list of filters")
            children = tuple(_node(v, depth + 1, counter) for v in items)
            parts.append(Not(children[0] if len(children) == 1 else AllOf(children)))
        elif key == "metadata":
            if not isinstance(value, dict) or not value:
                raise FilterError("metadata takes an object of {key: condition}")
            parts.extend(_field("meta", _meta_key(k), v, counter) for k, v in value.items())
        elif key in ID_FIELDS:
            parts.append(_field("id", key, value, counter))
        elif key in TIME_FIELDS:
            parts.append(_field("time", key, value, counter))
        elif key in UNSUPPORTED:
            raise FilterError(f"filter field {key!r}: {UNSUPPORTED[key]}")
        else:
            parts.append(_field("meta", _meta_key(key), value, counter))
    return parts[0] if len(parts) == 1 else AllOf(tuple(parts))


def _meta_key(key: object) -> str:
    if not isinstance(key, str) or not 1 <= len(key) <= 128 or _CONTROL.search(key):
        raise FilterError("metadata keys are 1-128 characters without control characters")
    return key


def _field(kind: str, name: str, raw: object, counter: list[int]) -> Node:
    if raw == WILDCARD:
        return _count(Condition(kind, name, "exists"), counter)
    if not isinstance(raw, dict):
        return _condition(kind, name, "eq", raw, counter)
    if not raw:
        raise FilterError(f"{name!r}: an empty condition")
    conditions = [_condition(kind, name, op, value, counter) for op, value in raw.items()]
    return conditions[0] if len(conditions) == 1 else AllOf(tuple(conditions))


def _count(condition: Condition, counter: list[int]) -> Condition:
    counter[0] += 1
    if counter[0] > MAX_CONDITIONS:
        raise FilterError(f"filters hold at most {MAX_CONDITIONS} conditions")
    return condition


def _condition(kind: str, name: str, op: object, raw: object, counter: list[int]
               ) -> Condition:
    if op in UNSUPPORTED:
        raise FilterError(f"operator {op!r}: {UNSUPPORTED[str(op)]}")
    if op not in OPERATORS:
        raise FilterError(f"{name!r}: unknown operator {str(op)[:40]!r} "
                          f"(one of {', '.join(OPERATORS)})")
    assert isinstance(op, str)
    if op in ("in", "nin"):
        if not isinstance(raw, list) or len(raw) > MAX_LIST:
            raise FilterError(f"{name!r} {op}: a list of at most {MAX_LIST} values")
        value: Any = tuple(_value(kind, name, op, v) for v in raw)
    else:
        value = _value(kind, name, op, raw)
    return _count(Condition(kind, name, op, value), counter)


def _value(kind: str, name: str, op: str, raw: object) -> Any:
    """A condition's operand, checked for its field and operator."""
    if isinstance(raw, str):
        if len(raw) > MAX_STRING or "\x00" in raw or not is_text(raw):
            raise FilterError(f"{name!r}: strings are at most {MAX_STRING} characters of "
                              "valid text without NUL")
    if kind == "time":
        if op in ("contains",) or not isinstance(raw, str):
            raise FilterError(f"{name!r} compares with ISO 8601 times (eq, ne, gt, gte, lt, "
                              "lte, in, nin)")
        return _time(name, raw)
    if kind == "id":
        if op in ORDER_OPS or not (isinstance(raw, str) or (raw is None and op != "contains")):
            raise FilterError(f"{name!r} takes strings (null: unset) with eq, ne, in, nin, "
                              "contains or '*'")
        return raw
    if isinstance(raw, bool) or raw is None:
        if op in ORDER_OPS or (raw is None and op == "contains"):
            raise FilterError(f"{name!r}: {op} compares numbers or strings")
        return raw
    if isinstance(raw, int | float):
        try:
            return _number(raw)
        except ArithmeticError:
            raise FilterError(f"{name!r}: numbers are finite") from None
    if isinstance(raw, str):
        return raw
    raise FilterError(f"{name!r}: conditions take strings, numbers, booleans or null")


def _number(value: int | float) -> Decimal:
    """A JSON number as the exact decimal of its JSON text (as ``jsonb`` holds it)."""
    number = Decimal(value) if isinstance(value, int) else Decimal(repr(value))
    if not number.is_finite():
        raise ArithmeticError
    return number


def _time(name: str, raw: str) -> datetime:
    try:
        parsed = (datetime.fromisoformat(raw) if "T" in raw or " " in raw or len(raw) > 10
                  else datetime.combine(date.fromisoformat(raw), datetime.min.time()))
    except ValueError:
        raise FilterError(f"{name!r}: {raw[:40]!r} is not an ISO 8601 date or time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def pinned(node: Node) -> dict[str, str]:
    """The id fields every fact the filter selects has, by equality in its top conjunction
    (``{"user_id": "alice", "agent_id": "tutor"}``): the owner, and the scope a key names."""
    found: dict[str, str] = {}
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, AllOf):
            stack.extend(item.parts)
        elif (isinstance(item, Condition) and item.kind == "id" and item.op == "eq"
              and isinstance(item.value, str)):
            if found.setdefault(item.name, item.value) != item.value:
                found[item.name] = ""  # two values: nothing matches; names no single one
    return {k: v for k, v in found.items() if v}


def conditions(node: Node) -> int:
    """How many conditions the filter holds: what evaluating it costs per fact."""
    count, stack = 0, [node]
    while stack:
        item = stack.pop()
        if isinstance(item, AllOf | AnyOf):
            stack.extend(item.parts)
        elif isinstance(item, Not):
            stack.append(item.part)
        else:
            count += 1
    return count


def matches(node: Node, fact: Subject) -> bool:
    """Whether ``fact`` passes the filter (the Python path)."""
    if isinstance(node, AllOf):
        return all(matches(part, fact) for part in node.parts)
    if isinstance(node, AnyOf):
        return any(matches(part, fact) for part in node.parts)
    if isinstance(node, Not):
        return not matches(node.part, fact)
    if node.kind == "meta":
        present = node.name in fact.metadata
        if node.op == "exists":
            return present
        return _holds(node.op, node.value, fact.metadata.get(node.name), present)
    value = fact.created_at if node.kind == "time" else getattr(fact, node.name)
    if node.op == "exists":
        return value is not None
    return _holds(node.op, node.value, value, True)


def _holds(op: str, operand: Any, value: Any, present: bool) -> bool:
    if op == "ne":
        return not _holds("eq", operand, value, present)
    if op == "nin":
        return not _holds("in", operand, value, present)
    if not present:
        return False
    if op == "eq":
        return _equal(value, operand)
    if op == "in":
        return any(_equal(value, v) for v in operand)
    if op == "contains":
        if isinstance(value, str):
            return isinstance(operand, str) and operand in value
        return isinstance(value, list) and any(_equal(v, operand) for v in value)
    left, right = _comparable(value, operand)
    if left is None:
        return False
    return bool({"gt": left > right, "gte": left >= right, "lt": left < right,
                 "lte": left <= right}[op])


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float | Decimal):
        return "number"
    if isinstance(value, datetime):
        return "time"
    return "string" if isinstance(value, str) else "other"


def _equal(value: Any, operand: Any) -> bool:
    kind = _kind(value)
    if kind != _kind(operand):
        return False
    if kind == "number" and not isinstance(value, Decimal):
        value = _number(value)
    return bool(value == operand)


def _comparable(value: Any, operand: Any) -> tuple[Any, Any]:
    kind = _kind(value)
    if kind != _kind(operand) or kind not in ("number", "string", "time"):
        return None, None
    if kind == "number" and not isinstance(value, Decimal):
        return _number(value), operand
    return value, operand
