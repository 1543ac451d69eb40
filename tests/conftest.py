"""Shared, session-scoped infrastructure: a real Kafka-protocol broker and a real Postgres.

When INFERSCALE_KAFKA_BOOTSTRAP and INFERSCALE_DATABASE_URL are set, the suite runs against
them; INFERSCALE_TEST_COMPOSE=1 brings up compose.yaml's Kafka, Postgres and MinIO and points the
suite at them (every test is skipped, with the reason, where no Docker engine runs); otherwise the
suite starts the embedded tansu broker and Postgres, and moto_server where a test needs S3.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from inferscale.core import endpoints
from inferscale.core.local_key import KEY_ENV, key_path
from inferscale.core.settings import Settings
from inferscale.db import migrate
from inferscale.devstack import infra

ROOT = Path(__file__).resolve().parent.parent
# The suite's servers run at the defaults: no INFERSCALE_API_KEYS, so each accepts only its
# local admin key, laid in its data folder before it starts as the one it would make; the
# suite's clients pick it up from INFERSCALE_API_KEY as a user's do from the file.
SUITE_KEY = os.environ.setdefault(KEY_ENV, "suite-" + secrets.token_urlsafe(24))
AUTH = {"authorization": f"Bearer {SUITE_KEY}"}
# vLLM keeps responses (for ``previous_response_id``) only where asked to: the suite's are.
os.environ.setdefault("VLLM_ENABLE_RESPONSES_API_STORE", "1")
SAMPLE = ROOT / "inferscale" / "data" / "sample_conversation.json"
# compose.yaml starts nothing without its credentials: the suite's test values, where the
# environment sets none (the API keys and plan secret go unused: the suite starts no server).
COMPOSE_ENV = {"INFERSCALE_API_KEYS": '{"test-suite-key": ["*"]}',
               "INFERSCALE_PLAN_SECRET": "test-plan-secret", "POSTGRES_PASSWORD": "test-pg-secret",
               "MINIO_ROOT_USER": "test-minio", "MINIO_ROOT_PASSWORD": "test-minio-secret",
               "KAFKA_SASL_USERNAME": "test-kafka", "KAFKA_SASL_PASSWORD": "test-kafka-secret",
               **os.environ}
# What compose.yaml publishes on 127.0.0.1: its broker (a SCRAM login) and database.
COMPOSE_ENDPOINTS = {
    "INFERSCALE_KAFKA_BOOTSTRAP": "127.0.0.1:29092",
    "INFERSCALE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
    "INFERSCALE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "INFERSCALE_KAFKA_SASL_USERNAME": COMPOSE_ENV["KAFKA_SASL_USERNAME"],
    "INFERSCALE_KAFKA_SASL_PASSWORD": COMPOSE_ENV["KAFKA_SASL_PASSWORD"],
    "INFERSCALE_DATABASE_URL": "postgresql+asyncpg://inferscale:"
                               f"{COMPOSE_ENV['POSTGRES_PASSWORD']}@127.0.0.1:5432/inferscale",
}
# compose.yaml's MinIO (the durable KV tier) as published on the host, with its root credentials.
COMPOSE_S3 = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
              "AWS_ACCESS_KEY_ID": COMPOSE_ENV["MINIO_ROOT_USER"],
              "AWS_SECRET_ACCESS_KEY": COMPOSE_ENV["MINIO_ROOT_PASSWORD"]}


def docker_problem(need_engine: bool = True) -> str | None:
    """Why `docker compose` (with a running engine, if ``need_engine``) cannot work here."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    checks = [["docker", "compose", "version"]]
    if need_engine:
        checks.append(["docker", "info", "--format", "{{.ServerVersion}}"])
    for args in checks:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            return f"`{' '.join(args)}` failed: {output[0]}"
    return None


def _compose_up() -> str | None:
    """Start compose.yaml's broker, database and object store and point the suite at the first
    two (the ``s3_endpoint`` fixture uses the third); else why not."""
    problem = docker_problem()
    if problem is None:
        subprocess.run(["docker", "compose", "-f", str(ROOT / "compose.yaml"), "up", "-d",
                        "--wait", "kafka", "postgres", "minio"], check=True, timeout=900,
                       env=COMPOSE_ENV)
        os.environ.update(COMPOSE_ENDPOINTS)
    return problem


COMPOSE_MODE = os.environ.get("INFERSCALE_TEST_COMPOSE") == "1"
COMPOSE_SKIP = _compose_up() if COMPOSE_MODE else None
EXTERNAL_INFRA = bool(
    os.environ.get("INFERSCALE_KAFKA_BOOTSTRAP") and os.environ.get("INFERSCALE_DATABASE_URL")
)


def pytest_collection_modifyitems(config, items):
    if COMPOSE_SKIP:
        skip = pytest.mark.skip(reason="INFERSCALE_TEST_COMPOSE=1 but no Docker engine runs "
                                       f"here: {COMPOSE_SKIP}")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def base_settings() -> Settings:
    # Outside pytest's temporary tree: every new pytest session of this user (another tier, a
    # developer's run) resets /tmp/pytest-of-<user> to mode 0700, and the embedded Postgres,
    # which runs as its own user when we are root, then loses its data folder and panics.
    data_dir = Path(tempfile.mkdtemp(prefix="inferscale-suite-"))
    settings = Settings(data_dir=data_dir, kafka_session_timeout_ms=2000, drain_idle_s=2.0,
                        ingest_poll_ms=200)
    if not EXTERNAL_INFRA:
        endpoints = infra.up(settings)
        settings = settings.model_copy(update={
            "kafka_bootstrap": settings.kafka_bootstrap or endpoints.kafka_bootstrap,
            "database_url": settings.database_url or endpoints.database_url,
        })
    migrate.upgrade(settings.database_url)
    SUITE_DATABASE.append(settings.database_url)
    yield settings
    SUITE_DATABASE.clear()
    if not EXTERNAL_INFRA:
        infra.down(settings.model_copy(update={"kafka_bootstrap": None, "database_url": None}))
    shutil.rmtree(data_dir, ignore_errors=True)


SUITE_DATABASE: list[str] = []  # the suite's database URL, once base_settings has one


async def _drop_backlog(url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute("DELETE FROM facts")
        await conn.execute("DELETE FROM kv_models")
        await conn.execute("DELETE FROM turns WHERE extracted_at IS NULL")
    finally:
        await conn.close()


@pytest.fixture(scope="module", autouse=True)
def no_backlog_between_modules():
    """Each module leaves no work behind: the shared database's turns waiting for extraction,
    its facts and its registered models are removed after it. The suites' drains take every
    pending item, so a module's leftovers became the next module's work: the 1,900 facts the
    retrieval tests store without KV, encoded with SmolLM2 by the serving tests' first drain,
    took 15 minutes on 2 cores and looked like a stuck forward pass (#38). Facts with KV go
    too: a worker registering a model enrols every live fact for it."""
    yield
    if SUITE_DATABASE:  # on a thread of its own: this thread's event loop belongs to pytest
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, _drop_backlog(SUITE_DATABASE[0])).result(timeout=120)


@pytest.fixture
def settings(base_settings: Settings) -> Settings:
    """Per-test topics and consumer group, so tests never see each other's messages."""
    tag = uuid.uuid4().hex[:8]
    return base_settings.model_copy(update={
        "turns_topic": f"turns-{tag}",
        "dead_letter_topic": f"turns-{tag}.dlq",
        "consumer_group": f"ingest-{tag}",
    })


@pytest.fixture(scope="session")
async def engine(base_settings: Settings):
    from inferscale.db.engine import create_engine

    engine = create_engine(base_settings.database_url)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
def embedder(base_settings: Settings):
    from inferscale.pipeline.embedder import load_embedder

    return load_embedder(base_settings)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, prepared from the PyPI wheel (cached across runs)."""
    from inferscale.core.model_prep import PREPARED_NAME, prepare_model

    return prepare_model(Path.home() / ".cache" / "inferscale-test" / PREPARED_NAME)


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """The real Gemma 3 270M base model, prepared from its PyPI packages (cached across runs)."""
    from inferscale.core.model_prep import SHIPPED, prepare_model

    return prepare_model(Path.home() / ".cache" / "inferscale-test" /
                         SHIPPED["gemma3-270m"].folder, "gemma3-270m")


@pytest.fixture(scope="session")
def tiny_models(smollm2_dir, tmp_path_factory) -> dict[str, Path]:
    """Seeded tiny random models of every supported family (``models.KINDS``), fp32."""
    from models import KINDS, tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: tiny_model(kind, smollm2_dir, root / kind) for kind in KINDS}


@pytest.fixture(scope="session")
def tiny_encoder(tiny_models):
    """The tiny Llama as a fact encoder (fp32, CPU)."""
    import torch

    from inferscale.kv.encoder import FactEncoder

    return FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)


class Server:
    """A running `inferscale serve` (vLLM + connector + front end) for tests."""

    def __init__(self, settings: Settings, url: str, extra_args: list[str], log_path: Path):
        self.settings = settings
        self.url = url
        self.extra_args = extra_args
        self.log_path = log_path
        self.process = None

    def start(self) -> None:
        """Start `inferscale serve` as a user would, and wait until the server is healthy."""
        from inferscale.core.settings import settings_env
        from inferscale.serving.serve import wait_ready

        lay_key(self.settings.data_dir)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "inferscale.cli", "serve", "--", *self.extra_args],
                env=settings_env(self.settings), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(self.url, self.process, timeout_s=600)
        except Exception:
            self.stop()
            raise RuntimeError(f"server failed:\n{self.log_path.read_text()[-4000:]}") from None

    def stop(self) -> None:
        """SIGTERM `inferscale serve` alone; it must stop its vLLM processes (no orphans)."""
        import psutil

        if self.process is None:
            return
        children = psutil.Process(self.process.pid).children(recursive=True)
        self.process.terminate()
        self.process.wait(60)
        self.process = None
        _, alive = psutil.wait_procs(children, timeout=30)
        for orphan in alive:
            orphan.kill()
        assert not alive, f"`inferscale serve` left orphans after SIGTERM: {alive}"

    def chat(self, user: str | None, question: str, mode: str | None = None, k: int | None = None,
             max_tokens: int = 24, headers: dict | None = None, recompute: object = None,
             order: object = None, lead: object = None, key_scales: object = None, **extra):
        import httpx

        body = {"model": "inferscale", "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens, "temperature": 0, **extra}
        if user is not None:
            body["user"] = user
        options = {key: v for key, v in (("mode", mode), ("k", k), ("recompute", recompute),
                                         ("order", order), ("lead", lead),
                                         ("key_scales", key_scales)) if v is not None}
        if options:
            body["inferscale"] = options
        return httpx.post(f"{self.url}/v1/chat/completions", json=body,
                          headers={**AUTH, **(headers or {})}, timeout=120)


def lay_key(data_dir: Path) -> None:
    """The suite's key as the local admin key of a server using ``data_dir``."""
    path = key_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SUITE_KEY + "\n")
    path.chmod(0o600)


@contextlib.contextmanager
def running_server(settings: Settings, log_path: Path, extra_args: list[str]):
    """Start `inferscale serve` on a free port for a test module; stop it afterwards."""
    port = infra._free_port()
    # Tail recompute off: these servers test the injection itself, every retrieved fact as KV
    # (tests that recompute ask for it per request).
    settings = settings.model_copy(update={"server_port": port, "vllm_kv_cache_gib": 1,
                                           "recompute_tail": 0})
    server = Server(settings, f"http://127.0.0.1:{port}", extra_args, log_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


BUCKET = "inferscale-test"


@contextlib.contextmanager
def _moto_server():
    """moto_server on a free port: its endpoint and credentials."""
    port = infra._free_port()
    moto = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not endpoints.port_open(port):
            assert moto.poll() is None and time.monotonic() < deadline, "moto_server died"
            time.sleep(0.1)
        yield {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test"}
    finally:
        moto.terminate()
        moto.wait(10)


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3 endpoint holding the bucket ``BUCKET``: compose.yaml's MinIO under
    INFERSCALE_TEST_COMPOSE=1, else moto_server; AWS_* in the environment point boto3 at it.
    Tests keep to prefixes of their own (MinIO's bucket outlives a module)."""
    import boto3

    with contextlib.ExitStack() as stack:
        server = COMPOSE_S3 if COMPOSE_MODE else stack.enter_context(_moto_server())
        env = {**server, "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
               "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        mp.delenv("AWS_PROFILE", raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        client = boto3.client("s3")
        if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=BUCKET)
        yield env["AWS_ENDPOINT_URL"]


@pytest.fixture(scope="session")
def served(base_settings, smollm2_dir, tmp_path_factory):
    """One `inferscale serve` with the real SmolLM2 for the serving suites."""
    root = tmp_path_factory.mktemp("serving")
    settings = base_settings.model_copy(update={
        "model_path": smollm2_dir, "kv_dir": root / "kv", "data_dir": root, "window": 3,
        "top_k": 5})
    with running_server(settings, root / "server.log",
                        ["--enable-prompt-tokens-details", "--enforce-eager"]) as server:
        yield server


@pytest.fixture(scope="session")
def smol(served, smollm2_dir):
    """SmolLM2's encoder and the server's KV store."""
    from inferscale.contracts.fingerprint import model_fingerprint
    from inferscale.kv.encoder import FactEncoder
    from inferscale.kv.store import KVStore

    encoder = FactEncoder(smollm2_dir, device="cpu")
    store = KVStore.from_settings(served.settings, model_fingerprint(smollm2_dir),
                                  host_bytes=1 << 30)
    return encoder, store
