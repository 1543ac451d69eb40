"""The one thread a worker's model calls run on, with a watchdog on each call.

A forward pass that never returns (a deadlocked thread pool, a wedged driver) cannot be
interrupted from Python. So every blocking model call of a stage runs on one long-lived daemon
thread (one OpenMP team for the process's model work, and a stuck call never blocks the
process's exit), and the awaiting coroutine gives up after ``deadline_s``: it raises
``ModelCallStuck`` naming the call and the thread's current stack, so the stage dies visibly
(the worker's probes answer 503 with the reason) while the lease of the work it held runs out
and another worker takes it.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class ModelCallStuck(RuntimeError):
    """A model call ran past its deadline; the message ends with the thread's innermost
    frames."""

    def __init__(self, name: str, deadline_s: float, where: str):
        super().__init__(f"{name} still running after {deadline_s:g} s; the model thread is at:"
                         f"\n{where}")


class ModelThread:
    """Runs blocking calls one at a time, in order, on a daemon thread of its own."""

    def __init__(self, name: str = "model") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, loop, future = job
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    def where(self, frames: int = 12) -> str:
        """The thread's current stack, innermost ``frames`` frames."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            return "(idle)"
        return "".join(traceback.format_stack(frame)[-frames:]).rstrip()

    async def run(self, name: str, call: Callable[[], T], deadline_s: float) -> T:
        """Run ``call`` on the thread; raise ``ModelCallStuck`` if it is not done within
        ``deadline_s`` (the call itself goes on: a thread cannot be stopped)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((call, loop, future))
        try:
            return await asyncio.wait_for(asyncio.shield(future), deadline_s)
        except TimeoutError:
            raise ModelCallStuck(name, deadline_s, self.where()) from None

    def close(self) -> None:
        """End the thread once the calls already queued are done (a stuck one: never)."""
        self._jobs.put(None)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
