"""The MCP server (``inferscale mcp``) against the real server, driven by the official ``mcp``
SDK's own client over both transports: stdio (a subprocess, as Claude Code or Cursor start it)
and streamable HTTP (on loopback, key required, DNS rebinding refused). Every tool does what its
memory API route does, and hostile tool arguments are clear tool errors after which the server
still answers."""

import contextlib
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from conftest import SUITE_KEY
from inferscale.core import endpoints
from inferscale.devstack.infra import _free_port

pytestmark = pytest.mark.slow
REFUSED = "the memory server refused: 4"  # a 4xx, with the server's message
TOOLS = {"add_memory", "search_memory", "list_memories", "get_memory", "edit_memory",
         "delete_memory", "memory_history"}


def _mcp_command(served, *args: str) -> list[str]:
    return [sys.executable, "-m", "inferscale.cli", "mcp", "--server", served.url, *args]


@contextlib.asynccontextmanager
async def over_stdio(served, *args: str):
    """A session with ``inferscale mcp`` started as an MCP client starts it (the suite's key in
    ``INFERSCALE_API_KEY``)."""
    command = _mcp_command(served, *args)
    params = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@pytest.fixture(scope="module")
def mcp_http(served, tmp_path_factory):
    """``inferscale mcp --http`` on a free loopback port: its port."""
    port = _free_port()
    log = tmp_path_factory.mktemp("mcp") / "mcp-http.log"
    with log.open("wb") as out:
        process = subprocess.Popen(_mcp_command(served, "--http", "--port", str(port)),
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not endpoints.port_open(port):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(30)


@contextlib.asynccontextmanager
async def over_http(port: int, key: str = SUITE_KEY):
    http = create_mcp_http_client(headers={"authorization": f"Bearer {key}"})
    async with http, streamable_http_client(f"http://127.0.0.1:{port}/mcp",
                                            http_client=http) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def _ok(session, tool: str, **arguments):
    """A tool's structured result (a list tool's list), asserting it succeeded."""
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result.content
    content = result.structured_content
    return content["result"] if set(content) == {"result"} else content


async def _refused(session, tool: str, arguments: dict) -> str:
    """A tool error's text (the call must fail as a tool error, not crash the session)."""
    result = await session.call_tool(tool, arguments)
    assert result.is_error, (tool, arguments, result.structured_content)
    return " ".join(block.text for block in result.content)


async def test_every_tool_over_stdio(served):
    owner = f"mcp-{uuid.uuid4().hex[:6]}"
    async with over_stdio(served, "--user", owner) as mcp:
        assert {tool.name for tool in (await mcp.list_tools()).tools} == TOOLS
        added = await _ok(mcp, "add_memory", text="Ines's horse is called Biscuit.")
        fact = added["fact"]
        assert fact["user_id"] == owner and fact["extractor"] == "operator"
        await _ok(mcp, "add_memory", text="Ines teaches chemistry in Porto.", agent_id="tutor")
        assert not fact["pinned"]
        profile = (await _ok(mcp, "add_memory", text="Ines prefers short answers.",
                             pinned=True))["fact"]
        assert profile["pinned"] and (await _ok(mcp, "get_memory", fact_id=profile["id"]))[
            "pinned"]
        await _ok(mcp, "delete_memory", fact_id=profile["id"])
        hits = await _ok(mcp, "search_memory", query="What is Ines's horse called?", k=1)
        assert [h["id"] for h in hits] == [fact["id"]]
        page = await _ok(mcp, "list_memories", limit=1)
        assert [f["id"] for f in page["facts"]] == [fact["id"]] and page["next_cursor"]
        rest = await _ok(mcp, "list_memories", cursor=page["next_cursor"])
        assert [f["agent_id"] for f in rest["facts"]] == ["tutor"]
        assert (await _ok(mcp, "list_memories", agent_id="tutor"))["facts"] == rest["facts"]
        assert (await _ok(mcp, "get_memory", fact_id=fact["id"]))["text"] == fact["text"]
        edited = await _ok(mcp, "edit_memory", fact_id=fact["id"],
                           text="Ines's horse is called Pickles.")
        assert edited["replaces"] == fact["id"]
        history = await _ok(mcp, "memory_history", fact_id=edited["id"])
        assert [v["id"] for v in history] == [fact["id"], edited["id"]]
        assert await _ok(mcp, "delete_memory", fact_id=edited["id"]) == {
            "id": edited["id"], "deleted": True}
        turns = await _ok(mcp, "add_memory", user=owner, turns=[
            {"speaker": "Ines", "text": "I bought a red bicycle."},
            {"speaker": "", "text": "no speaker"}])
        assert len(turns["turns"]["accepted"]) == 1
        assert [r["index"] for r in turns["turns"]["refused"]] == [1]
        other = f"mcp-{uuid.uuid4().hex[:6]}"  # started for one owner: it acts for no other
        for tool, arguments in (("list_memories", {}), ("search_memory", {"query": "horse"}),
                                ("add_memory", {"text": "Planted."}),
                                ("delete_memory", {"fact_id": fact["id"]})):
            await _refused(mcp, tool, {**arguments, "user": other})
    # The owner's memory is what the memory API says it is.
    from inferscale.client import MemoryClient

    left = MemoryClient(served.url).list_facts(owner).facts
    assert [f.text for f in left] == ["Ines teaches chemistry in Porto."]
    assert MemoryClient(served.url).list_facts(other).facts == []  # nothing planted there


async def test_hostile_tool_arguments_are_clear_errors_and_the_server_survives(served):
    owner = f"mcp-{uuid.uuid4().hex[:6]}"
    theirs = f"mcp-{uuid.uuid4().hex[:6]}"
    async with over_stdio(served) as mcp:  # no default owner
        their_fact = (await _ok(mcp, "add_memory", user=theirs, text="Gus keeps bees."))["fact"]
        cases = [
            ("search_memory", {"query": "horse"}, "owner"),  # no owner, no default
            ("add_memory", {"user": owner}, "either"),
            ("add_memory", {"user": owner, "text": "x", "turns": []}, "either"),
            ("get_memory", {"user": owner, "fact_id": their_fact["id"]}, "404"),
            ("edit_memory", {"user": owner, "fact_id": their_fact["id"], "text": "mine"}, "404"),
            ("delete_memory", {"user": owner, "fact_id": their_fact["id"]}, "404"),
            ("memory_history", {"user": owner, "fact_id": their_fact["id"]}, "404"),
            ("get_memory", {"user": owner, "fact_id": "abc"}, "fact_id"),
            ("get_memory", {"user": owner, "fact_id": 2**70}, REFUSED),
            ("get_memory", {"user": owner}, "fact_id"),
            ("search_memory", {"user": owner, "query": "x", "k": 10**6}, REFUSED),
            ("search_memory", {"user": owner, "query": ""}, REFUSED),
            ("list_memories", {"user": owner, "limit": 0}, REFUSED),
            ("list_memories", {"user": owner, "cursor": "not a cursor"}, "cursor"),
            ("list_memories", {"user": "a\0b"}, REFUSED),
            ("list_memories", {"user": "u" * 300}, REFUSED),
            ("list_memories", {"user": owner, "agent_id": "a\nb"}, REFUSED),
            ("edit_memory", {"user": owner, "fact_id": 1, "text": "x" * 5000}, REFUSED),
            ("add_memory", {"user": owner, "text": ""}, REFUSED),
            ("add_memory", {"user": owner, "turns": [{"speaker": "I", "txt": "typo"}]}, "text"),
            ("no_such_tool", {}, "no_such_tool"),
        ]
        for tool, arguments, says in cases:
            message = await _refused(mcp, tool, arguments)
            assert says in message, (tool, arguments, message)
        assert (await _ok(mcp, "get_memory", user=theirs, fact_id=their_fact["id"]))[
            "text"] == "Gus keeps bees."  # untouched, and the server still answers
        assert (await _ok(mcp, "list_memories", user=owner))["facts"] == []
    async with over_stdio(served, "--api-key", "not-the-key") as mcp:  # the key decides
        assert "401" in await _refused(mcp, "list_memories", {"user": theirs})
    async with over_stdio(served, "--server", "http://127.0.0.1:9") as mcp:  # none there
        assert "could not be reached" in await _refused(mcp, "list_memories", {"user": theirs})


async def test_streamable_http_needs_the_key_and_refuses_rebinding(served, mcp_http):
    owner = f"mcp-{uuid.uuid4().hex[:6]}"
    async with over_http(mcp_http) as mcp:
        assert {tool.name for tool in (await mcp.list_tools()).tools} == TOOLS
        fact = (await _ok(mcp, "add_memory", user=owner, text="Ines lives in Porto."))["fact"]
        hits = await _ok(mcp, "search_memory", user=owner, query="Where does Ines live?")
        assert [h["id"] for h in hits] == [fact["id"]]
    url = f"http://127.0.0.1:{mcp_http}/mcp"
    hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                        "clientInfo": {"name": "probe", "version": "0"}}}
    accept = {"accept": "application/json, text/event-stream"}
    key = {"authorization": f"Bearer {SUITE_KEY}"}
    refused = {
        "no key": (httpx.post(url, json=hello, headers=accept), 401),
        "wrong key": (httpx.post(url, json=hello, headers={
            **accept, "authorization": "Bearer nope"}), 401),
        "other scheme": (httpx.post(url, json=hello, headers={
            **accept, "authorization": f"Basic {SUITE_KEY}"}), 401),
        "rebound host": (httpx.post(url, json=hello, headers={
            **accept, **key, "host": f"attacker.example:{mcp_http}"}), 421),
        "foreign origin": (httpx.post(url, json=hello, headers={
            **accept, **key, "origin": "http://attacker.example"}), 403),
    }
    assert {name: r.status_code for name, (r, _) in refused.items()} == {
        name: status for name, (_, status) in refused.items()}
    assert all("x-inferscale" not in str(r.headers).lower() for r, _ in refused.values())
    accepted = httpx.post(url, json=hello, headers={**accept, **key})
    assert accepted.status_code == 200, accepted.text
