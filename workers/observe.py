"""Worker observability: Prometheus metrics, liveness and readiness over one small HTTP port."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

CONSUMED = Counter("inferscale_worker_consumed", "Kafka records consumed")
TURNS_STORED = Counter("inferscale_worker_turns_stored", "New turns stored")
TURNS_EXTRACTED = Counter("inferscale_worker_turns_extracted", "Turns whose facts were stored")
FACTS_STORED = Counter("inferscale_worker_facts_stored", "New facts stored")
FACTS_RETIRED = Counter("inferscale_worker_facts_retired",
                        "Facts superseded or deleted by the update step")
EXTRACT_FALLBACKS = Counter("inferscale_worker_extract_fallbacks",
                            "Turns kept whole because the extraction model's answer was unusable")
DEAD_LETTERED = Counter("inferscale_worker_dead_lettered", "Records sent to the DLQ", ["reason"])
DB_RETRIES = Counter("inferscale_worker_db_retries", "Database retries after connection errors")
FACTS_ENCODED = Counter("inferscale_worker_facts_encoded", "Facts encoded to KV")
FACTS_REENCODED = Counter("inferscale_worker_facts_reencoded",
                          "Of those, early facts encoded again after a wider context (backfill)")
MODEL_CALLS_STUCK = Counter("inferscale_worker_model_calls_stuck",
                            "Model calls still running past their deadline (the stage then dies)",
                            ["stage"])
KV_EVICTED_FACTS = Counter("inferscale_worker_kv_evicted_facts",
                           "Facts whose KV was evicted to keep under the KV budget")
KV_EVICTED_BYTES = Counter("inferscale_worker_kv_evicted_bytes",
                           "Bytes of KV blobs evicted to keep under the KV budget")
FACTS_EXPIRED = Counter("inferscale_worker_facts_expired",
                        "Facts retired at their expires_at (their KV removed)")
CHANGES_PUBLISHED = Counter("inferscale_worker_changes_published",
                            "Change events published to the change topic")
CHANGE_RELAY_ERRORS = Counter("inferscale_worker_change_relay_errors",
                              "Change relay batches the broker refused (retried)")
CHANGES_PENDING = Gauge("inferscale_worker_changes_pending", "Change events not published yet")
KV_RESTORED_FACTS = Counter("inferscale_worker_kv_restored_facts",
                            "Facts whose evicted KV was encoded again because a request wanted it")
KV_MIGRATED_FACTS = Counter("inferscale_worker_kv_migrated_facts",
                            "Other models' KV of facts that have this worker's model's, dropped "
                            "(encode_migrate)")
KV_HELD_BYTES = Gauge("inferscale_worker_kv_held_bytes",
                      "Bytes of KV blobs live facts hold on the durable tier (with a KV budget)")
ENCODE_FAILURES = Counter("inferscale_worker_encode_failures", "Failed fact encodes")
BATCH_SECONDS = Histogram("inferscale_worker_batch_seconds", "Ingest/extract/encode batch latency",
                          ["stage"])
LAG = Gauge("inferscale_worker_lag", "Records behind the partition end", ["partition"])
PENDING_FACTS = Gauge("inferscale_worker_pending_facts",
                      "Facts waiting for their KV plus turns waiting for extraction")
PAUSED = Gauge("inferscale_worker_paused", "1 while consumption is paused by back-pressure")
GROUP_STALLED = Gauge("inferscale_worker_group_stalled",
                      "1 while this member has no partitions and the group commits nothing "
                      "although records wait")


class HealthServer:
    """GET /healthz (both stages alive: a liveness probe restarts a worker whose encode stage
    died), /readyz (consumer assigned and both stages alive), anything else: prometheus_client's
    own exposition of the metrics. Served by prometheus_client's threaded WSGI server on a
    daemon thread, so a blocked event loop still answers the probes."""

    def __init__(self) -> None:
        self.ready = False
        self.alive = True
        self.problem = ""  # why the worker is not alive (a stage's death), in both probes' body
        self._metrics = make_wsgi_app()
        self._server: WSGIServer | None = None

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            ok, body = self.alive, "ok" if self.alive else self.problem
        elif path == "/readyz":
            ok, body = self.ready, "ready" if self.ready else (self.problem or "not ready")
        else:
            return self._metrics(environ, start_response)
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8")])
        return [body.encode()]

    async def start(self, host: str, port: int) -> None:
        self._server = make_server(host, port, self._app, ThreadingWSGIServer,
                                   handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="worker-http",
                         daemon=True).start()

    async def stop(self) -> None:
        if self._server is not None:
            await asyncio.to_thread(self._server.shutdown)
            self._server.server_close()


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (probes come every few seconds)."""

    def log_message(self, format: str, *args: object) -> None:
        pass
