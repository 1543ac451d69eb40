"""The filter language (``contracts/filters.py``) compiled to SQL over ``facts``: the same answer
as its Python path for every filter and fact. Every condition is a boolean that is never NULL
(a missing key or an unset field is false, never unknown), so ``NOT`` negates exactly; values
are bound parameters. Numbers compare as ``numeric`` (the exact decimal ``jsonb`` holds),
strings by code point (``COLLATE "C"``); equality on metadata uses ``jsonb`` equality behind a
containment test the GIN index (migration 0014) can serve.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Numeric,
    String,
    and_,
    case,
    cast,
    false,
    func,
    literal,
    not_,
    or_,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB

from inferscale.contracts.filters import AllOf, AnyOf, Condition, Node, Not
from inferscale.db.tables import facts


def filter_sql(node: Node) -> ColumnElement[bool]:
    """The SQL condition selecting the facts ``node`` passes."""
    if isinstance(node, AllOf):
        return and_(true(), *(filter_sql(p) for p in node.parts))
    if isinstance(node, AnyOf):
        return or_(false(), *(filter_sql(p) for p in node.parts))
    if isinstance(node, Not):
        return not_(filter_sql(node.part))
    if node.kind == "meta":
        return _meta(node)
    column = facts.c.created_at if node.kind == "time" else facts.c[node.name]
    return _column(node, column)


def _never_null(condition: ColumnElement[Any]) -> ColumnElement[bool]:
    return func.coalesce(condition, false(), type_=Boolean)


def _column(node: Condition, column: ColumnElement[Any]) -> ColumnElement[bool]:
    """A condition on a column (an id field, the time)."""
    op, value = node.op, node.value
    if op == "exists":
        return column.is_not(None)
    if op in ("ne", "nin"):
        return not_(_column(Condition(node.kind, node.name, "eq" if op == "ne" else "in",
                                      value), column))
    if op == "eq":
        return column.is_(None) if value is None else _never_null(column == value)
    if op == "in":
        return or_(false(), *(_column(Condition(node.kind, node.name, "eq", v), column)
                              for v in value))
    if op == "contains":
        return _never_null(func.strpos(column, value) > 0)
    return _never_null({"gt": column > value, "gte": column >= value, "lt": column < value,
                        "lte": column <= value}[op])


def _meta(node: Condition) -> ColumnElement[bool]:
    """A condition on one metadata key."""
    key, op, value = node.name, node.op, node.value
    if op == "exists":
        return facts.c.metadata.has_key(key)
    if op in ("ne", "nin"):
        return not_(_meta(Condition("meta", key, "eq" if op == "ne" else "in", value)))
    if op == "in":
        return or_(false(), *(_meta(Condition("meta", key, "eq", v)) for v in value))
    item = facts.c.metadata[key]
    kind = func.jsonb_typeof(item)
    if op == "eq":  # containment first: the GIN index can serve it
        pair = _jsonb("{" + json.dumps(key) + ":" + _json_text(value) + "}")
        return and_(facts.c.metadata.contains(pair),
                    _never_null(item == _jsonb(_json_text(value))))
    if op == "contains":
        element = _jsonb("[" + _json_text(value) + "]")
        text_case = ([(kind == "string", func.strpos(item.astext, value) > 0)]
                     if isinstance(value, str) else [])
        return case(*text_case, (kind == "array", item.contains(element)), else_=false())
    left: ColumnElement[Any]
    right: ColumnElement[Any]
    if isinstance(value, Decimal):
        want, left, right = "number", cast(item, Numeric), literal(value, Numeric)
    else:
        want, left = "string", item.astext.collate("C")
        right = literal(value, String).collate("C")
    compared = {"gt": left > right, "gte": left >= right, "lt": left < right,
                "lte": left <= right}[op]
    return case((kind == want, compared), else_=false())


def _json_text(value: Any) -> str:
    """A filter operand as JSON text (a number as its exact decimal)."""
    return str(value) if isinstance(value, Decimal) else json.dumps(value)


def _jsonb(text: str) -> ColumnElement[Any]:
    return cast(literal(text), JSONB)
