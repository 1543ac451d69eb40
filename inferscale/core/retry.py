"""The one retry policy for transient broker and database errors (tenacity)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

T = TypeVar("T")
MAX_DELAY_S = 10.0


def is_transient_db_error(exc: BaseException) -> bool:
    """Connection-level failures worth retrying (database restarting, network blips)."""
    import asyncpg
    from sqlalchemy.exc import DBAPIError, OperationalError

    connection_errors = (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                         asyncpg.CannotConnectNowError, asyncpg.AdminShutdownError)
    if isinstance(exc, (OperationalError, *connection_errors)):
        return True
    return isinstance(exc, DBAPIError) and (
        exc.connection_invalidated or isinstance(exc.orig, connection_errors)
        or isinstance(getattr(exc.orig, "__cause__", None), connection_errors))


def backoff() -> wait_exponential:
    """0.2 s, doubling, at most ``MAX_DELAY_S``."""
    return wait_exponential(multiplier=0.2, max=MAX_DELAY_S)


async def retry_transient(action: Callable[[], Awaitable[T]],
                          on_retry: Callable[[BaseException, float], None],
                          transient: Callable[[BaseException], bool] = is_transient_db_error,
                          stop: asyncio.Event | None = None) -> T:
    """Run ``action`` until it succeeds or fails with a non-transient error; before each retry
    ``on_retry(error, delay)`` is called (it may raise to give up), then a backoff sleep that
    ``stop`` cuts short (the next attempt, or ``on_retry``, then sees it set)."""
    def before_sleep(state: RetryCallState) -> None:
        # tenacity sleeps only after an attempt that raised (``retry_if_exception``)
        assert state.outcome is not None
        error = state.outcome.exception()
        assert error is not None
        on_retry(error, state.upcoming_sleep)

    async def sleep(seconds: float) -> None:
        if stop is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)

    async for attempt in AsyncRetrying(retry=retry_if_exception(transient), wait=backoff(),
                                       before_sleep=before_sleep, sleep=sleep, reraise=True):
        with attempt:
            return await action()
    raise AssertionError("unreachable: tenacity reraises the last error")
