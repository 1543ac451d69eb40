"""The owner index's byte budget (``OwnerLRU``): owners leave least recently used first, the
held bytes stay within the budget, an owner over the budget is held alone, and an owner's
reload lock leaves with it."""

from __future__ import annotations

import asyncio

import numpy as np

from inferscale.serving.owner_index import OwnerLRU, OwnerVectors


def _owner(rows: int) -> OwnerVectors:
    return OwnerVectors(version=1, inserted=rows, retired=0, ids=np.arange(rows, dtype=np.int64),
                        buffer=np.zeros((rows, 4), np.float32), scopes=(),
                        subjects=np.empty(rows, object), expires=np.full(rows, np.inf),
                        pinned=np.zeros(rows, bool))


def test_least_recently_used_owners_leave_first_within_the_budget():
    each = _owner(8).nbytes
    lru = OwnerLRU(3 * each)
    for user in "abc":
        lru[user] = _owner(8)
        lru.locks[user] = asyncio.Lock()
    assert lru.get("a") is not None  # a read makes "a" recent: "b" is now the oldest
    lru["d"] = _owner(8)
    assert set(lru) == {"a", "c", "d"} and "b" not in lru.locks
    assert lru.currsize == 3 * each <= lru.maxsize
    lru["e"] = _owner(16)  # twice the size: two owners leave
    assert set(lru) == {"d", "e"} and lru.currsize <= lru.maxsize


def test_an_owner_past_the_budget_is_held_alone():
    lru = OwnerLRU(_owner(8).nbytes)
    lru["small"] = _owner(4)
    lru["large"] = _owner(12)
    assert list(lru) == ["large"] and lru.currsize == lru.maxsize
    lru["small"] = _owner(4)
    assert list(lru) == ["small"]
