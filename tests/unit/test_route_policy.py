"""Which routes anyone may call (``serving/route_policy.py``), read off vLLM's own app as it is
built (dev mode on, so its dev-mode routes are there too) with the memory API added: every
route is memory, public, metrics or admin; every route this suite has not reviewed fails the
test (a new vLLM route is decided on, not served by accident); the public list names only
routes vLLM has; the router's matching (methods, path parameters, a root path) decides."""

import pytest
from fastapi import FastAPI

from inferscale.serving import mem0_api, memory_api
from inferscale.serving.route_policy import PUBLIC_ROUTES, RoutePolicy

# vLLM 0.32's routes that need an admin key, reviewed: engine control, dev mode, weight
# transfer, scaling, token-level and SageMaker entry points (``/invocations`` skips the memory
# front end), rendering helpers of other APIs, and vLLM's introspection.
REVIEWED_ADMIN = frozenset({
    "/kv_event_sources", "/v1/systemone", "/invocations", "/reset_prefix_cache",
    "/reset_mm_cache", "/reset_encoder_cache", "/collective_rpc", "/server_info", "/sleep",
    "/release_kv_cache_memory", "/wake_up", "/is_sleeping", "/pause", "/resume",
    "/abort_requests", "/is_paused", "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
    "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_info",
    "/weight_checker", "/get_world_size", "/generative_scoring", "/scale_elastic_ep",
    "/is_scaling_elastic_ep", "/v1/messages/render", "/v1/responses/render",
    "/v1/chat/completions/derender", "/v1/completions/derender", "/inference/v1/generate",
    "/inference/v1/abort_requests", "/static", "/tokenizer_info", "/fault_tolerance/status",
    "/fault_tolerance/apply", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


@pytest.fixture(scope="module")
def vllm_app() -> FastAPI:
    """vLLM's API server app (no engine: routes only), dev mode on, memory routes added."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
        app = build_app(args, ("generate",))
    app.include_router(memory_api.router)
    app.include_router(mem0_api.router)
    return app


@pytest.fixture(scope="module")
def policy(vllm_app) -> RoutePolicy:
    return RoutePolicy(vllm_app.routes, memory_api.memory_endpoints())


def test_every_route_is_of_a_reviewed_kind(policy):
    kinds = policy.kinds()
    memory_paths = {route.path for route in (*memory_api.router.routes,
                                             *mem0_api.router.routes)}
    unreviewed = []
    for path, kind in kinds.items():
        if path in memory_paths:
            assert kind == {"memory"}, path
        elif path == "/metrics":
            assert kind == {"metrics"}
        elif path in PUBLIC_ROUTES:
            assert kind == {"public"}, path
        elif kind != {"admin"} or path not in REVIEWED_ADMIN:
            unreviewed.append((path, kind))
    assert not unreviewed, f"routes to decide on (public, memory or admin): {unreviewed}"
    assert PUBLIC_ROUTES <= set(kinds), PUBLIC_ROUTES - set(kinds)  # no stale names
    assert {"/pause", "/collective_rpc", "/invocations", "/update_weights"} <= {
        p for p, k in kinds.items() if k == {"admin"}}


def _scope(method: str, path: str, root_path: str = "") -> dict:
    return {"type": "http", "method": method, "path": root_path + path, "root_path": root_path,
            "headers": []}


@pytest.mark.parametrize("root_path", ["", "/api"])
def test_a_request_gets_the_kind_of_the_route_the_router_would_reach(policy, root_path):
    kind = lambda method, path: policy.kind(_scope(method, path, root_path))  # noqa: E731
    assert kind("POST", "/v1/chat/completions") == "public"
    assert kind("GET", "/v1/responses/resp_1") == "public"  # a path parameter
    assert kind("POST", "/reset_prefix_cache") == "admin"
    assert kind("GET", "/reset_prefix_cache") == "admin"  # another method: still that route
    assert kind("POST", "/v1/memory/users/alice/search") == "memory"
    assert kind("DELETE", "/v1/batch/") == "memory"
    assert kind("GET", "/metrics") == "metrics"
    assert kind("GET", "/no/such/route") is None  # the app answers 404
