"""The documentation's examples run as written against the real server: the OpenAI SDK snippet
of docs/examples.md, with only the server's address and key folder swapped for the suite's."""

import re
import uuid
from pathlib import Path

import pytest

from inferscale.client import MemoryClient

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples.md"


def _snippet(heading: str) -> str:
    """The first Python block after ``heading`` in docs/examples.md."""
    text = EXAMPLES.read_text(encoding="utf-8").split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)


def test_the_openai_sdk_snippet_chats_with_memory(served, capsys):
    owner = f"alice-{uuid.uuid4().hex[:6]}"
    memory = MemoryClient(served.url)
    horse = memory.add_fact(owner, "Alice's horse is called Biscuit.")
    memory.add_fact(owner, "Alice teaches chemistry in Porto.")
    code = (_snippet("## Chat with memory: the OpenAI SDK")
            .replace("http://127.0.0.1:8000", served.url)
            .replace("~/.inferscale", str(served.settings.data_dir))
            .replace('user="alice"', f'user="{owner}"'))
    assert code.count(served.url) == 1 and owner in code
    scope: dict = {}
    exec(compile(code, str(EXAMPLES), "exec"), scope)
    served_ids = [int(i) for i in scope["raw"].headers["x-inferscale-fact-ids"].split(",")]
    assert horse.id in served_ids and len(served_ids) == 2
    assert scope["raw"].headers["x-inferscale-mode"] == "inject"
    assert scope["answer"] and scope["answer"] in capsys.readouterr().out
    memory.forget(owner)


def _run(heading: str, served, owner: str) -> dict:
    code = (_snippet(heading).replace("http://127.0.0.1:8000", served.url)
            .replace("~/.inferscale", str(served.settings.data_dir))
            .replace('"alice"', f'"{owner}"'))
    assert served.url in code and owner in code
    scope: dict = {}
    exec(compile(code, str(EXAMPLES), "exec"), scope)
    return scope


def test_the_responses_and_agents_sdk_snippet_answers_with_memory(served, capsys):
    owner = f"alice-{uuid.uuid4().hex[:6]}"
    memory = MemoryClient(served.url)
    memory.add_fact(owner, "Alice's horse is called Biscuit.")
    memory.add_fact(owner, "Alice teaches chemistry in Porto.")
    scope = _run("## Responses with memory: the OpenAI SDK and the Agents SDK", served, owner)
    assert scope["response"].usage.input_tokens > 0 and scope["response"].output_text
    assert scope["result"].final_output in capsys.readouterr().out
    memory.forget(owner)


def test_the_langgraph_snippet_remembers_across_threads(served, capsys):
    owner = f"alice-{uuid.uuid4().hex[:6]}"
    scope = _run("## LangGraph's store", served, owner)
    assert "Miso" in scope["later"]["messages"][-1].content
    assert [f.text for f in MemoryClient(served.url).iter_facts(owner)] == [
        "Alice's cat is Miso."]
    MemoryClient(served.url).forget(owner)
