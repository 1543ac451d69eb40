"""The one retry policy (tenacity): what is retried, how long it waits, how it gives up."""

import asyncio
import time

import pytest

from inferscale.core.retry import retry_transient


async def test_transient_errors_are_retried_with_a_growing_backoff():
    calls, delays = [], []

    async def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionRefusedError("database restarting")
        return "ok"

    assert await retry_transient(flaky, lambda exc, delay: delays.append(delay)) == "ok"
    assert delays == [0.2, 0.4, 0.8]


async def test_other_errors_and_a_refusing_callback_end_the_retries():
    async def broken():
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError):
        await retry_transient(broken, lambda exc, delay: None)

    async def down():
        raise ConnectionRefusedError("down")

    def give_up(exc, delay):
        raise exc

    with pytest.raises(ConnectionRefusedError):
        await retry_transient(down, give_up)


async def test_stop_cuts_the_backoff_short():
    stop = asyncio.Event()

    async def down_until_stopped():
        if stop.is_set():
            return "stopped"
        raise ConnectionRefusedError("down")

    asyncio.get_running_loop().call_later(3.5, stop.set)  # within the 3.0 -> 6.2 s sleep
    began = time.monotonic()
    assert await retry_transient(down_until_stopped, lambda exc, delay: None, stop=stop) == (
        "stopped")
    assert time.monotonic() - began < 5.5  # not 6.2 s: the sleep ended when stop was set
