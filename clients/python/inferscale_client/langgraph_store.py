"""LangGraph's long-term memory store (``langgraph.store.base.BaseStore``) over the memory API:
a LangGraph app keeps its memory here, served to the model as KV like any other fact.

Mapping (one fact per item): the namespace's first label is the memory **owner** (a key
limited to some owners can use only those); the fact's **text**, what retrieval embeds and the
model reads, is the value's index fields joined (the put's ``index``, else the store's, else
``text`` / ``content`` / ``memory`` / ``data``, else the value as JSON); its metadata holds
the item: ``langgraph.namespace`` (the namespace as JSON), ``langgraph.prefixes`` (every
prefix, so a search under a prefix is one filter), ``langgraph.key``, ``langgraph.value`` (the
value as JSON) and each top-level scalar field of the value as
``value.<field>`` (what LangGraph's ``filter`` compares: ``$eq``, ``$ne``, ``$gt``, ``$gte``,
``$lt``, ``$lte``). A put of an existing key is an edit (a new version; the old one in the
fact's history); ``created_at`` and ``updated_at`` are the version's time (as ``InMemoryStore``,
a put sets both).

Where it differs from ``InMemoryStore`` (each one tested): a namespace needs an owner as its
first label, and ``list_namespaces`` a prefix naming it (the API lists no owners); an item is
metadata, so at most 4 kB with its namespace (the server refuses more, named); ``index=False``
still stores the text (every fact is retrievable by the model); ``ttl`` is not supported
(``expires_at`` on a fact is the API's); a search without a query lists in version order, not
by update time; scores are cosine similarities.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
)

from inferscale_client.memory_client import AsyncMemoryClient
from inferscale_client.results import Fact

CONVERSATION = "langgraph"  # the conversation id of the store's facts
TEXT_FIELDS = ("text", "content", "memory", "data")
OPERATORS = {"$eq": "eq", "$ne": "ne", "$gt": "gt", "$gte": "gte", "$lt": "lt", "$lte": "lte"}
PAGE = 200


def _ns(namespace: Iterable[str]) -> str:
    return json.dumps(list(namespace))


def owner_of(namespace: tuple[str, ...]) -> str:
    """The namespace's first label: the owner of its facts."""
    if not namespace or not namespace[0]:
        raise ValueError("an InferScale namespace starts with its owner, e.g. (user_id, "
                         "'memories')")
    return namespace[0]


def fact_text(value: Mapping[str, Any], fields: list[str] | None) -> str:
    """What the fact says: the value's ``fields`` joined, else its first text field, else the
    value as JSON."""
    if fields and fields != ["$"]:
        texts = [value[f] if isinstance(value.get(f), str) else json.dumps(value.get(f))
                 for f in fields if f in value]
        if texts:
            return "\n".join(texts)
    for name in TEXT_FIELDS:
        if isinstance(value.get(name), str) and value[name].strip():
            return value[name]
    return json.dumps(value, sort_keys=True)


def item_metadata(namespace: tuple[str, ...], key: str, value: Mapping[str, Any]
                  ) -> dict[str, Any]:
    """The fact's metadata for an item (see the module's docstring)."""
    fields = {f"value.{name}": field for name, field in value.items()
              if isinstance(field, str | int | float | bool) or field is None}
    return {**fields, "langgraph.namespace": _ns(namespace),
            "langgraph.prefixes": [_ns(namespace[:i]) for i in range(1, len(namespace) + 1)],
            "langgraph.key": key, "langgraph.value": json.dumps(dict(value))}


def value_filter(condition: Mapping[str, Any] | None) -> dict[str, Any]:
    """LangGraph's ``filter`` (field: value, or field: {"$op": value}) in the API's filter
    language over the ``value.<field>`` metadata keys."""
    out: dict[str, Any] = {}
    for name, wanted in (condition or {}).items():
        if isinstance(wanted, Mapping):
            unknown = sorted(set(wanted) - set(OPERATORS))
            if unknown:
                raise ValueError(f"filter operators {unknown} are not supported; known: "
                                 f"{sorted(OPERATORS)}")
            out[f"value.{name}"] = {OPERATORS[op]: v for op, v in wanted.items()}
        else:
            out[f"value.{name}"] = wanted
    return out


def as_item(fact: Fact) -> Item:
    """The item a fact of the store holds."""
    meta = fact.metadata
    return Item(namespace=tuple(json.loads(meta["langgraph.namespace"])),
                key=meta["langgraph.key"], value=json.loads(meta["langgraph.value"]),
                created_at=fact.created_at, updated_at=fact.created_at)


def as_hit(fact: Fact, score: float | None) -> SearchItem:
    """The item as a search result (``score``: the cosine similarity; None: no query)."""
    item = as_item(fact)
    return SearchItem(item.namespace, item.key, item.value, item.created_at, item.updated_at,
                      score)


def matches(namespace: tuple[str, ...], conditions: Iterable[MatchCondition]) -> bool:
    """Whether a namespace meets every prefix / suffix condition ("*" matches any label)."""
    for condition in conditions:
        path = tuple(condition.path)
        if len(path) > len(namespace):
            return False
        part = namespace[:len(path)] if condition.match_type == "prefix" else \
            namespace[len(namespace) - len(path):]
        if not all(p == "*" or p == n for p, n in zip(path, part, strict=True)):
            return False
    return True


class InferScaleStore(BaseStore):
    """A LangGraph ``BaseStore`` over one server's memory API (sync and async). ``index``:
    ``{"fields": [...]}``, the value fields a fact's text is made of (LangGraph's index
    configuration; the server embeds with its own model)."""

    supports_ttl = False

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 index: Mapping[str, Any] | None = None, timeout: float = 60.0,
                 data_dir: Path | None = None):
        self._connect = partial(AsyncMemoryClient, base_url, api_key, timeout,
                                data_dir=data_dir)
        self._fields: list[str] | None = list((index or {}).get("fields") or []) or None

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """The ops in order, on a loop of their own (callable from inside a running loop)."""
        ops = list(ops)
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self.abatch(ops)).result()

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        async with self._connect() as client:
            return [await self._one(client, op) for op in ops]

    async def _one(self, client: AsyncMemoryClient, op: Op) -> Result:
        if isinstance(op, GetOp):
            fact = await self._find(client, op.namespace, op.key)
            return as_item(fact) if fact is not None else None
        if isinstance(op, PutOp):
            await self._put(client, op)
            return None
        if isinstance(op, SearchOp):
            return await self._search(client, op)
        if isinstance(op, ListNamespacesOp):
            return await self._namespaces(client, op)
        raise ValueError(f"unknown store operation {type(op).__name__}")

    async def _find(self, client: AsyncMemoryClient, namespace: tuple[str, ...], key: str
                    ) -> Fact | None:
        page = await client.list_facts(owner_of(namespace), limit=1, filters={
            "langgraph.namespace": _ns(namespace), "langgraph.key": key})
        return page.facts[0] if page.facts else None

    async def _put(self, client: AsyncMemoryClient, op: PutOp) -> None:
        if op.ttl is not None:
            raise NotImplementedError("InferScaleStore does not support ttl")
        owner = owner_of(op.namespace)
        existing = await self._find(client, op.namespace, op.key)
        if op.value is None:
            if existing is not None:
                await client.delete_fact(owner, existing.id)
            return
        fields = op.index if isinstance(op.index, list) else self._fields
        text = fact_text(op.value, fields)
        metadata = item_metadata(op.namespace, op.key, op.value)
        if existing is None:
            await client.add_fact(owner, text, CONVERSATION, metadata=metadata)
        else:
            await client.edit_fact(owner, existing.id, text=text, metadata=metadata)

    async def _search(self, client: AsyncMemoryClient, op: SearchOp) -> list[SearchItem]:
        owner = owner_of(op.namespace_prefix)
        where = {"langgraph.prefixes": {"contains": _ns(op.namespace_prefix)},
                 **value_filter(op.filter)}
        if op.query:
            hits = await client.search(owner, op.query, k=op.offset + op.limit, filters=where)
            return [as_hit(await client.get_fact(owner, hit.id), hit.score)
                    for hit in hits[op.offset:]]
        found: list[SearchItem] = []
        async for fact in client.iter_facts(owner, page=PAGE, filters=where):
            found.append(as_hit(fact, None))
            if len(found) == op.offset + op.limit:
                break
        return found[op.offset:]

    async def _namespaces(self, client: AsyncMemoryClient, op: ListNamespacesOp
                          ) -> list[tuple[str, ...]]:
        conditions = tuple(op.match_conditions or ())
        owners = {c.path[0] for c in conditions if c.match_type == "prefix" and c.path
                  and c.path[0] != "*"}
        if len(owners) != 1:
            raise ValueError("InferScaleStore.list_namespaces needs a prefix naming one owner, "
                             "e.g. prefix=(user_id,): the memory API lists no owners")
        owner = owners.pop()
        seen: set[tuple[str, ...]] = set()
        async for fact in client.iter_facts(owner, page=PAGE,
                                            filters={"langgraph.namespace": "*"}):
            namespace = tuple(json.loads(fact.metadata["langgraph.namespace"]))
            if matches(namespace, conditions):
                seen.add(namespace[:op.max_depth] if op.max_depth is not None else namespace)
        return sorted(seen)[op.offset:op.offset + op.limit]
