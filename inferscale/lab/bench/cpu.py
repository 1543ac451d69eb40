"""Where the cores went while a benchmark ran: CPU time and run-queue wait per process, from
Linux's per-thread scheduler statistics (``/proc/<pid>/task/<tid>/schedstat``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ThreadTimes = dict[tuple[int, int], tuple[str, int, int]]
SHOWN_MS = 1.0  # processes with less CPU than this per request are left out


def thread_times(proc: Path = Path("/proc")) -> ThreadTimes:
    """Per (pid, tid) of every thread on the machine: its process's name, and the thread's CPU
    time and time runnable but waiting for a core so far (ns). Empty without schedstat."""
    times: ThreadTimes = {}
    for task in proc.glob("[0-9]*/task/[0-9]*"):
        try:
            run_ns, wait_ns, _ = (int(field) for field in (task / "schedstat").read_text().split())
            name = (task.parent.parent / "comm").read_text().strip()
        except (OSError, ValueError):  # a thread that ended meanwhile, or no schedstat
            continue
        times[int(task.parent.parent.name), int(task.name)] = (name, run_ns, wait_ns)
    return times


def per_process(before: ThreadTimes, after: ThreadTimes, requests: int
                ) -> dict[str, dict[str, float]]:
    """ms per request of CPU and of run-queue wait between two snapshots, summed over the
    threads of each process name (threads started in between count from zero; threads that
    ended are lost), busiest first, those under ``SHOWN_MS`` of CPU left out."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, (name, run_ns, wait_ns) in after.items():
        _, run0, wait0 = before.get(key, (name, 0, 0))
        totals[name][0] += run_ns - run0
        totals[name][1] += wait_ns - wait0
    scale = 1e6 * max(1, requests)
    rows = {name: {"cpu_ms": run / scale, "runqueue_wait_ms": wait / scale}
            for name, (run, wait) in totals.items() if run / scale >= SHOWN_MS}
    return dict(sorted(rows.items(), key=lambda item: -item[1]["cpu_ms"]))
