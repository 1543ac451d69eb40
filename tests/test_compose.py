"""compose.yaml: checked statically everywhere, and by `docker compose config` where it runs."""

import subprocess

import pytest
import yaml

from conftest import ROOT, docker_problem
from inferscale.settings import Settings


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_present_and_wired():
    services = _compose()["services"]
    assert {"kafka", "postgres", "migrate", "worker", "server"} <= set(services)
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "pgvector" in services["postgres"]["image"]
    assert services["migrate"]["command"] == ["db", "upgrade"]
    worker_deps = services["worker"]["depends_on"]
    assert worker_deps["migrate"]["condition"] == "service_completed_successfully"
    gpu = services["server"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]


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
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
