"""Embedded infrastructure lifecycle: reuse, status, clear errors."""

import json
import os
import socket
import subprocess
import sys

import pytest
from sqlalchemy.engine import make_url

from conftest import EXTERNAL_INFRA
from inferscale.core import endpoints
from inferscale.core.settings import Settings
from inferscale.devstack import infra


@pytest.mark.skipif(EXTERNAL_INFRA, reason="suite runs against external infrastructure")
def test_second_up_reuses_running_services(base_settings):
    local = base_settings.model_copy(update={"kafka_bootstrap": None, "database_url": None})
    before = infra.status(local)
    endpoints = infra.up(local)
    assert endpoints.kafka_bootstrap == base_settings.kafka_bootstrap
    assert infra.status(local)["kafka"]["pid"] == before["kafka"]["pid"]
    out = subprocess.run([sys.executable, "-m", "inferscale.cli", "infra", "status", "--json"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "INFERSCALE_DATA_DIR": str(local.data_dir)})
    report = json.loads(out.stdout)
    assert report["kafka_bootstrap"] == endpoints.kafka_bootstrap
    shown = make_url(report["database_url"])
    assert shown.password == "***"  # the password stays in its 0600 file, never printed
    assert shown.set(password=make_url(endpoints.database_url).password) == make_url(
        endpoints.database_url)
    assert make_url(endpoints.database_url).password not in out.stdout


def test_port_taken_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(endpoints.InfraError, match=f"port {port} is already taken"):
            infra.up(Settings(data_dir=tmp_path), kafka_port=port)


def test_stale_pid_file_is_not_reused(tmp_path):
    settings = Settings(data_dir=tmp_path)
    settings.infra_dir.mkdir(parents=True)
    (settings.infra_dir / "state.json").write_text(json.dumps(
        {"kafka": {"pid": 2**22 + 12345, "port": 1}}))
    assert infra.status(settings)["kafka"]["running"] is False
    with pytest.raises(endpoints.InfraError, match="not running"):
        endpoints.resolve_kafka_bootstrap(settings)
