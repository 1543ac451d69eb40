"""Per-process CPU time from schedstat (bench ttft's "where the cores went")."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from inferscale.lab.bench.cpu import per_process, thread_times


def _task(proc: Path, pid: int, tid: int, name: str, schedstat: str) -> None:
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True)
    (proc / str(pid) / "comm").write_text(name + "\n")
    (task / "schedstat").write_text(schedstat)


def test_thread_times_skips_what_it_cannot_read(tmp_path):
    _task(tmp_path, 10, 10, "engine", "5000000 2000000 7\n")
    _task(tmp_path, 10, 11, "engine", "not numbers\n")
    _task(tmp_path, 20, 21, "api", "1 2\n")  # too few fields
    (tmp_path / "30" / "task" / "31").mkdir(parents=True)  # no comm, no schedstat
    (tmp_path / "self").mkdir()
    assert thread_times(tmp_path) == {(10, 10): ("engine", 5_000_000, 2_000_000)}


def test_per_process_sums_threads_per_name_per_request():
    before = {(1, 1): ("engine", 10_000_000, 0), (1, 2): ("engine", 0, 0),
              (2, 2): ("api", 5_000_000, 1_000_000), (3, 3): ("idle", 0, 0)}
    after = {(1, 1): ("engine", 30_000_000, 4_000_000), (1, 2): ("engine", 10_000_000, 0),
             (1, 4): ("engine", 20_000_000, 2_000_000),  # started in between
             (2, 2): ("api", 9_000_000, 1_000_000), (3, 3): ("idle", 1_000_000, 0)}
    assert per_process(before, after, 2) == {
        "engine": {"cpu_ms": 25.0, "runqueue_wait_ms": 3.0},
        "api": {"cpu_ms": 2.0, "runqueue_wait_ms": 0.0},
    }  # "idle": 0.5 ms per request, under the 1 ms shown
    assert list(per_process(before, after, 0)) == ["engine", "api", "idle"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")
def test_a_busy_thread_shows_its_cpu_time():
    if not Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat").exists():
        pytest.skip("kernel without schedstat")
    before = thread_times()
    spent = time.thread_time() + 0.05
    while time.thread_time() < spent:  # 50 ms of this thread's CPU, however long that takes
        pass
    after = thread_times()
    key = (os.getpid(), threading.get_native_id())
    assert after[key][1] - before[key][1] >= 40_000_000
