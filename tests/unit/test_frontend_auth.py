"""Who may read a memory: the front end's key check runs before any retrieval (pure logic).

Every server here names a model folder that does not exist, so a request that got past the
checks into the memory machinery would answer 503 ("memory unavailable"): a 401 or 403 shows the
refusal came first."""

import json
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from inferscale.core.settings import Settings
from inferscale.serving.frontend import MemoryFrontend


def _settings(**fields) -> Settings:
    return Settings(model_path=Path("/nonexistent-model"), **fields)


async def _downstream(scope, receive, send):
    message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": message["body"]})


# vLLM's app as the route policy reads it: a few of its routes, by name
VLLM_ROUTES = Starlette(routes=[
    Route(path, _downstream, methods=["POST"]) for path in (
        "/v1/chat/completions", "/v1/completions", "/scale_elastic_ep", "/sleep",
        "/collective_rpc", "/v1/load_lora_adapter", "/pause", "/invocations", "/adapters",
        "/update_weights", "/v1/future_route_of_vllm")])


async def _call(frontend, body: dict, headers: dict[str, str],
                path: str = "/v1/chat/completions", root_path: str = "") -> tuple[int, dict]:
    sent = []
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": root_path + path, "root_path": root_path,
             "app": VLLM_ROUTES,
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    await frontend(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


@pytest.fixture
def frontend():
    return MemoryFrontend(_downstream, _settings(api_keys={"key-a": ["alice"],
                                                           "key-admin": ["*"]}))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("headers", "owner", "status"), [
    ({}, "alice", 401),
    ({"authorization": "Bearer nope"}, "alice", 401),
    ({"authorization": "Bearer key-a"}, "bob", 403),
    ({"authorization": "Bearer key-a", "x-inferscale-user": "bob"}, "alice", 403),
])
async def test_keys_that_may_not_act_for_owner_are_refused(frontend, headers, owner, status):
    code, body = await _call(frontend, {**CHAT, "user": owner}, headers)
    assert code == status
    assert body["error"]["message"]


async def test_requests_without_owner_pass_untouched(frontend):
    code, body = await _call(frontend, CHAT, {})
    assert code == 200 and body == CHAT


@pytest.mark.parametrize(("settings", "status"), [
    (_settings(server_host="0.0.0.0"), 401),  # no keys, reachable from outside: refused
    (_settings(server_host="127.0.0.1"), 401),  # nor on loopback: never implied by the address
    (_settings(server_host="0.0.0.0", allow_anonymous=True), 200),  # an explicit choice
])
async def test_anonymous_memory_is_an_explicit_choice(settings, status):
    app = MemoryFrontend(_downstream, settings)
    code, body = await _call(app, {**CHAT, "user": "alice", "inferscale": {"mode": "none"}}, {})
    if status == 401:
        assert code == 401 and body["error"]["type"] == "authentication_error"
    else:
        assert code == 503  # got past the key check into the memory machinery (no model)


async def test_vllm_api_key_is_checked_before_any_memory_work():
    app = MemoryFrontend(_downstream, _settings(allow_anonymous=True,
                                                vllm_api_keys=["vllm-secret"]))
    code, _ = await _call(app, {**CHAT, "user": "alice"}, {})
    assert code == 401
    code, body = await _call(app, CHAT, {"authorization": "Bearer vllm-secret"})
    assert code == 200 and body == CHAT


async def test_memory_keys_pass_vllms_key_check_and_generation_keys_read_no_memory():
    app = MemoryFrontend(_downstream, _settings(api_keys={"memory-key": ["alice"]},
                                                vllm_api_keys=["vllm-secret"]))
    code, body = await _call(app, CHAT, {"authorization": "Bearer memory-key"})
    assert code == 200 and body == CHAT
    code, answer = await _call(app, {**CHAT, "user": "alice"},
                               {"authorization": "Bearer vllm-secret"})
    assert code == 401, answer


async def test_refused_kv_transfer_params_anywhere(frontend):
    for body in ({**CHAT, "kv_transfer_params": {}}, {**CHAT, "vllm_xargs": {
            "kv_transfer_params": 1}}, {"a": [{"b": {"kv_transfer_params": None}}]},
                 {"pad": "x" * 100_000, "kv_transfer_params": {}}):  # parsed in a thread
        code, answer = await _call(frontend, body, {})
        assert code == 400 and "reserved" in answer["error"]["message"]


@pytest.mark.parametrize(("settings", "headers", "status"), [
    (_settings(api_keys={"key-a": ["alice"], "root": ["*"]}), {}, 401),
    (_settings(api_keys={"key-a": ["alice"], "root": ["*"]}),
     {"authorization": "Bearer key-a"}, 403),
    (_settings(api_keys={"key-a": ["alice"], "root": ["*"]}),
     {"authorization": "Bearer root"}, 200),
    (_settings(api_keys={"reader": {"owners": ["*"], "read_only": True}}),
     {"authorization": "Bearer reader"}, 403),
    (_settings(api_keys={"agent": {"owners": ["*"], "agents": ["a"]}}),
     {"authorization": "Bearer agent"}, 403),
    (_settings(), {}, 401),  # no keys: refused, on loopback too
    (_settings(allow_anonymous=True), {}, 200),  # the anonymous policy applies here too
])
async def test_engine_control_routes_need_an_admin_key(settings, headers, status):
    """Every route not named public or memory: vLLM's control, dev-mode and adapter routes,
    /invocations and any route a future vLLM adds; under a --root-path too."""
    app = MemoryFrontend(_downstream, settings)
    body = {"new_data_parallel_size": 2}
    for path in ("/scale_elastic_ep", "/sleep", "/collective_rpc", "/v1/load_lora_adapter",
                 "/pause", "/invocations", "/adapters", "/update_weights",
                 "/v1/future_route_of_vllm"):
        for root_path in ("", "/api"):
            code, answer = await _call(app, body, headers, path=path, root_path=root_path)
            assert code == status, (root_path, path, answer)
            if status != 200:
                assert answer["error"]["type"] in ("authentication_error", "permission_error")


async def test_generation_routes_stay_open_under_a_root_path(frontend):
    code, body = await _call(frontend, CHAT, {}, root_path="/api")
    assert code == 200 and body == CHAT
    code, _ = await _call(frontend, {**CHAT, "user": "alice"}, {}, root_path="/api")
    assert code == 401  # memory is still memory there
