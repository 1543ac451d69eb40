"""Hostile requests against the real server (vLLM CPU engine + connector + memory front end).

Every POST route vLLM serves is tried with client-made ``kv_transfer_params`` (top level, nested,
through ``vllm_xargs``, in forms), oversized and malformed bodies, and hypothesis-generated chat
requests; afterwards the server still answers ``/health`` and a normal memory query with KV.
"""

import hashlib
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import AUTH
from helpers import ines_with_two_facts
from hostile import any_text, json_values, tried
from inferscale.serving.browser_guard import JSON_BODY_PATHS

pytestmark = pytest.mark.slow

FORGED_PLAN = {"inferscale": {"sig": "\u00e9", "fingerprint": "x", "segments": []}}
HOSTILE_BODIES = [
    {"kv_transfer_params": FORGED_PLAN},
    {"kv_transfer_params": 1},
    {"vllm_xargs": {"kv_transfer_params": 1}},
    {"vllm_xargs": {"kv_transfer_params": "{\"inferscale\": {}}"}},
    {"messages": [{"role": "user", "content": "hi", "kv_transfer_params": FORGED_PLAN}]},
]
GENERATION_BASE = {"model": "inferscale", "max_tokens": 2, "max_output_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi"}
KNOWN_KV_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}


@pytest.fixture(scope="module")
async def memory_user(served, smol, base_settings, engine, embedder):
    """A user with two encoded facts, for the 'still serves memory' checks."""
    return await ines_with_two_facts(served, smol, base_settings, engine, embedder, "hostile")


@pytest.fixture(scope="module")
def post_routes(served) -> dict[str, dict]:
    """Every POST route of the running server, from its own OpenAPI document."""
    spec = httpx.get(f"{served.url}/openapi.json", timeout=30).json()
    return {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}


def _schema_mentions(spec: dict, node, names: tuple[str, ...]) -> bool:
    """Whether a (ref-resolved) schema has a property with one of ``names``, at any depth."""
    stack, seen = [node], set()
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if ref and ref not in seen:
                seen.add(ref)
                target = spec
                for part in ref.removeprefix("#/").split("/"):
                    target = target[part]
                stack.append(target)
            if any(n in item.get("properties", {}) for n in names):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _assert_alive_with_memory(served, user: str) -> None:
    assert httpx.get(f"{served.url}/health", timeout=30).status_code == 200
    response = served.chat(user, "What is the name of Ines's horse?", k=2)
    assert response.status_code == 200, response.text
    assert response.headers["x-inferscale-facts-injected"] == "2"
    assert response.json()["kv_transfer_params"]["injected_tokens"] > 0


def test_every_post_route_refuses_client_kv_transfer_params(served, post_routes, memory_user):
    spec = httpx.get(f"{served.url}/openapi.json", timeout=30).json()
    kv_routes = {path for path, op in post_routes.items()
                 if _schema_mentions(spec, op.get("requestBody", {}),
                                     ("kv_transfer_params", "vllm_xargs"))}
    # The routes this vLLM release feeds into Request.kv_transfer_params are all still here
    # (if vLLM adds one, the guard covers it anyway: it does not depend on the path).
    assert KNOWN_KV_ROUTES <= kv_routes, kv_routes
    sent = 0
    for path in sorted(post_routes):
        for hostile in HOSTILE_BODIES:
            response = httpx.post(f"{served.url}{path}", json={**GENERATION_BASE, **hostile},
                                  headers=AUTH, timeout=60)
            sent += 1
            assert response.status_code == 400, (path, hostile, response.text)
            assert "reserved" in response.json()["error"]["message"]
            assert not any(h.startswith("x-inferscale") for h in response.headers)
        form = httpx.post(f"{served.url}{path}", timeout=60, headers=AUTH, data={
            "model": "inferscale", "vllm_xargs": json.dumps({"kv_transfer_params": 1})})
        sent += 1
        # memory and chat routes take JSON only (415); vLLM's other routes refuse the field
        expected = 415 if path.startswith(JSON_BODY_PATHS) else 400
        assert form.status_code == expected, (path, form.text)
    tried("server: reserved keys, every POST route", sent)
    _assert_alive_with_memory(served, memory_user)


def test_named_regressions(served, memory_user):
    """The requests that killed the engine or answered 500 before."""
    url = served.url
    anthropic = httpx.post(f"{url}/v1/messages", timeout=60, headers=AUTH, json={
        "model": "inferscale", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {"inferscale": {"sig": "\u00e9"}}})
    assert anthropic.status_code == 400
    xargs = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers=AUTH, json={
        **GENERATION_BASE, "vllm_xargs": {"kv_transfer_params": 1}})
    assert xargs.status_code == 400
    escaped = httpx.post(f"{url}/v1/completions", timeout=60, headers={
        **AUTH, "content-type": "application/json"},
        content=b'{"model": "inferscale", "prompt": "hi", '
                b'"kv\\u005ftransfer_params": {"inferscale": {}}}')
    assert escaped.status_code == 400
    deep = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={
        **AUTH, "content-type": "application/json"},
        content=b"[" * 100_000 + b"]" * 100_000)
    assert deep.status_code == 400
    huge_int = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={
        **AUTH, "content-type": "application/json"},
        content=b'{"max_tokens": ' + b"9" * 5000 + b"}")
    assert huge_int.status_code == 400
    huge_k = served.chat(memory_user, "hi", k=10**400)
    assert huge_k.status_code == 400
    tried("server: named regressions", 6)
    _assert_alive_with_memory(served, memory_user)


def test_oversized_bodies_get_413(served, memory_user):
    limit = served.settings.max_body_bytes
    declared = httpx.post(f"{served.url}/v1/chat/completions", timeout=60,
                          headers={"content-type": "application/json"},
                          content=b" " * (limit + 1))
    assert declared.status_code == 413

    def chunks():  # no content-length: refused once the running total passes the limit
        for _ in range(64):
            yield b" " * (1 << 20)

    streamed = httpx.post(f"{served.url}/v1/completions", timeout=60,
                          headers={"content-type": "application/json"}, content=chunks())
    assert streamed.status_code == 413
    tried("server: oversized bodies", 2)
    _assert_alive_with_memory(served, memory_user)


def test_openai_message_forms_are_memory_requests(served, memory_user):
    # k = 1: the query is the joined text parts, so the one fact retrieved is the horse's (and,
    # served alone after the preamble, its KV is exactly what text prefill computes).
    response = served.chat(memory_user, "unused", k=1, messages=[
        {"role": "developer", "content": "Answer in one short sentence."},
        {"role": "user", "name": "ines", "content": [
            {"type": "text", "text": "What is the name of"}, {"type": "text", "text":
                                                             "Ines's horse?"}]}])
    assert response.status_code == 200, response.text
    assert response.headers["x-inferscale-facts-injected"] == "1"
    assert "Biscuit" in response.json()["choices"][0]["message"]["content"]
    image = served.chat(memory_user, "unused", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert image.status_code == 400 and "text content" in image.json()["error"]["message"]


def test_refusals_carry_no_memory_headers(served, memory_user):
    too_long = served.chat(memory_user, "What is the name of Ines's horse?", k=2,
                           max_tokens=10**6)
    assert 400 <= too_long.status_code < 500
    assert not any(h.startswith("x-inferscale") for h in too_long.headers)


def test_memory_asked_of_completions_is_refused_not_ignored(served, memory_user):
    """Memory is served on chat completions and responses only: /v1/completions refuses a
    request that asks for it (400 naming the route) and answers one that does not."""
    for path, body in (("/v1/completions", {"prompt": "Where does Ines teach?"}),):
        body = {"model": "inferscale", "max_tokens": 16, **body}
        for extra, headers in (({"inferscale": {"k": 2}}, {}),
                               ({}, {"x-inferscale-user": memory_user})):
            refused = httpx.post(f"{served.url}{path}", json={**body, **extra}, timeout=60,
                                 headers={**AUTH, **headers})
            assert refused.status_code == 400 and path in refused.json()["error"]["message"]
        plain = httpx.post(f"{served.url}{path}", json={**body, "user": memory_user},
                           timeout=60, headers=AUTH)
        assert plain.status_code == 200, plain.text


async def test_text_prompts_are_salted_per_owner(served, memory_user):
    """A text-mode memory prompt's cached blocks serve its owner again, nobody else."""
    from inferscale.serving.compose import MemoryRuntime, compose
    from inferscale.serving.request_options import MemoryOptions

    question = "Where does Ines teach?"
    messages = [{"role": "system", "content": "Answer briefly. " * 150},  # > 2 cache blocks
                {"role": "user", "content": question}]
    served.chat(memory_user, question, mode="text", k=2, messages=messages)
    again = served.chat(memory_user, question, mode="text", k=2, messages=messages)
    assert (again.json()["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) > 0
    rt = MemoryRuntime(served.settings)
    try:
        prompt = await compose(rt, memory_user, MemoryOptions(mode="text", k=2), messages, question)
    finally:
        await rt.engine.dispose()
    # Another client with the owner's prompt, unsalted or salted as it could compute from public
    # values (owner, model fingerprint: the salt's former recipe), reuses none of its blocks.
    public = hashlib.sha256(json.dumps([memory_user, rt.fingerprint, None, None, None]).encode())
    for salt in (None, f"inferscale-{public.hexdigest()[:32]}"):
        stranger = httpx.post(f"{served.url}/v1/completions", timeout=60, headers=AUTH, json={
            "model": "inferscale", "max_tokens": 1, "prompt": prompt.token_ids,
            **({"cache_salt": salt} if salt else {})})
        assert stranger.status_code == 200, stranger.text
        assert stranger.json()["usage"]["prompt_tokens"] == again.json()["usage"][
            "prompt_tokens"]
        assert (stranger.json()["usage"].get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0) == 0


chat_bodies = st.fixed_dictionaries({
    "model": st.just("inferscale"),
    "max_tokens": st.just(1),
    "messages": st.one_of(json_values, st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "x"]),
        "content": st.one_of(any_text, json_values, st.lists(st.fixed_dictionaries({
            "type": st.sampled_from(["text", "input_text", "image_url"]),
            "text": any_text}), max_size=3))}), max_size=3)),
}, optional={
    "user": st.one_of(any_text, json_values),
    "inferscale": st.one_of(json_values, st.fixed_dictionaries({}, optional={
        "mode": st.one_of(st.sampled_from(["inject", "text", "none"]), json_values),
        "k": st.one_of(st.integers(-5, 300), json_values)})),
    "cache_salt": json_values,
    "stream": st.booleans(),
    "temperature": json_values,
})


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(body=chat_bodies, user_header=st.one_of(st.none(), st.from_regex(
    r"[!-~]([ -~]{0,38}[!-~])?", fullmatch=True)))
def test_fuzzed_chat_requests_never_crash(served, body, user_header):
    headers = {"x-inferscale-user": user_header} if user_header else {}
    raw = json.dumps(body).encode()
    response = httpx.post(f"{served.url}/v1/chat/completions", content=raw, timeout=120,
                          headers={**AUTH, "content-type": "application/json", **headers})
    tried("server: fuzzed chat requests")
    # served, or refused as a bad request (never a 5xx, nor a refusal of the right key)
    assert response.status_code in (200, 400), (body, response.text)


LIMITS = {"max_tokens": 1, "max_output_tokens": 1, "max_completion_tokens": 1}
# Admin routes that change the engine's state (scaling, sleep, cache resets, RPC, profiling,
# adapters, pausing, weights): the suite's admin key may call them, the fuzzer does not.
ENGINE_CONTROL = frozenset({
    "/scale_elastic_ep", "/is_scaling_elastic_ep", "/collective_rpc", "/sleep", "/wake_up",
    "/release_kv_cache_memory", "/reset_prefix_cache", "/reset_mm_cache",
    "/reset_encoder_cache", "/start_profile", "/stop_profile", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/fault_tolerance/apply", "/pause", "/resume",
    "/abort_requests", "/inference/v1/abort_requests", "/update_weights",
    "/start_weight_update", "/finish_weight_update", "/init_weight_transfer_engine"})
route_bodies = st.one_of(json_values, st.dictionaries(
    st.sampled_from(["model", "messages", "prompt", "input", "user", "inferscale", "stream",
                     "cache_salt", "n", "logprobs", "tools", "requests"]) | any_text,
    json_values, max_size=6))


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_bodies_on_every_route_leave_the_server_up(served, post_routes, data):
    """Arbitrary JSON on every POST route (engine-control routes aside) and the forget route:
    each is refused as a client error or served, never a 5xx, and the server stays up."""
    paths = sorted(set(post_routes) - ENGINE_CONTROL)
    path = data.draw(st.sampled_from(paths))
    body = data.draw(route_bodies)
    if isinstance(body, dict):
        body = {**body, **LIMITS}  # never a long generation on 2 cores
    response = httpx.post(f"{served.url}{path}", content=json.dumps(body).encode(), timeout=120,
                          headers={**AUTH, "content-type": "application/json"})
    tried("server: fuzzed bodies, every POST route")
    # served, or refused as a client error of the request itself (never a 5xx, and the right
    # key never refused: no 401 / 403)
    assert response.status_code < 500 and response.status_code not in (401, 403), (
        path, body, response.text[:300])
    assert httpx.get(f"{served.url}/health", timeout=30).status_code == 200, (path, body)


def test_alive_after_fuzzing(served, memory_user):
    _assert_alive_with_memory(served, memory_user)
