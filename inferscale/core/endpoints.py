"""Where the broker and the database are: the configured endpoints, else the embedded ones
that ``devstack/infra.py`` started on this machine (read from its state file). Product code
finds its infrastructure here; only the dev stack starts and stops it."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from inferscale.core.procs import pid_alive
from inferscale.core.settings import Settings

DATABASE_NAME = "inferscale"
DATABASE_USER = "postgres"


class InfraError(RuntimeError):
    """The embedded infrastructure cannot be started, found or stopped."""


@dataclass(frozen=True)
class Endpoints:
    """Where clients reach the broker and the database."""

    kafka_bootstrap: str
    database_url: str


def state_file(settings: Settings) -> Path:
    return settings.infra_dir / "state.json"


def read_state(settings: Settings) -> dict:
    path = state_file(settings)
    return json.loads(path.read_text()) if path.exists() else {}


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def running(entry: dict | None) -> bool:
    return bool(entry and pid_alive(entry.get("pid")) and port_open(entry["port"]))


def pg_password_path(settings: Settings) -> Path:
    """Where the embedded Postgres's password is kept (mode 0600; ``devstack/infra.py`` makes
    it): every process of the stack on this machine logs in with it."""
    return settings.infra_dir / "pg_password"


def read_pg_password(settings: Settings) -> str | None:
    """The embedded Postgres's password; None where it has none (a cluster made before
    passwords, until its next start)."""
    try:
        return pg_password_path(settings).read_text().strip() or None
    except FileNotFoundError:
        return None


def postgres_url(port: int, password: str | None) -> str:
    """The URL of the embedded database on ``port``, logging in with ``password``."""
    login = f"{DATABASE_USER}:{quote(password, safe='')}" if password else DATABASE_USER
    return f"postgresql+asyncpg://{login}@127.0.0.1:{port}/{DATABASE_NAME}"


def endpoints(settings: Settings, state: dict) -> Endpoints:
    """Where the embedded broker and database recorded in ``state`` are reached."""
    return Endpoints(
        kafka_bootstrap=f"127.0.0.1:{state.get('kafka', {}).get('port')}",
        database_url=postgres_url(state["postgres"]["port"], read_pg_password(settings)),
    )


def _require(settings: Settings, name: str) -> dict:
    state = read_state(settings)
    if not running(state.get(name)):
        raise InfraError(
            f"embedded {name} is not running (data dir {settings.data_dir}): run "
            "`inferscale infra up` or set INFERSCALE_KAFKA_BOOTSTRAP / INFERSCALE_DATABASE_URL"
        )
    return state


def embedded_database_url(settings: Settings) -> str:
    """URL of the running embedded Postgres; a clear error when it is not up."""
    return endpoints(settings, _require(settings, "postgres")).database_url


def resolve_kafka_bootstrap(settings: Settings) -> str:
    """The configured broker, else the running embedded one."""
    if settings.kafka_bootstrap:
        return settings.kafka_bootstrap
    return f"127.0.0.1:{_require(settings, 'kafka')['kafka']['port']}"

