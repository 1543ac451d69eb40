"""The memory API as MCP tools (the official ``mcp`` SDK's ``MCPServer``): add, search, list,
get, edit, delete and history of an owner's memory, each one call of ``AsyncMemoryClient``.

The MCP server holds no memory and decides no access: every tool call is a memory API request
with the server's key, so a key limited to some owners, agents or runs (or read-only) limits
the tools the same way. A refusal, an unreachable memory server or an argument the schema
refuses is a tool error whose text says why; the MCP server keeps running.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, TypeVar

import httpx
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from inferscale_client.memory_client import AsyncMemoryClient, MemoryAPIError
from inferscale_client.results import Deleted, Fact, FactPage, SearchHit, TurnsAdded

T = TypeVar("T")
INSTRUCTIONS = (
    "Long-term memory of users, kept by an InferScale server. Search it before answering "
    "questions about a user, add what the user tells you that is worth remembering, and edit or "
    "delete a memory that is wrong. Memories belong to an owner (user id) and, optionally, an "
    "agent and a run (session).")
Owner = Annotated[str | None, Field(
    description="The memory owner (user id); a server started for one owner acts for that "
                "owner only")]
Agent = Annotated[str | None, Field(
    description="An agent: the one a memory is added for, or the only one read (None: any)")]
Run = Annotated[str | None, Field(
    description="A run (session): the one a memory is added in, or the only one read")]
FactId = Annotated[int, Field(description="A memory's id (from search or list)")]
READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)
CHANGE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False,
                         open_world_hint=False)


class Turn(BaseModel):
    """A conversation turn to remember; workers extract memories from it."""

    model_config = ConfigDict(extra="forbid")
    speaker: str = Field(description="Who said it, e.g. the user's name")
    text: str
    timestamp: datetime | None = Field(None, description="When it was said (default: now)")
    turn_id: str | None = Field(None, description="A unique id (default: a random one)")


class Added(BaseModel):
    """What ``add_memory`` did: the fact stored, or the turns accepted and refused."""

    fact: Fact | None = None
    turns: TurnsAdded | None = None


def build_server(connect: Callable[[], AsyncMemoryClient], owner: str | None = None
                 ) -> MCPServer:
    """The MCP server whose tools call the memory API through ``connect()``'s client (one per
    call); ``owner``: the one owner every call acts for (None: each call names its owner, any
    the key may act for)."""
    server = MCPServer("inferscale-memory", instructions=INSTRUCTIONS)

    def whose(user: str | None) -> str:
        if owner is None:
            if user is None:
                raise ToolError("name the memory owner (`user`): this server has no owner of "
                                "its own")
            return user
        if user not in (None, owner):
            raise ToolError(f"this server acts for {owner!r} only (started with --user)")
        return owner

    async def call(work: Callable[[AsyncMemoryClient], Awaitable[T]]) -> T:
        """One memory API call; its refusal or a transport failure as a tool error."""
        try:
            async with connect() as memory:
                return await work(memory)
        except MemoryAPIError as exc:
            raise ToolError(f"the memory server refused: {exc}") from None
        except httpx.HTTPError as exc:
            raise ToolError(f"the memory server could not be reached: {exc!r}") from None

    @server.tool(annotations=CHANGE)
    async def add_memory(text: Annotated[str | None, Field(
                             description="A fact to store as it is (operator keys)")] = None,
                         turns: Annotated[list[Turn] | None, Field(
                             description="Conversation turns to extract memories from")] = None,
                         conversation_id: str = "mcp", user: Owner = None, agent_id: Agent = None,
                         run_id: Run = None, pinned: Annotated[bool, Field(
                             description="The fact is in every prompt of the owner, first "
                                         "(a profile, a standing instruction)")] = False
                         ) -> Added:
        """Remember something: a fact as written (`text`, `pinned` or not), or conversation
        turns (`turns`) that the server's workers turn into memories shortly after. Give one of
        the two."""
        if (text is None) == (turns is None):
            raise ToolError("give either `text` (a fact) or `turns`, not both or neither")
        if pinned and turns is not None:
            raise ToolError("`pinned` applies to a fact given as `text`")
        who = whose(user)
        if text is not None:
            return Added(fact=await call(lambda m: m.add_fact(
                who, text, conversation_id, agent_id, run_id, pinned=pinned)))
        now = datetime.now(UTC)
        events = [{"conversation_id": conversation_id, "speaker": t.speaker, "text": t.text,
                   "turn_id": t.turn_id or uuid.uuid4().hex,
                   "timestamp": (t.timestamp or now).isoformat()} for t in turns or []]
        return Added(turns=await call(lambda m: m.add_turns(who, events, agent_id, run_id)))

    @server.tool(annotations=READ)
    async def search_memory(query: str, k: Annotated[int, Field(
                                description="How many memories")] = 5, user: Owner = None,
                            agent_id: Agent = None, run_id: Run = None) -> list[SearchHit]:
        """The owner's memories most relevant to `query`, best first, with their similarity:
        what the server would put in the prompt for that question."""
        who = whose(user)
        return await call(lambda m: m.search(who, query, k, agent_id, run_id))

    @server.tool(annotations=READ)
    async def list_memories(limit: int = 50, cursor: Annotated[str | None, Field(
                                description="`next_cursor` of the previous page")] = None,
                            user: Owner = None, agent_id: Agent = None, run_id: Run = None
                            ) -> FactPage:
        """One page of the owner's memories, oldest first, with where each came from."""
        who = whose(user)
        return await call(lambda m: m.list_facts(who, limit, cursor, agent_id, run_id))

    @server.tool(annotations=READ)
    async def get_memory(fact_id: FactId, user: Owner = None) -> Fact:
        """One memory, with its source turns and KV status."""
        who = whose(user)
        return await call(lambda m: m.get_fact(who, fact_id))

    @server.tool(annotations=CHANGE)
    async def edit_memory(fact_id: FactId, text: str, user: Owner = None) -> Fact:
        """Correct a memory: a new version (new id) replaces it, and the old one is never
        served again."""
        who = whose(user)
        return await call(lambda m: m.edit_fact(who, fact_id, text))

    @server.tool(annotations=CHANGE)
    async def delete_memory(fact_id: FactId, user: Owner = None) -> Deleted:
        """Delete one memory; it is never served again."""
        who = whose(user)
        return await call(lambda m: m.delete_fact(who, fact_id))

    @server.tool(annotations=READ)
    async def memory_history(fact_id: FactId, user: Owner = None) -> list[Fact]:
        """Every version of a memory, oldest first: the ones it replaced and replaced it."""
        who = whose(user)
        return await call(lambda m: m.history(who, fact_id))

    return server
