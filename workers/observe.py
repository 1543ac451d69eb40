"""Worker observability: Prometheus metrics, liveness and readiness over one small HTTP port."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("inferscale.worker.http")

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
    """GET /metrics, /healthz (both stages alive: a liveness probe restarts a worker whose
    encode stage died), /readyz (consumer assigned and both stages alive)."""

    def __init__(self) -> None:
        self.ready = False
        self.alive = True
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            path = request.split()[1].decode() if len(request.split()) > 1 else "/"
            if path == "/metrics":
                status, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest()
            elif path == "/healthz":
                status = 200 if self.alive else 503
                ctype, body = "text/plain", b"ok" if self.alive else b"encode stage died"
            elif path == "/readyz":
                status = 200 if self.ready else 503
                ctype, body = "text/plain", b"ready" if self.ready else b"not ready"
            else:
                status, ctype, body = 404, "text/plain", b"not found"
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: "
                         f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()
