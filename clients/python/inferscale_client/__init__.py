"""The InferScale memory API's Python client, without the engine: ``httpx`` and ``pydantic``
only (the ``mcp`` extra adds the MCP server, ``mcp_main.py``)."""

from inferscale_client.memory_client import AsyncMemoryClient, MemoryAPIError, MemoryClient
from inferscale_client.results import (
    Deleted,
    Event,
    Fact,
    FactKV,
    FactPage,
    Forgotten,
    Imported,
    ProducedFact,
    RefusedTurn,
    Result,
    SearchHit,
    TurnsAdded,
)

__all__ = ["AsyncMemoryClient", "Deleted", "Event", "Fact", "FactKV", "FactPage", "Forgotten",
           "Imported", "MemoryAPIError", "MemoryClient", "ProducedFact", "RefusedTurn", "Result",
           "SearchHit", "TurnsAdded"]
