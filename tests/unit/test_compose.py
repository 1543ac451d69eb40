"""compose.yaml: checked statically everywhere, and by `docker compose config` where it runs."""

import os
import subprocess

import pytest
import yaml

from conftest import COMPOSE_ENDPOINTS, COMPOSE_ENV, COMPOSE_S3, ROOT, docker_problem
from inferscale.platform.settings import Settings


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_present_and_wired():
    services = _compose()["services"]
    assert {"kafka", "postgres", "minio", "bucket", "migrate", "worker-1", "worker-2",
            "server-1", "server-2", "router"} <= set(services)
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "pgvector" in services["postgres"]["image"]
    assert services["migrate"]["command"] == ["db", "upgrade"]
    worker_deps = services["worker-1"]["depends_on"]
    assert worker_deps["migrate"]["condition"] == "service_completed_successfully"
    gpus = [services[name]["deploy"]["resources"]["reservations"]["devices"][0]
            for name in ("server-1", "server-2", "worker-1", "worker-2")]
    assert all(gpu["capabilities"] == ["gpu"] for gpu in gpus)
    assert sorted(d for gpu in gpus for d in gpu["device_ids"]) == ["0", "1", "2", "3"]


def test_replicas_share_the_bucket_behind_a_sticky_router():
    """Workers and servers write and read KV in MinIO (no shared volume), the bucket exists
    before they start, and only the router publishes the API port."""
    compose = _compose()
    services = compose["services"]
    for name in ("worker-1", "worker-2", "server-1", "server-2"):
        env = services[name]["environment"]
        assert Settings(kv_url=env["INFERSCALE_KV_URL"]).kv_bucket is not None
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        assert services[name]["depends_on"]["bucket"]["condition"] == (
            "service_completed_successfully")
        assert not any(v.startswith("kv-data") for v in services[name].get("volumes", []))
        assert "ports" not in services[name]
    assert services["router"]["ports"] == ["8000:8000"]
    assert {name: dep["condition"] for name, dep in services["router"]["depends_on"].items()} == {
        "server-1": "service_healthy", "server-2": "service_healthy"}
    router = compose["configs"]["router"]["content"]
    assert "server server-1:8000 resolve;" in router and "server server-2:8000 resolve;" in router
    assert "consistent;" in router and "resolver 127.0.0.11" in router
    assert "$$http_authorization" in router and "proxy_buffering off;" in router


def test_compose_mode_reaches_what_compose_publishes():
    """INFERSCALE_TEST_COMPOSE=1 points the suite at the broker, database and object store
    compose.yaml publishes on the host, with the credentials it starts them with."""
    services = _compose()["services"]
    published = {name: {port.split(":")[0] for port in services[name]["ports"]}
                 for name in ("kafka", "postgres", "minio")}
    assert COMPOSE_ENDPOINTS["INFERSCALE_KAFKA_BOOTSTRAP"].rsplit(":", 1)[1] in published["kafka"]
    assert ":5432/" in COMPOSE_ENDPOINTS["INFERSCALE_DATABASE_URL"] and "5432" in published[
        "postgres"]
    assert COMPOSE_S3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1] in published["minio"]
    minio = services["minio"]["environment"]
    for name, key in (("MINIO_ROOT_USER", "AWS_ACCESS_KEY_ID"),
                      ("MINIO_ROOT_PASSWORD", "AWS_SECRET_ACCESS_KEY")):
        default = minio[name].removeprefix(f"${{{name}:-").removesuffix("}")
        assert COMPOSE_S3[key] == os.environ.get(name, default)


def test_the_server_starts_with_api_keys():
    """A server on 0.0.0.0 needs keys: compose refuses to start without them."""
    env = _compose()["services"]["server-1"]["environment"]
    assert env["INFERSCALE_SERVER_HOST"] == "0.0.0.0"
    assert env["INFERSCALE_API_KEYS"].startswith("${INFERSCALE_API_KEYS:?")
    assert "INFERSCALE_ALLOW_ANONYMOUS" not in env


def test_every_inferscale_env_key_is_a_setting():
    fields = set(Settings.model_fields)
    keys = set()
    for service in _compose()["services"].values():
        keys |= {k for k in (service.get("environment") or {}) if k.startswith("INFERSCALE_")}
    assert keys, "compose passes no InferScale settings"
    unknown = {k for k in keys if k.removeprefix("INFERSCALE_").lower() not in fields}
    assert not unknown, f"compose env keys that no setting reads: {unknown}"


def test_docker_compose_accepts_the_file():
    problem = docker_problem(need_engine=False)
    if problem:
        pytest.skip(f"no docker compose here: {problem}")
    done = subprocess.run(["docker", "compose", "-f", str(ROOT / "compose.yaml"), "config", "-q"],
                          capture_output=True, text=True, timeout=120, env=COMPOSE_ENV)
    assert done.returncode == 0, done.stderr
