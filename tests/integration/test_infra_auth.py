"""The embedded Postgres authenticates every login (#67): password (SCRAM) logins only, over TCP
and its Unix socket; its password and the data directory are the account's alone, so another
account on the machine gets neither files nor a login; a cluster made before passwords
(``trust``) is given one at its next start."""

import base64
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from conftest import EXTERNAL_INFRA
from inferscale.core import endpoints
from inferscale.core.settings import Settings
from inferscale.devstack import infra

pytestmark = pytest.mark.skipif(EXTERNAL_INFRA,
                                reason="suite runs against external infrastructure")

PROBE_USER = "inferscale_probe"  # the other account on a shared machine
# Running as root, others keep the x bit on the data folders: Postgres's own user passes through.
TRAVERSE = 0o001 if os.geteuid() == 0 else 0


def _embedded(base_settings: Settings) -> Settings:
    return base_settings.model_copy(update={"kafka_bootstrap": None, "database_url": None})


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _hba_rules(pgdata: Path) -> list[list[str]]:
    lines = (pgdata / "pg_hba.conf").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


async def _login(host: str, port: int, password: str | None, passfile: Path) -> None:
    conn = await asyncpg.connect(host=host, port=port, user="postgres", database="inferscale",
                                 password=password, passfile=str(passfile), timeout=10)
    await conn.close()


async def _refused(host: str, port: int, password: str | None, passfile: Path) -> bool:
    try:
        await _login(host, port, password, passfile)
    except asyncpg.InvalidAuthorizationSpecificationError:  # invalid password among them
        return True
    return False


@pytest.fixture
def no_password_in_env(monkeypatch, tmp_path) -> Path:
    """No password reaches asyncpg but the one a test gives: the passfile it gets is empty."""
    monkeypatch.delenv("PGPASSWORD", raising=False)
    passfile = tmp_path / "pgpass"
    passfile.touch(mode=0o600)
    return passfile


async def test_postgres_takes_password_logins_only(base_settings, no_password_in_env):
    local = _embedded(base_settings)
    entry = endpoints.read_state(local)["postgres"]
    port, pgdata = entry["port"], Path(entry["pgdata"])
    password = endpoints.read_pg_password(local)
    assert password and make_url(base_settings.database_url).password == password
    for host in ("127.0.0.1", str(pgdata)):  # TCP, and the Unix socket in pgdata
        for wrong in (None, "", f"not-{password}"):
            assert await _refused(host, port, wrong, no_password_in_env), (host, wrong)
        await _login(host, port, password, no_password_in_env)
    assert all(rule[-1] == "scram-sha-256" for rule in _hba_rules(pgdata)), _hba_rules(pgdata)


async def test_the_verifier_set_on_old_clusters_is_the_one_postgres_makes(base_settings):
    """``scram_verifier`` (what a cluster made with ``trust`` is given) is what initdb stored
    for the same password and salt."""
    conn = await asyncpg.connect(base_settings.database_url.replace("+asyncpg", ""))
    try:
        stored = await conn.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = $1",
                                     "postgres")
    finally:
        await conn.close()
    iterations, salt = stored.split("$")[1].split(":")
    password = endpoints.read_pg_password(_embedded(base_settings))
    assert infra.scram_verifier(password, base64.b64decode(salt), int(iterations)) == stored


def test_the_data_directory_and_the_password_are_private(base_settings):
    local = _embedded(base_settings)
    assert _mode(local.data_dir) == _mode(local.infra_dir) == 0o700 | TRAVERSE
    assert _mode(endpoints.pg_password_path(local)) == 0o600
    assert _mode(Path(endpoints.read_state(local)["postgres"]["pgdata"])) == 0o700


def _probe_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(PROBE_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", PROBE_USER], check=True,
                       capture_output=True)
        return pwd.getpwnam(PROBE_USER)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a second account and acting as it "
                                                "needs root")
def test_another_account_gets_neither_files_nor_a_login(base_settings):
    local = _embedded(base_settings)
    entry = endpoints.read_state(local)["postgres"]
    psql = [infra._pg_bin("psql"), "-w", "-p", str(entry["port"]), "-U", "postgres", "-d",
            "inferscale", "-c", "SELECT 1", "-h"]
    attempts = {
        "list the data directory": ["ls", str(local.data_dir)],
        "read the password": ["cat", str(endpoints.pg_password_path(local))],
        "list pgdata": ["ls", entry["pgdata"]],
        "log in over TCP": [*psql, "127.0.0.1"],
        "log in over the socket": [*psql, entry["pgdata"]],
    }
    probe = _probe_user()
    answers = {}
    for what, args in attempts.items():
        done = subprocess.run(args, user=probe.pw_uid, group=probe.pw_gid, extra_groups=[],
                              cwd="/", capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"})
        assert done.returncode != 0, f"{PROBE_USER} could {what}: {done.stdout}"
        answers[what] = done.stderr.strip()
    assert all("Permission denied" in answers[what] for what in (
        "list the data directory", "read the password", "list pgdata",
        "log in over the socket")), answers
    assert "no password supplied" in answers["log in over TCP"], answers


async def test_a_cluster_made_with_trust_gets_a_password_at_its_next_start(no_password_in_env):
    root = Path(tempfile.mkdtemp(prefix="inferscale-trust-"))  # outside pytest's 0700 tree
    settings = Settings(data_dir=root / "data")
    pgdata = settings.infra_dir / "pgdata"
    pgdata.mkdir(parents=True)
    user = infra._pg_run_user()
    if user:
        infra._pg_prepare_permissions(pgdata, user)
    infra._pg([infra._pg_bin("initdb"), "-D", str(pgdata), "--auth=trust", "-U", "postgres"],
              user, timeout=120)  # as infra.py made clusters before passwords
    assert any(rule[-1] == "trust" for rule in _hba_rules(pgdata))
    try:
        found = infra.up(settings)
        password = endpoints.read_pg_password(settings)
        assert password and make_url(found.database_url).password == password
        port = endpoints.read_state(settings)["postgres"]["port"]
        assert await _refused("127.0.0.1", port, None, no_password_in_env)
        await _login("127.0.0.1", port, password, no_password_in_env)
        assert all(rule[-1] == "scram-sha-256" for rule in _hba_rules(pgdata))
    finally:
        infra.down(settings)
        shutil.rmtree(root, ignore_errors=True)
