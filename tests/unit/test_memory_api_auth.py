"""The memory API's routes in-process (FastAPI's test client, a stand-in server with no
database): keys that may not act for the owner are refused before any work, ordinary keys add
facts in the scopes they may write, cursors this server did not make are refused."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from inferscale.core.settings import Settings
from inferscale.serving.access import Access
from inferscale.serving.memory_api import _after, _cursor, serve_memory


class _NoDatabase:
    """A server whose memory runtime must never be reached: refusals come first."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.access = Access(settings)
        self.reached = 0

    async def runtime(self):
        self.reached += 1
        raise RuntimeError("no database here")

    async def drop_blobs(self, user_id, locations):
        self.reached += 1
        return 0

    async def forget(self, user_id):
        self.reached += 1
        return {}


EVENT = "0123456789abcdef0123456789abcdef"
NOW = "2026-12-06T00:00:00+00:00"
IMPORT = {"header": {"user_id": "alice", "origin": EVENT, "exported_at": NOW},
          "facts": [{"id": 1, "text": "x", "conversation_id": "c", "extractor": "turn",
                     "ts": NOW, "created_at": NOW}]}


@pytest.fixture
def client_and_service():
    service = _NoDatabase(Settings(api_keys={
        "alice-key": ["alice"], "bob-key": ["bob"], "admin": ["*"],
        "reader": {"owners": ["alice"], "read_only": True},
        "planner": {"owners": ["alice"], "agents": ["planner"]}}))
    app = FastAPI()
    serve_memory(app, service)
    return TestClient(app, raise_server_exceptions=False), service


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/memory/users/alice/facts", None),
    ("GET", "/v1/memory/users/alice/facts/1", None),
    ("GET", "/v1/memory/users/alice/facts/1/history", None),
    ("PATCH", "/v1/memory/users/alice/facts/1", {"text": "x"}),
    ("DELETE", "/v1/memory/users/alice/facts/1", None),
    ("POST", "/v1/memory/users/alice/search", {"query": "x"}),
    ("POST", "/v1/memory/users/alice/facts", {"text": "x"}),
    ("POST", "/v1/memory/users/alice/turns", {"turns": [{}]}),
    ("GET", f"/v1/memory/users/alice/events/{EVENT}", None),
    ("GET", "/v1/memory/users/alice/export", None),
    ("POST", "/v1/memory/users/alice/import", IMPORT),
    ("DELETE", "/v1/memory/users/alice", None),
])
def test_keys_that_may_not_act_for_the_owner_are_refused(client_and_service, method, path,
                                                         body):
    client, service = client_and_service
    for headers, owner, status in (({}, "alice", 401),
                                   ({"authorization": "Bearer nope"}, "alice", 401),
                                   ({"authorization": "Bearer alice-key"}, "bob", 403)):
        response = client.request(method, path.replace("/alice", f"/{owner}"), json=body,
                                  headers=headers)
        assert response.status_code == status, (method, path, headers, response.text)
    assert service.reached == 0


ROUTES = [("GET", "/v1/memory/users/alice/facts", None, False),
          ("GET", "/v1/memory/users/alice/facts/1", None, False),
          ("GET", "/v1/memory/users/alice/facts/1/history", None, False),
          ("POST", "/v1/memory/users/alice/search", {"query": "x"}, False),
          ("GET", f"/v1/memory/users/alice/events/{EVENT}?wait=0.5", None, False),
          ("POST", "/v1/memory/users/alice/facts", {"text": "x"}, True),
          ("GET", "/v1/memory/users/alice/export", None, False),
          ("POST", "/v1/memory/users/alice/import", IMPORT, True),
          ("PATCH", "/v1/memory/users/alice/facts/1", {"text": "x"}, True),
          ("DELETE", "/v1/memory/users/alice/facts/1", None, True),
          ("POST", "/v1/memory/users/alice/turns", {"turns": [{}]}, True),
          ("DELETE", "/v1/memory/users/alice", None, True),
          ("POST", "/v1/memory/forget", {"user": "alice"}, True)]


@pytest.mark.parametrize("method, path, body, writes", ROUTES)
def test_the_right_key_gets_through(client_and_service, method, path, body, writes):
    """Past the admission: the stand-in server is reached (its missing database answers 500,
    where a refusal would have been a 401 / 403), or the turns route answers which turns it
    accepted (202)."""
    client, service = client_and_service
    for key in ("alice-key", "admin") + (() if writes else ("reader",)):
        reached = service.reached
        response = client.request(method, path, json=body,
                                  headers={"authorization": f"Bearer {key}"})
        assert response.status_code not in (401, 403), (key, response.text)
        assert service.reached > reached or response.status_code == 202, (key, method, path)


@pytest.mark.parametrize("method, path, body, writes", [r for r in ROUTES if r[3]])
def test_read_only_keys_change_nothing(client_and_service, method, path, body, writes):
    client, service = client_and_service
    response = client.request(method, path, json=body, headers={"authorization": "Bearer reader"})
    assert response.status_code == 403 and service.reached == 0


def test_scoped_keys_name_their_scope_and_cannot_forget(client_and_service):
    client, service = client_and_service
    planner = {"authorization": "Bearer planner"}
    for params in ({}, {"agent_id": "coder"}):  # no widening, no other agent
        listed = client.get("/v1/memory/users/alice/facts", params=params, headers=planner)
        assert listed.status_code == 403
    searched = client.post("/v1/memory/users/alice/search", json={"query": "x"}, headers=planner)
    assert searched.status_code == 403
    assert client.delete("/v1/memory/users/alice", headers=planner).status_code == 403
    assert service.reached == 0
    ok = client.get("/v1/memory/users/alice/facts", params={"agent_id": "planner"},
                    headers=planner)
    assert ok.status_code not in (401, 403) and service.reached == 1


def test_a_scoped_key_adds_facts_only_in_its_scope(client_and_service):
    client, service = client_and_service
    planner = {"authorization": "Bearer planner"}
    for body in ({"text": "x"}, {"text": "x", "agent_id": "coder"}):
        response = client.post("/v1/memory/users/alice/facts", json=body, headers=planner)
        assert response.status_code == 403 and service.reached == 0
    response = client.post("/v1/memory/users/alice/facts",
                           json={"text": "x", "agent_id": "planner"}, headers=planner)
    assert response.status_code not in (401, 403) and service.reached == 1


def test_a_scoped_key_imports_only_records_of_its_scope(client_and_service):
    client, service = client_and_service
    planner = {"authorization": "Bearer planner"}
    theirs = {**IMPORT, "facts": [{**IMPORT["facts"][0], "agent_id": "coder"}]}
    response = client.post("/v1/memory/users/alice/import", json=theirs, headers=planner)
    assert response.status_code == 403 and service.reached == 0
    assert client.get("/v1/memory/users/alice/export", headers=planner).status_code == 403
    mine = {**IMPORT, "facts": [{**IMPORT["facts"][0], "agent_id": "planner"}]}
    response = client.post("/v1/memory/users/alice/import", json=mine, headers=planner)
    assert response.status_code not in (401, 403) and service.reached == 1


@pytest.mark.parametrize("body", [
    {}, {"header": IMPORT["header"]}, {**IMPORT, "facts": []},
    {**IMPORT, "facts": IMPORT["facts"] * 1001},
    {**IMPORT, "header": {**IMPORT["header"], "origin": "nope"}},
    {**IMPORT, "facts": [{**IMPORT["facts"][0], "text": "a\u0000b"}]},
    {**IMPORT, "facts": [{**IMPORT["facts"][0], "superseded_by": 2}]},
    {**IMPORT, "extra": 1}, [IMPORT]])
def test_hostile_imports_are_refused_before_any_work(client_and_service, body):
    client, service = client_and_service
    response = client.post("/v1/memory/users/alice/import", json=body,
                           headers={"authorization": "Bearer alice-key"})
    assert 400 <= response.status_code < 500 and response.status_code not in (401, 403), (
        response.text)
    assert service.reached == 0


@pytest.mark.parametrize("method, path, body", [
    ("PATCH", "facts/1", {"expires_at": "2026-01-01T00:00:00"}),  # no time zone
    ("PATCH", "facts/1", {"expires_at": "soon"}),
    ("PATCH", "facts/1", {}),  # nothing to change
    ("PATCH", "facts/1", {"text": None}),
    ("POST", "facts", {"text": "x", "expires_at": 1e300}),
    ("POST", "facts", {"text": "x", "expires_at": "2026-13-01T00:00:00Z"}),
])
def test_hostile_expiries_are_refused_before_any_work(client_and_service, method, path, body):
    client, service = client_and_service
    response = client.request(method, f"/v1/memory/users/alice/{path}", json=body,
                              headers={"authorization": "Bearer alice-key"})
    assert 400 <= response.status_code < 500 and response.status_code not in (401, 403), (
        body, response.text)
    assert service.reached == 0


def test_an_edit_may_only_clear_the_expiry(client_and_service):
    client, service = client_and_service
    response = client.patch("/v1/memory/users/alice/facts/1", json={"expires_at": None},
                            headers={"authorization": "Bearer alice-key"})
    assert response.status_code not in (400, 401, 403, 422) and service.reached == 1


@pytest.mark.parametrize("path", [
    "events/not-an-event", f"events/{EVENT.upper()}", f"events/{EVENT}0", f"events/{EVENT[:-1]}",
    f"events/{EVENT}?wait=-1", f"events/{EVENT}?wait=61", f"events/{EVENT}?wait=nan",
    f"events/{EVENT}?wait=inf", f"events/{EVENT}?wait=soon", "events/%00"])
def test_hostile_event_reads_are_refused_before_any_work(client_and_service, path):
    client, service = client_and_service
    response = client.get(f"/v1/memory/users/alice/{path}",
                          headers={"authorization": "Bearer alice-key"})
    assert 400 <= response.status_code < 500 and response.status_code not in (401, 403), (
        path, response.text)
    assert service.reached == 0


def test_cursors_round_trip_and_foreign_ones_are_refused():
    from fastapi import HTTPException

    assert _after(None) == 0
    assert _after(_cursor(12345)) == 12345
    for bad in ("", "%%%", "YWZ0ZXI6LTE=", "b3RoZXI6MQ==", "YWZ0ZXI6eA==", "x" * 199):
        with pytest.raises(HTTPException) as refused:
            _after(bad)
        assert refused.value.status_code == 400


MEM0_ROUTES = [("GET", "/v1/ping/", None, False, False),
               ("POST", "/v3/memories/add/", {"messages": [{"role": "user", "content": "x"}],
                                              "user_id": "alice", "infer": False}, True, True),
               ("POST", "/v3/memories/", {"filters": {"user_id": "alice"}}, False, True),
               ("POST", "/v3/memories/search/", {"query": "x", "filters": {"user_id": "alice"}},
                False, True),
               ("DELETE", "/v1/memories/?user_id=alice", None, True, True),
               ("DELETE", "/v2/entities/user/alice/", None, True, True)]


@pytest.mark.parametrize("method, path, body, writes, owned", MEM0_ROUTES)
def test_mem0_routes_admit_as_the_native_ones(client_and_service, method, path, body, writes,
                                              owned):
    """No or an unknown key: 401 on every Mem0 route; another owner: 403; a read-only key
    writes nothing; all before any work."""
    client, service = client_and_service
    refusals = [({}, 401), ({"authorization": "Token nope"}, 401)]
    if owned:
        refusals.append(({"authorization": "Bearer bob-key"}, 403))
    if writes:
        refusals.append(({"authorization": "Bearer reader"}, 403))
    for headers, status in refusals:
        response = client.request(method, path, json=body, headers=headers)
        assert response.status_code == status, (path, headers, response.text)
    assert service.reached == 0


def test_mem0_token_scheme_is_bearer_for_the_same_keys_on_mem0_paths_only():
    from inferscale.serving.mem0_api import token_as_bearer

    def auth(path: str, value: bytes) -> bytes:
        scope = token_as_bearer({"type": "http", "path": path,
                                 "headers": [(b"authorization", value), (b"host", b"x")]})
        return dict(scope["headers"])[b"authorization"]

    assert auth("/v3/memories/add/", b"Token k1") == b"Bearer k1"
    assert auth("/v1/memories/12/", b"token k1") == b"Bearer k1"
    assert auth("/v1/memory/users/alice/facts", b"Token k1") == b"Token k1"  # native: no
    assert auth("/v1/chat/completions", b"Token k1") == b"Token k1"
    assert auth("/v3/memories/", b"Basic k1") == b"Basic k1"


def test_a_mem0_filter_must_name_the_owner_and_a_scoped_key_its_scope(client_and_service):
    client, service = client_and_service
    admin = {"authorization": "Bearer admin"}
    planner = {"authorization": "Bearer planner"}
    unnamed = client.post("/v3/memories/", json={"filters": {"agent_id": "a"}}, headers=admin)
    assert unnamed.status_code == 400 and "user_id" in unnamed.text
    wide = client.post("/v3/memories/", json={"filters": {"user_id": "alice"}}, headers=planner)
    either = client.post("/v3/memories/", json={"filters": {"user_id": "alice", "OR": [
        {"agent_id": "planner"}, {"agent_id": "coder"}]}}, headers=planner)
    assert wide.status_code == either.status_code == 403 and service.reached == 0
    named = client.post("/v3/memories/", json={"filters": {"AND": [
        {"user_id": "alice"}, {"agent_id": "planner"}]}}, headers=planner)
    assert named.status_code not in (401, 403) and service.reached == 1
