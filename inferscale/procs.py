"""Process helpers shared by the embedded infrastructure and the KV store."""

from __future__ import annotations

import os


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
