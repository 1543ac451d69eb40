"""compose.yaml is checked statically (no Docker engine runs here)."""

import yaml

from conftest import ROOT
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
