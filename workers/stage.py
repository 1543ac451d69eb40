"""The loop every batch stage of a worker shares: batch after batch, woken early by ``wake``,
polling every ``poll_s`` when idle, waiting out database restarts."""

from __future__ import annotations

import asyncio
import logging
import time

from inferscale.core.retry import retry_transient

log = logging.getLogger("inferscale.stage")


class BatchStage:
    """Subclasses handle one batch in ``handle_batch`` (returning how many items it took)."""

    def __init__(self, wake: asyncio.Event | None = None, poll_s: float = 1.0):
        self.wake = wake or asyncio.Event()
        self.poll_s = poll_s
        self._stop = asyncio.Event()
        self._drain = False

    async def handle_batch(self) -> int:
        raise NotImplementedError

    async def before_batch(self) -> None:
        """Called before each batch."""

    async def after_batch(self, busy_s: float) -> None:
        """Called after each batch that handled something, with its duration."""

    def request_stop(self) -> None:
        """Finish the current batch and stop."""
        self._stop.set()
        self.wake.set()

    def request_drain(self) -> None:
        """Stop once nothing is left to do."""
        self._drain = True
        self.wake.set()

    async def run_batches(self, drain: bool = False) -> None:
        """Handle batches until stopped (or, with ``drain``, until nothing is left)."""
        while not self._stop.is_set():
            await self.before_batch()
            began = time.monotonic()
            try:
                handled = await retry_transient(self.handle_batch, self._db_retry,
                                                stop=self._stop)
            except Exception:
                if self._stop.is_set():  # the database is down and we are asked to stop
                    break
                raise
            if handled:
                await self.after_batch(time.monotonic() - began)
                continue
            if drain or self._drain:
                break
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), self.poll_s)
            except TimeoutError:
                pass

    def _db_retry(self, exc: BaseException, delay: float) -> None:
        """Wait for the database while it restarts, unless stopping."""
        if self._stop.is_set():
            raise exc
        log.warning("database unavailable (%s); retrying in %.1fs", type(exc).__name__, delay)
