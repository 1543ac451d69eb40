"""The memory API's client as its own distribution (``clients/python``): its wheel requires only
``httpx`` and ``pydantic`` (the MCP server under the ``mcp`` extra), imports without the engine,
and reads the API's responses into typed results that still answer ``result["field"]``."""

import json
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest

from helpers import build_wheel
from inferscale_client import Fact, MemoryAPIError, MemoryClient, SearchHit

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "vllm", "sqlalchemy", "asyncpg", "aiokafka", "transformers", "inferscale")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The client's wheel, built from a copy of its folder (no build files left in the tree)."""
    root = tmp_path_factory.mktemp("client-wheel")
    source = shutil.copytree(ROOT / "clients" / "python", root / "src",
                             ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    return build_wheel(source, root / "dist")


def test_the_wheel_requires_only_http_pydantic_and_retries(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(meta).decode())
    requires = metadata.get_all("Requires-Dist") or []
    core = sorted(r.split(">=")[0] for r in requires if "extra ==" not in r)
    assert core == ["httpx", "pydantic", "tenacity"]
    assert sorted(r for r in requires if "extra ==" in r) == [
        'langgraph==1.2.22; extra == "langgraph"', 'mcp==2.3.0; extra == "mcp"']
    assert metadata["Name"] == "inferscale-client"
    assert {n.split("/")[0] for n in names} == {"inferscale_client",
                                                meta.split("/")[0]}


def test_the_installed_wheel_imports_without_the_engine(wheel, tmp_path):
    """Installed alone into a folder of its own, the client (and its MCP server's module) loads
    no engine, database or broker package."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                    "--disable-pip-version-check", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    probe = ("import sys, json, inferscale_client, inferscale_client.mcp_tools; "
             "print(json.dumps([inferscale_client.__file__, sorted(sys.modules)]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    origin, modules = json.loads(done.stdout)
    assert Path(origin).is_relative_to(target)
    assert sorted({m.split(".")[0] for m in modules} & set(HEAVY)) == []


FACT = {"id": 7, "user_id": "a/b", "text": "Ines keeps a horse.", "conversation_id": "c1",
        "turn_ids": ["t1"], "extractor": "turn", "agent_id": None, "run_id": None,
        "ts": "2025-05-01T12:00:00+00:00", "created_at": "2025-05-01T12:00:01+00:00",
        "deleted_at": None, "superseded_by": None,
        "kv": {"encoded": True, "tokens": 9, "bytes": 1024, "evicted": False,
               "tiers": ["durable"], "model_fingerprint": "ab12", "encoded_at": None},
        "metadata": {"topic": "pets"},
        "pinned_at": "2025-05-02T00:00:00+00:00"}  # a field this client does not know yet


def _client(handler) -> MemoryClient:
    return MemoryClient("http://memory.example", api_key="k",
                        transport=httpx.MockTransport(handler))


def test_results_are_typed_keep_new_fields_and_read_as_dicts_did():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/search"):
            return httpx.Response(200, json={"hits": [{"id": 7, "text": "x", "score": 0.5,
                                                       "kv_encoded": True}]})
        return httpx.Response(200, json=FACT)

    with _client(handler) as memory:
        fact = memory.get_fact("a/b", 7)
        hits = memory.search("a/b", "horse", k=1)
    assert isinstance(fact, Fact) and fact.kv.encoded
    assert fact.ts.year == 2025 and fact.metadata == {"topic": "pets"}
    assert fact.model_extra == {"pinned_at": "2025-05-02T00:00:00+00:00"}
    assert fact["kv"]["tokens"] == 9 and fact["pinned_at"] == FACT["pinned_at"]
    with pytest.raises(KeyError):
        fact["nope"]
    assert hits == [SearchHit(id=7, text="x", score=0.5, kv_encoded=True)]
    assert seen[0].url.raw_path == b"/v1/memory/users/a%2Fb/facts/7"  # the owner stays one part
    assert seen[0].headers["authorization"] == "Bearer k"
    assert json.loads(seen[1].content) == {"query": "horse", "k": 1}


def test_an_owner_id_is_one_path_segment_whatever_it_holds():
    paths = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.raw_path)
        return httpx.Response(200, json={"facts": [], "next_cursor": None})

    with _client(handler) as memory:
        for owner in ("..", ".", "../admin", "a?b#c"):
            assert memory.list_facts(owner, limit=1).facts == []
    assert [p.split(b"/")[4] for p in paths] == [b"%2E%2E", b"%2E", b"%2E%2E%2Fadmin",
                                                 b"a%3Fb%23c"]


@pytest.mark.parametrize(("response", "status", "message"), [
    (httpx.Response(404, json={"detail": "'a' has no live fact 7"}), 404,
     "'a' has no live fact 7"),
    (httpx.Response(400, json={"error": {"message": "bad k"}}), 400, "bad k"),
    (httpx.Response(502, text="upstream down"), 502, "upstream down"),
    (httpx.Response(500, json=["not", "an", "object"]), 500, '["not","an","object"]'),
])
def test_refusals_raise_with_the_servers_status_and_message(response, status, message):
    with _client(lambda _: response) as memory, pytest.raises(MemoryAPIError) as refused:
        memory.get_fact("a", 7)
    assert (refused.value.status, refused.value.message) == (status, message)


def test_the_mcp_server_will_not_serve_http_without_a_key(monkeypatch, capsys):
    """Over HTTP, MCP clients must present the server's key: with none to check, no server."""
    from inferscale_client.mcp_main import main

    monkeypatch.delenv("INFERSCALE_API_KEY", raising=False)
    assert main(["--http", "--server", "https://memory.example"]) == 2  # no local key sent there
    assert "--http needs a key" in capsys.readouterr().err


@pytest.mark.parametrize(("status", "method", "headers", "expected"), [
    (429, "POST", {"retry-after": "2"}, [2.0, 2.0]),  # refused before anything was done
    (429, "POST", {"retry-after": "120"}, [10.0, 10.0]),  # never longer than max_wait_s
    (429, "GET", {}, [0.5, 1.0]),  # no Retry-After: 0.5 s doubling
    (429, "GET", {"retry-after": "soon"}, [0.5, 1.0]),
    (503, "GET", {"retry-after": "1"}, [1.0, 1.0]),
    (503, "DELETE", {}, [0.5, 1.0]),
    (503, "POST", {"retry-after": "1"}, []),  # an add may have landed: not repeated
    (400, "GET", {"retry-after": "1"}, []),
    (500, "GET", {}, []),
])
def test_which_refusals_are_sent_again_and_after_how_long(monkeypatch, status, method, headers,
                                                          expected):
    """Two retries allowed: each refusal is sent again (after how long) or answered at once,
    and once the retries are spent the server's last refusal is what the caller gets."""
    slept: list[float] = []
    monkeypatch.setattr("inferscale_client.memory_client.time.sleep", slept.append)
    sent: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        sent.append(request.method)
        return httpx.Response(status, headers=headers, json={"detail": "no"})

    memory = MemoryClient("http://memory.test", api_key="k", retries=2, max_wait_s=10.0,
                          transport=httpx.MockTransport(refuse))
    call = {"GET": lambda: memory.list_facts("alice"),
            "DELETE": lambda: memory.delete_fact("alice", 1),
            "POST": lambda: memory.add_fact("alice", "A fact.")}[method]
    with pytest.raises(MemoryAPIError) as refused:
        call()
    assert refused.value.status == status
    assert slept == expected and sent == [method] * (len(expected) + 1)


def test_the_client_waits_out_a_rate_limit_and_then_answers(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("inferscale_client.memory_client.time.sleep", slept.append)
    answers = iter([httpx.Response(429, headers={"retry-after": "1"},
                                   json={"detail": "rate limit 5/second exceeded"}),
                    httpx.Response(200, json={"facts": [], "next_cursor": None})])
    memory = MemoryClient("http://memory.test", api_key="k",
                          transport=httpx.MockTransport(lambda _: next(answers)))
    assert memory.list_facts("alice").facts == [] and slept == [1.0]
    refused = MemoryClient("http://memory.test", api_key="k", retries=0,
                           transport=httpx.MockTransport(lambda _: httpx.Response(
                               429, headers={"retry-after": "1"}, json={"detail": "slow down"})))
    with pytest.raises(MemoryAPIError) as error:
        refused.list_facts("alice")
    assert error.value.status == 429


async def test_the_async_client_waits_out_a_rate_limit_too(monkeypatch):
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr("inferscale_client.memory_client.asyncio.sleep", sleep)
    from inferscale_client import AsyncMemoryClient

    answers = iter([httpx.Response(503, json={"detail": "memory unavailable"}),
                    httpx.Response(200, json={"facts": [], "next_cursor": None})])
    memory = AsyncMemoryClient("http://memory.test", api_key="k",
                               transport=httpx.MockTransport(lambda _: next(answers)))
    assert (await memory.list_facts("alice")).facts == [] and slept == [0.5]
