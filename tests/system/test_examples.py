"""Every road in (``docs/roads/*.md``) runs as written against the real server: each page's
first code block, with only the server's address, the key's folder, the owner's name and the
``inferscale`` command swapped for the suite's; and the index lists every page."""

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import mcp.client.stdio  # noqa: F401 - before any capsys: its default errlog is sys.stderr then
import pytest

from helpers import metric
from inferscale.client import MemoryClient

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[2] / "docs"
ROADS = DOCS / "roads"
MEM0_TS = Path(__file__).parent / "mem0_ts"
MEMORY_REQUESTS = "inferscale_memory_requests_total"


def _code(page: str, language: str = "python") -> str:
    """The first ``language`` block of the page."""
    text = (ROADS / page).read_text(encoding="utf-8")
    return re.search(rf"```{language}\n(.*?)```", text, re.DOTALL).group(1)


def _as_suite(code: str, served, owner: str) -> str:
    code = (code.replace("http://127.0.0.1:8000", served.url)
            .replace("~/.inferscale", str(served.settings.data_dir))
            .replace("${homedir()}/.inferscale", str(served.settings.data_dir))
            .replace('"alice"', f'"{owner}"')
            .replace('command="inferscale"',
                     f'command="{Path(sys.executable).parent / "inferscale"}"'))
    assert served.url in code and owner in code and str(served.settings.data_dir) in code
    return code


def _run(page: str, served, owner: str) -> dict:
    scope: dict = {}
    exec(compile(_as_suite(_code(page), served, owner), str(ROADS / page), "exec"), scope)
    return scope


@pytest.fixture
def alice(served):
    """An owner of her own with two facts: her horse and where she teaches (the horse's id)."""
    owner = f"alice-{uuid.uuid4().hex[:6]}"
    memory = MemoryClient(served.url)
    horse = memory.add_fact(owner, "Alice's horse is called Biscuit.")
    memory.add_fact(owner, "Alice teaches chemistry in Porto.")
    yield owner, horse.id
    memory.forget(owner)


def test_the_index_lists_every_road():
    index = (DOCS / "examples.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\(roads/([\w-]+\.md)\)", index))
    assert linked == {page.name for page in ROADS.glob("*.md")} and len(linked) >= 7


def test_chat_answers_with_memory(served, alice, capsys):
    owner, horse = alice
    scope = _run("chat.md", served, owner)
    served_ids = [int(i) for i in scope["raw"].headers["x-inferscale-fact-ids"].split(",")]
    assert horse in served_ids and len(served_ids) == 2
    assert scope["raw"].headers["x-inferscale-mode"] == "inject"
    assert scope["answer"] and scope["answer"] in capsys.readouterr().out


def test_responses_answer_with_memory(served, alice, capsys):
    owner, _ = alice
    before = metric(served, MEMORY_REQUESTS)
    scope = _run("responses.md", served, owner)
    assert scope["response"].usage.input_tokens > 0 and scope["response"].output_text
    assert scope["response"].output_text in capsys.readouterr().out
    assert metric(served, MEMORY_REQUESTS) == before + 1


def test_an_agent_answers_with_memory_and_records_the_exchange(served, alice, capsys):
    owner, _ = alice
    before = metric(served, MEMORY_REQUESTS)
    scope = _run("agents-sdk.md", served, owner)
    assert scope["result"].final_output in capsys.readouterr().out
    assert metric(served, MEMORY_REQUESTS) >= before + 1


def test_langgraph_remembers_across_threads(served):
    owner = f"alice-{uuid.uuid4().hex[:6]}"
    scope = _run("langgraph.md", served, owner)
    assert "Miso" in scope["later"]["messages"][-1].content
    memory = MemoryClient(served.url)
    assert [f.text for f in memory.iter_facts(owner)] == ["Alice's cat is Miso."]
    memory.forget(owner)


def test_mem0s_python_client_adds_and_finds(served, capsys):
    owner = f"alice-{uuid.uuid4().hex[:6]}"
    scope = _run("mem0-python.md", served, owner)
    assert scope["found"]["results"][0]["memory"] == "My horse is called Biscuit."
    assert "Biscuit" in capsys.readouterr().out
    memory = MemoryClient(served.url)
    assert [f.text for f in memory.iter_facts(owner)] == ["My horse is called Biscuit."]
    memory.forget(owner)


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js here (Mem0's TS client)")
def test_mem0s_typescript_client_adds_and_finds(served, tmp_path):
    owner = f"alice-{uuid.uuid4().hex[:6]}"
    code = _as_suite(_code("mem0-typescript.md", "js"), served, owner)
    run = subprocess.run(["node", "--input-type=module"], input=code, cwd=MEM0_TS, text=True,
                         capture_output=True, timeout=300,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                              "MEM0_TELEMETRY": "false"})
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout.splitlines()[-1])
    assert [hit["memory"] for hit in found["results"]] == ["My horse is called Biscuit."]
    MemoryClient(served.url).forget(owner)


def test_mcp_tools_add_and_find(served):
    owner = f"alice-{uuid.uuid4().hex[:6]}"
    scope = _run("mcp.md", served, owner)
    hits = scope["found"]["result"]
    assert hits and hits[0]["text"] == "Alice's horse is called Biscuit."
    assert [f.text for f in MemoryClient(served.url).iter_facts(owner)] == [
        "Alice's horse is called Biscuit."]
    MemoryClient(served.url).forget(owner)
