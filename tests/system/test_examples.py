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
