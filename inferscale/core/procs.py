"""Process helpers shared by the embedded infrastructure and the KV store."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


def process_cpus() -> set[int]:
    """The CPUs some thread of this process may run on. A thread may be pinned to fewer: libgomp
    pins the initial thread to the first CPU of ``GOMP_CPU_AFFINITY``, which vLLM's CPU worker
    sets, and every thread started from it inherits that one CPU."""
    cpus = set(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                cpus |= os.sched_getaffinity(int(tid))
    return cpus


def run_on_process_cpus() -> None:
    """Let the calling thread run on all of ``process_cpus()`` (a thread pool's initializer)."""
    os.sched_setaffinity(0, process_cpus())


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this pid exists (a zombie child of ours counts as dead)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (once), so the ``finally`` blocks that
    stop child processes run as they do on Ctrl-C."""

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut cleanup
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
