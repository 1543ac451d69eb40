"""compose.yaml: checked statically everywhere, and by `docker compose config` where it runs."""

import json
import re
import subprocess

import pytest
import yaml

from conftest import COMPOSE_ENDPOINTS, COMPOSE_ENV, COMPOSE_S3, ROOT, docker_problem
from inferscale.core.settings import Settings
from inferscale.pipeline.kafka import kafka_security

VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")  # ${NAME}, ${NAME:-default}, ${NAME:?why}
CREDENTIALS = ("POSTGRES_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "KAFKA_SASL_USERNAME",
               "KAFKA_SASL_PASSWORD", "INFERSCALE_PLAN_SECRET", "INFERSCALE_API_KEYS")
INFRASTRUCTURE = ("kafka", "postgres", "minio")
INFERSCALE_SERVICES = ("migrate", "model", "worker-1", "worker-2", "server-1", "server-2")


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _interpolate(value: object, env: dict[str, str] = COMPOSE_ENV) -> str:
    """A value as compose writes it with ``env`` (a required variable must be there)."""
    def one(match: re.Match) -> str:
        name, operator, rest = match.groups()
        if operator and operator.endswith("?"):
            return env[name]
        return env.get(name, rest if operator else "")

    return VARIABLE.sub(one, str(value))


def _settings(service: dict) -> Settings:
    """The settings a service's InferScale process reads, with the suite's credentials."""
    env = {k.removeprefix("INFERSCALE_").lower(): _interpolate(v)
           for k, v in service["environment"].items() if k.startswith("INFERSCALE_")}
    return Settings(**{k: json.loads(v) if k in ("api_keys", "allowed_hosts") else v
                       for k, v in env.items()})


def _host_ports(service: dict) -> list[tuple[str, str]]:
    """(host address, host port) of each port a service publishes (short syntax)."""
    published = []
    for port in service.get("ports", []):
        assert isinstance(port, str), f"write ports as HOST_IP:HOST_PORT:PORT, not {port!r}"
        parts = port.rsplit(":", 2)
        published.append((parts[0], parts[1]) if len(parts) == 3 else ("0.0.0.0", parts[0]))
    return published


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
    assert services["router"]["ports"] == ["127.0.0.1:8000:8000"]
    assert {name: dep["condition"] for name, dep in services["router"]["depends_on"].items()} == {
        "server-1": "service_healthy", "server-2": "service_healthy"}
    router = compose["configs"]["router"]["content"]
    assert "server server-1:8000 resolve;" in router and "server server-2:8000 resolve;" in router
    assert "consistent;" in router and "resolver 127.0.0.11" in router
    assert "$$http_authorization" in router and "proxy_buffering off;" in router
    assert "proxy_set_header Host $$host;" in router  # the servers check the Host clients used


def test_compose_mode_reaches_what_compose_publishes():
    """INFERSCALE_TEST_COMPOSE=1 points the suite at the broker, database and object store
    compose.yaml publishes on the host, with the credentials it starts them with."""
    text = (ROOT / "compose.yaml").read_text()
    assert {name for name, _, _ in VARIABLE.findall(text)} - {"INFERSCALE_ALLOWED_HOSTS"} <= set(
        COMPOSE_ENV), "the suite's compose mode must set every variable compose.yaml requires"
    services = _compose()["services"]
    published = {name: {f"{ip}:{port}" for ip, port in _host_ports(services[name])}
                 for name in INFRASTRUCTURE}
    assert COMPOSE_ENDPOINTS["INFERSCALE_KAFKA_BOOTSTRAP"] in published["kafka"]
    assert "@127.0.0.1:5432/" in COMPOSE_ENDPOINTS["INFERSCALE_DATABASE_URL"]
    assert "127.0.0.1:5432" in published["postgres"]
    assert COMPOSE_S3["AWS_ENDPOINT_URL"].removeprefix("http://") in published["minio"]
    kafka = services["kafka"]["environment"]
    assert "EXTERNAL://" + COMPOSE_ENDPOINTS["INFERSCALE_KAFKA_BOOTSTRAP"] in kafka[
        "KAFKA_ADVERTISED_LISTENERS"].split(",")
    suite = Settings(**{k.removeprefix("INFERSCALE_").lower(): v
                        for k, v in COMPOSE_ENDPOINTS.items()})
    assert kafka_security(suite) == kafka_security(_settings(services["worker-1"]))
    assert suite.database_url == _settings(services["worker-1"]).database_url.replace(
        "@postgres:", "@127.0.0.1:")
    minio = services["minio"]["environment"]
    assert COMPOSE_S3["AWS_ACCESS_KEY_ID"] == _interpolate(minio["MINIO_ROOT_USER"])
    assert COMPOSE_S3["AWS_SECRET_ACCESS_KEY"] == _interpolate(minio["MINIO_ROOT_PASSWORD"])


def test_nothing_is_published_beyond_loopback():
    """Only the infrastructure (for the suite's compose mode) and the router publish ports, and
    only on 127.0.0.1."""
    services = _compose()["services"]
    publishing = {name for name, service in services.items() if service.get("ports")}
    assert publishing <= {*INFRASTRUCTURE, "router"}
    for name in publishing:
        for address, port in _host_ports(services[name]):
            assert address == "127.0.0.1", f"{name} publishes {port} on {address}"


def test_credentials_are_required_not_defaulted():
    """Every use of a credential is ``${NAME:?...}``, none is written in, and the services use
    the ones the infrastructure starts with."""
    text = (ROOT / "compose.yaml").read_text()
    uses = [(name, operator) for name, operator, _ in VARIABLE.findall(text)]
    for credential in CREDENTIALS:
        operators = {operator for name, operator in uses if name == credential}
        assert operators == {":?"}, f"{credential}: {operators or 'never used'}"
    written_in = r"^\s*\w*(PASSWORD|SECRET\w*|ROOT_USER): [^$]|://[^/:@\s]+:[^$/@\s]+@"
    assert not re.search(written_in, text, re.MULTILINE)
    services = _compose()["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith(
        "${POSTGRES_PASSWORD:?")
    for name in ("minio", "bucket"):
        env = services[name]["environment"]
        assert env["MINIO_ROOT_USER"].startswith("${MINIO_ROOT_USER:?")
        assert env["MINIO_ROOT_PASSWORD"].startswith("${MINIO_ROOT_PASSWORD:?")
    for name in INFERSCALE_SERVICES:
        env = services[name]["environment"]
        assert "${POSTGRES_PASSWORD:?" in env["INFERSCALE_DATABASE_URL"]
        assert env["AWS_ACCESS_KEY_ID"].startswith("${MINIO_ROOT_USER:?")
        assert env["AWS_SECRET_ACCESS_KEY"].startswith("${MINIO_ROOT_PASSWORD:?")


def _listeners(value: str) -> dict[str, str]:
    """Listener name -> what follows (``A://x:1,B://:2``, ``A:SASL_SSL,B:PLAINTEXT``)."""
    return dict(re.split(r":(?://)?", item, maxsplit=1) for item in value.split(","))


def test_kafka_listeners_other_than_the_controller_take_sasl_logins():
    kafka = _compose()["services"]["kafka"]
    env = kafka["environment"]
    protocols = _listeners(env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"])
    listeners = _listeners(env["KAFKA_LISTENERS"])
    controllers = set(env["KAFKA_CONTROLLER_LISTENER_NAMES"].split(","))
    assert set(listeners) == set(protocols) and controllers < set(listeners)
    assert set(_listeners(env["KAFKA_ADVERTISED_LISTENERS"])) == set(listeners) - controllers
    for name in set(listeners) - controllers:
        assert protocols[name].startswith("SASL_"), f"{name} is {protocols[name]}"
        jaas = env[f"KAFKA_LISTENER_NAME_{name}_SCRAM___SHA___512_SASL_JAAS_CONFIG"]
        assert jaas.startswith("org.apache.kafka.common.security.scram.ScramLoginModule required")
    for name in controllers:  # PLAINTEXT, on the container's loopback only
        assert listeners[name].startswith("localhost:")
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"].startswith("1@localhost:")
    assert env["KAFKA_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    assert env["KAFKA_SASL_MECHANISM_INTER_BROKER_PROTOCOL"] == "SCRAM-SHA-512"
    assert protocols[env["KAFKA_INTER_BROKER_LISTENER_NAME"]].startswith("SASL_")
    assert env["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"  # the kafka-data volume
    assert "--command-config /tmp/client.properties" in kafka["healthcheck"]["test"][1]


def test_services_log_in_to_kafka_as_the_user_it_is_formatted_with():
    services = _compose()["services"]
    kafka = services["kafka"]["environment"]
    jaas = _interpolate(kafka["KAFKA_LISTENER_NAME_INTERNAL_SCRAM___SHA___512_SASL_JAAS_CONFIG"])
    for name in INFERSCALE_SERVICES:
        settings = _settings(services[name])
        assert settings.kafka_bootstrap == "kafka:9092"
        security = kafka_security(settings)
        assert security == {
            "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": _interpolate(kafka["SCRAM_USERNAME"]),
            "sasl_plain_password": _interpolate(kafka["SCRAM_PASSWORD"])}
        assert (f'username="{security["sasl_plain_username"]}" '
                f'password="{security["sasl_plain_password"]}";') in jaas


def _kafka_run(tmp_path, **env: str) -> subprocess.CompletedProcess:
    """compose.yaml's kafka-run entrypoint under bash, with the image's tools replaced by
    stand-ins that print what they were given."""
    compose = _compose()
    script = compose["configs"]["kafka-run"]["content"].replace("$$", "$")
    for old, new in (("/opt/kafka/bin/kafka-storage.sh", "echo kafka-storage.sh"),
                     ("exec /etc/kafka/docker/run", "echo image-run"),
                     ("rm /tmp/format.properties", "cp /tmp/format.properties saved/"),
                     ("/tmp/", f"{tmp_path}/")):
        assert old in script
        script = script.replace(old, new)
    kafka = {k: _interpolate(v) for k, v in compose["services"]["kafka"]["environment"].items()}
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "saved").mkdir(exist_ok=True)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", **kafka,
                                             "KAFKA_LOG_DIRS": str(tmp_path / "data"), **env})


def test_kafka_storage_is_formatted_once_with_the_scram_user(tmp_path):
    """The image formats without SCRAM users: kafka-run formats a new volume first, with the
    user and the server.properties the image writes from the KAFKA_* variables."""
    done = _kafka_run(tmp_path)
    assert done.returncode == 0, done.stderr
    user, password = COMPOSE_ENV["KAFKA_SASL_USERNAME"], COMPOSE_ENV["KAFKA_SASL_PASSWORD"]
    assert f"--add-scram SCRAM-SHA-512=[name={user},password={password}]" in done.stdout
    assert done.stdout.rstrip().endswith("image-run")
    formatted = (tmp_path / "saved" / "format.properties").read_text().splitlines()
    assert "sasl.enabled.mechanisms=SCRAM-SHA-512" in formatted
    assert "listener.security.protocol.map=CONTROLLER:PLAINTEXT,INTERNAL:SASL_PLAINTEXT," \
           "EXTERNAL:SASL_PLAINTEXT" in formatted
    assert any(line.startswith("listener.name.internal.scram-sha-512.sasl.jaas.config=")
               for line in formatted)
    assert not any(line.startswith(("scram.", "cluster.id")) for line in formatted)
    client = tmp_path / "client.properties"
    assert f'password="{password}";' in client.read_text()
    assert client.stat().st_mode & 0o077 == 0

    (tmp_path / "data" / "meta.properties").write_text("formatted\n")
    again = _kafka_run(tmp_path)
    assert again.returncode == 0 and "kafka-storage.sh" not in again.stdout


@pytest.mark.parametrize("password", ["has space", 'quo"te', "a,b]", ""])
def test_kafka_refuses_credentials_its_settings_cannot_hold(tmp_path, password):
    done = _kafka_run(tmp_path, SCRAM_PASSWORD=password)
    assert done.returncode != 0 and "letters, digits" in done.stderr
    assert "kafka-storage.sh" not in done.stdout


def test_the_server_starts_with_api_keys():
    """A server on 0.0.0.0 needs keys: compose refuses to start without them."""
    env = _compose()["services"]["server-1"]["environment"]
    assert env["INFERSCALE_SERVER_HOST"] == "0.0.0.0"
    assert env["INFERSCALE_API_KEYS"].startswith("${INFERSCALE_API_KEYS:?")
    assert "INFERSCALE_ALLOW_ANONYMOUS" not in env


def test_the_replicas_share_a_plan_secret_and_answer_the_routers_hosts():
    services = _compose()["services"]
    envs = [services[name]["environment"] for name in ("server-1", "server-2")]
    assert envs[0]["INFERSCALE_PLAN_SECRET"] == envs[1]["INFERSCALE_PLAN_SECRET"]
    assert envs[0]["INFERSCALE_PLAN_SECRET"].startswith("${INFERSCALE_PLAN_SECRET:?")
    settings = _settings(services["server-1"])
    assert settings.plan_secret == COMPOSE_ENV["INFERSCALE_PLAN_SECRET"]
    assert {"localhost", "127.0.0.1"} <= set(settings.allowed_hosts)
    assert "*" not in settings.allowed_hosts
    mine = _settings({"environment": {**envs[0], "INFERSCALE_ALLOWED_HOSTS": _interpolate(
        envs[0]["INFERSCALE_ALLOWED_HOSTS"], {**COMPOSE_ENV,
                                              "INFERSCALE_ALLOWED_HOSTS": '["memory.example"]'})}})
    assert mine.allowed_hosts == ["memory.example"]


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
