"""The memory API's Python client (``serving/memory_api.py``), sync and async, typed results.

One implementation, in the client distribution (``clients/python``, package
``inferscale_client``: installable without the engine); re-exported here for code that imports
``inferscale.client``.
"""

from inferscale_client import (
    AsyncMemoryClient,
    Deleted,
    Fact,
    FactKV,
    FactPage,
    Forgotten,
    MemoryAPIError,
    MemoryClient,
    RefusedTurn,
    Result,
    SearchHit,
    TurnsAdded,
)

__all__ = ["AsyncMemoryClient", "Deleted", "Fact", "FactKV", "FactPage", "Forgotten",
           "MemoryAPIError", "MemoryClient", "RefusedTurn", "Result", "SearchHit", "TurnsAdded"]
