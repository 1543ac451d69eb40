"""`inferscale serve`: vLLM OpenAI server with the InferScale connector and memory front end."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from inferscale.core.endpoints import InfraError, resolve_kafka_bootstrap
from inferscale.core.local_key import ensure_key, key_path
from inferscale.core.model_prep import resolve_model_path
from inferscale.core.settings import KeyGrant, Settings, settings_env
from inferscale.db.engine import resolve_database_url

log = logging.getLogger("inferscale.serving.serve")
KV_TRANSFER_CONFIG = {
    "kv_connector": "InferScaleConnector",
    "kv_connector_module_path": "inferscale.serving.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def ensure_preamble_kv(settings: Settings, model_path: Path) -> None:
    """The preamble blob must exist before the first injected request; encode it if missing."""
    from inferscale.contracts.blob_name import PREAMBLE
    from inferscale.contracts.fingerprint import model_fingerprint
    from inferscale.kv.encoder import ensure_preamble, load_encoder
    from inferscale.kv.store import KVStore

    store = KVStore.from_settings(settings, model_fingerprint(model_path), host_bytes=0)
    if not store.exists(PREAMBLE):
        ensure_preamble(load_encoder(settings.model_copy(update={"model_path": model_path})),
                        store)


def api_keys_in(vllm_args: list[str]) -> list[str]:
    """The values of vLLM's ``--api-key`` in a vLLM command line (``--api-key A B``, ``=A``)."""
    keys, taking = [], False
    for arg in vllm_args:
        if arg.startswith("--api-key="):
            keys.append(arg.split("=", 1)[1])
            taking = False
        elif arg == "--api-key":
            taking = True
        elif taking and not arg.startswith("-"):
            keys.append(arg)
        else:
            taking = False
    return keys


def without_api_keys(vllm_args: list[str]) -> list[str]:
    """A vLLM command line less its ``--api-key`` values (the front end checks them)."""
    kept, taking = [], False
    for arg in vllm_args:
        if arg.startswith("--api-key="):
            taking = False
        elif arg == "--api-key":
            taking = True
        elif not (taking and not arg.startswith("-")):
            taking = False
            kept.append(arg)
    return kept


def memory_keys(settings: Settings, vllm_keys: list[str]) -> dict[str, KeyGrant]:
    """The API keys memory accepts: the configured ones; else, where the operator chose it
    (``vllm_keys_for_memory``), vLLM's own ``--api-key`` values as admin keys; else, unless
    anonymous memory was chosen, the local admin key (made on first use;
    ``core/local_key.py``). A generation client's vLLM key reads no memory by default. Says at
    start which policy runs (never the key itself, except once, where it was just made, as the
    link of the memory inspector on the terminal that started the server)."""
    if settings.api_keys:
        log.info("memory: %d API keys configured", len(settings.api_keys))
        return settings.api_keys
    if vllm_keys and settings.vllm_keys_for_memory:
        log.info("memory: vLLM's --api-key values are the admin keys (no INFERSCALE_API_KEYS)")
        return {key: KeyGrant(owners=["*"]) for key in vllm_keys}
    if settings.allow_anonymous:
        log.warning("memory: INFERSCALE_ALLOW_ANONYMOUS is on: anyone who reaches this server "
                    "reads and changes every owner's memory without a key")
        return {}
    key, made = ensure_key(settings.data_dir)
    log.info("memory: requests need an API key; this machine's admin key is in %s (the CLI, "
             "client and demo here use it)", key_path(settings.data_dir))
    if made and sys.stderr.isatty():
        print(f"memory inspector: http://{settings.server_host}:{settings.server_port}/memory"
              f"#key={key}", file=sys.stderr)
    return {key: KeyGrant(owners=["*"])}


def server_command(settings: Settings, extra_args: list[str] | None = None
                   ) -> tuple[list[str], dict[str, str]]:
    """The vLLM server command line and environment for these settings (the served model's
    calibration applied, and said)."""
    from inferscale.contracts.fingerprint import model_fingerprint
    from inferscale.kv.key_scales import resolve_for_server
    from inferscale.serving.calibration import calibrated

    model_path = resolve_model_path(settings)
    recompute, chosen = calibrated(settings, model_fingerprint(model_path))
    log.info("%s", chosen)
    metrics_dir = settings.data_dir / "prometheus" / str(settings.server_port)
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    extra_args = list(extra_args or [])
    vllm_keys = [key for key in settings.vllm_api_keys or api_keys_in(extra_args)
                 or [os.environ.get("VLLM_API_KEY", "")] if key]
    extra_args = without_api_keys(extra_args)
    try:
        bootstrap = resolve_kafka_bootstrap(settings)
    except InfraError:
        bootstrap = None  # serving works without a broker; invalidations then stay local
    child = settings.model_copy(update={
        "kafka_bootstrap": bootstrap,
        "database_url": resolve_database_url(settings), "model_path": model_path,
        "kv_dir": settings.kv_path, "plan_secret": settings.plan_secret or secrets.token_hex(32),
        "key_scales": resolve_for_server(settings.key_scales, model_path),
        "vllm_api_keys": vllm_keys,
        "api_keys": memory_keys(settings, vllm_keys), **recompute})
    env = {
        **settings_env(child),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                 str(settings.vllm_kv_cache_gib)),
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("VLLM_API_KEY", None)  # checked by the front end (``vllm_api_keys``), not by vLLM
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path), "--served-model-name", "inferscale",
        "--host", settings.server_host, "--port", str(settings.server_port),
        "--max-model-len", str(settings.max_model_len),
        "--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG),
        "--middleware", "inferscale.serving.frontend.MemoryFrontend",
        "--worker-extension-cls", "inferscale.serving.connector.InferScaleWorkerExtension",
        *extra_args,
    ]
    return argv, env


def check_model(model_path: Path) -> None:
    """Refuse a model that pre-RoPE reuse cannot serve, naming why, before vLLM starts
    (``UnsupportedModel``)."""
    from transformers import AutoConfig

    from inferscale.kv.model_family import attention_shape

    attention_shape(AutoConfig.from_pretrained(model_path))


def start_server(settings: Settings, extra_args: list[str] | None = None,
                 log_path: Path | None = None) -> subprocess.Popen:
    """Start the server in the background (after refusing a model it cannot serve and making
    sure the preamble KV and the query embedder's ONNX export exist, so the first request pays
    for neither)."""
    model_path = resolve_model_path(settings)
    check_model(model_path)
    ensure_preamble_kv(settings, model_path)
    from inferscale.pipeline.embedder import Embedder, onnx_cache

    if (cache := onnx_cache(settings)) is not None:
        Embedder(settings.embedder, onnx_cache=cache)  # makes the export; not kept in memory
    argv, env = server_command(settings, extra_args)
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned by the process
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    """Block until ``url``/health answers 200; raise if the server exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM server exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"vLLM server not ready after {timeout_s}s")


def stop_server(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM the server's process group, then SIGKILL if it lingers."""
    import signal

    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
