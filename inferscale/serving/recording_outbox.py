"""Recorded turns on their way to the turn topic, kept until the broker has them.

A recording (one request's turns) is queued and published in order by one delivery task: the
head is retried with the one backoff (``core/retry.py``) while the broker is down or restarting,
so a broker restart loses no recorded turn; only an error that no retry can mend (a record the
broker refuses for its size, a bad topic name) drops it, logged and counted. At most
``max_turns`` turns wait: past that a new recording is refused (dropped, logged, counted), never
an old one. Turn ids come from the request, so publishing a recording twice (a retry after an
acknowledgement that got lost) stores it once. ``close`` waits up to its grace for what is
queued and says how many turns it leaves behind (they are lost with the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial

from aiokafka.errors import InvalidTopicError, MessageSizeTooLargeError

from inferscale.contracts.events import TurnEvent
from inferscale.core.retry import retry_transient
from inferscale.serving.metrics import FRONTEND_METRICS as M

log = logging.getLogger("inferscale.serving.recording_outbox")
Publish = Callable[[list[TurnEvent]], Awaitable[None]]
UNMENDABLE = (MessageSizeTooLargeError, InvalidTopicError, ValueError, TypeError)


class RecordingOutbox:
    """Recordings published in order, each retried until the broker acknowledges it."""

    def __init__(self, publish: Publish, max_turns: int):
        self._publish = publish
        self._max_turns = max_turns
        self._queue: deque[list[TurnEvent]] = deque()
        self._held = 0  # turns queued, the one in flight included
        self._delivery: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def held(self) -> int:
        """Turns not yet acknowledged by the broker."""
        return self._held

    def put(self, turns: list[TurnEvent]) -> bool:
        """Queue one recording (False: refused, the outbox is full or closing)."""
        if self._closing or self._held + len(turns) > self._max_turns:
            log.error("recording %d turns of %s dropped: %d turns already wait for the broker "
                      "(record_outbox_turns %d)%s", len(turns), turns[0].user_id, self._held,
                      self._max_turns, ", closing" if self._closing else "")
            M.recorded_turns.labels("dropped").inc(len(turns))
            return False
        self._queue.append(turns)
        self._held += len(turns)
        if self._delivery is None or self._delivery.done():
            self._delivery = asyncio.get_running_loop().create_task(self._deliver())
        return True

    async def _deliver(self) -> None:
        while self._queue:
            turns = self._queue[0]
            try:
                await retry_transient(partial(self._publish, turns), self._retrying,
                                      transient=lambda exc: not isinstance(exc, UNMENDABLE))
            except Exception as exc:  # noqa: BLE001 - no retry mends it: logged and counted
                log.error("recording %d turns of %s dropped: %s", len(turns), turns[0].user_id,
                          getattr(exc, "detail", exc))
                M.recorded_turns.labels("failed").inc(len(turns))
            else:
                M.recorded_turns.labels("published").inc(len(turns))
            self._queue.popleft()
            self._held -= len(turns)

    def _retrying(self, error: BaseException, delay: float) -> None:
        head = self._queue[0]
        log.warning("recording %d turns of %s: the broker did not take them (%s); again in "
                    "%.1f s, %d turns waiting", len(head), head[0].user_id,
                    getattr(error, "detail", error), delay, self._held)
        M.recorded_turns.labels("retried").inc(len(head))

    async def close(self, grace_s: float) -> int:
        """Stop taking recordings, wait up to ``grace_s`` for the queued ones; returns how many
        turns are left unpublished (logged and counted as lost)."""
        self._closing = True
        if self._delivery is not None and not self._delivery.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._delivery), grace_s)
            self._delivery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._delivery
        if self._held:
            log.error("%d recorded turns lost: the broker did not take them before shutdown",
                      self._held)
            M.recorded_turns.labels("lost").inc(self._held)
        return self._held
