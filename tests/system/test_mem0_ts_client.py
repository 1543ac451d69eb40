"""Mem0's TypeScript client (npm ``mem0ai`` 3.3.1, pinned with its lock file in ``mem0_ts/``,
telemetry off) against the live server (the suite's shared ``served``): the everyday calls of an
app (``mem0_ts/everyday.mjs``: ping, add a string and messages, get, list with filters and
pages, search, update, history, users, delete, delete all) work unchanged; a wrong key is
refused at the client's first call and stores nothing."""

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import SUITE_KEY
from inferscale.client import MemoryClient

CLIENT = Path(__file__).parent / "mem0_ts"
NODE = shutil.which("node")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(NODE is None, reason="no Node.js here (Mem0's TS client)")]


def _run(url: str, key: str, user: str, tmp_path: Path) -> subprocess.CompletedProcess:
    if not (CLIENT / "node_modules" / "mem0ai").is_dir():
        pytest.fail("Mem0's TypeScript client is not installed: run .ci/install.sh "
                    "(npm ci --prefix tests/system/mem0_ts --legacy-peer-deps)")
    assert NODE is not None
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "MEM0_TELEMETRY": "false",
           "INFERSCALE_URL": url, "INFERSCALE_KEY": key, "MEM0_USER": user}
    return subprocess.run([NODE, "everyday.mjs"], cwd=CLIENT, env=env, capture_output=True,
                          text=True, timeout=300)


def _ids(page: dict) -> list[str]:
    return [m["id"] for m in page["results"]]


def test_the_typescript_client_does_what_an_app_does(served, tmp_path):
    user = f"mem0ts-{uuid.uuid4().hex[:6]}"
    run = _run(served.url, SUITE_KEY, user, tmp_path)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["ping"] == "ok"
    horse = got["add_text"]["results"][0]
    assert got["add_text"]["status"] == "SUCCEEDED" and horse["event"] == "ADD"
    porto, clara = (r["id"] for r in got["add_messages"]["results"])
    # the client turns snake_case keys into camelCase
    one = got["get"]
    assert (one["id"], one["memory"], one["userId"], one["agentId"], one["metadata"]) == (
        horse["id"], "My horse is called Biscuit.", user, "tutor", {"topic": "pets", "year": 2019})
    assert got["get_all"]["count"] == 3
    assert _ids(got["get_all"]) == [horse["id"], porto, clara]
    assert _ids(got["get_all_page"]) == [horse["id"], porto] and got["get_all_page"]["next"]
    assert _ids(got["get_all_agent"]) == [horse["id"]]
    hits = got["search"]["results"]  # the client sends output_format "v1.1"
    assert [h["id"] for h in hits][0] == clara and len(hits) == 2
    assert hits[0]["score"] >= hits[1]["score"]
    updated = got["update"]
    assert updated["memory"] == "My horse is called Pickles." and updated["id"] != horse["id"]
    assert [e["event"] for e in got["history"]] == ["ADD", "UPDATE"]
    assert got["history"][1]["oldMemory"] == "My horse is called Biscuit."
    assert {"id": user, "name": user, "type": "user", "totalMemories": 3} in (
        got["users"]["results"])
    assert clara not in _ids(got["after_delete"]) and got["after_delete"]["count"] == 2
    # delete_all with user and agent: the agent's memories of that user only
    assert _ids(got["after_delete_all"]) == [porto]


def test_a_wrong_key_is_refused_and_stores_nothing(served, tmp_path):
    user = f"mem0ts-{uuid.uuid4().hex[:6]}"
    run = _run(served.url, "not-a-key", user, tmp_path)
    assert run.returncode == 1  # the first call, the ping, failed (the script names it)
    assert any(line.startswith("ping: ") for line in run.stderr.splitlines())
    assert "add_text" not in json.loads(run.stdout.splitlines()[-1])
    assert MemoryClient(served.url, api_key=SUITE_KEY).list_facts(user).facts == []
