"""Named fault points for drills: crash or fail a process at an exact step of its work.

Armed from ``INFERSCALE_FAILPOINTS`` (read once at import) or with :func:`arm`, as a comma list
of ``name=action[@probability][~needle]``; actions are ``kill`` (SIGKILL this process: no
cleanup, no flush, like a power cut), ``hang`` (block the calling thread for good, like a call
that never returns), ``delay:<seconds>`` (block it that long, up to 60 s: a slow disk or
store) or ``error:ENOSPC`` / ``error:EACCES`` (raise that ``OSError``); with ``~needle`` the
point acts only when the text it is passed contains needle (a poison input). Example:
``INFERSCALE_FAILPOINTS="kv.mid_write=kill@0.02"``. Unarmed points cost one dict lookup; a
point that fires logs ``failpoint <name> fired: <action>`` first.

``INFERSCALE_FAILPOINTS_FILE`` names a file of the same spec that a daemon thread re-reads
whenever it changes (checked every ``WATCH_S``), so a drill arms and disarms points of a
running process for a while (a disk full for a minute); a missing or empty file disarms all, a
bad spec is logged and leaves the points as they were.

Points: ``ingest.before_db_commit``, ``ingest.before_offset_commit``, ``extract.before_model``
(a batch of turns about to enter the extractor; its text: the turns' texts),
``extract.before_db_commit`` (facts extracted, not yet committed), ``kv.mid_write`` (half of
the blob written to its temp file, not synced; on S3: before the PUT), ``kv.before_rename``
(temp file synced, not yet renamed; on S3: before the PUT), ``kv.read`` (a read of the
durable tier: one blob, or one batch of a folder's files), ``encode.before_forward`` (a
batch about to enter the model; its text: the facts' texts), ``encode.before_db_commit``
(blobs in place, their rows not yet committed), ``kv.evict.before_delete`` (evicted facts'
rows committed, their blobs not yet deleted), ``changes.before_drop`` (change events
published, not yet dropped from the outbox).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import threading
import time
from pathlib import Path

POINTS = ("ingest.before_db_commit", "ingest.before_offset_commit", "extract.before_model",
          "extract.before_db_commit", "kv.mid_write", "kv.before_rename", "kv.read",
          "encode.before_forward", "encode.before_db_commit", "kv.evict.before_delete",
          "changes.before_drop")

MAX_DELAY_S = 60.0
WATCH_S = 0.5
_armed: dict[str, tuple[str, float, str]] = {}  # name -> (action, probability, needle)
log = logging.getLogger(__name__)


def _valid_action(action: str) -> bool:
    kind, _, value = action.partition(":")
    if kind == "error":
        return hasattr(errno, value)
    if kind == "delay":
        try:
            return 0 < float(value) <= MAX_DELAY_S
        except ValueError:
            return False
    return action in ("kill", "hang")


def arm(spec: str) -> None:
    """Replace the armed points with ``spec`` (empty disarms all)."""
    armed = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rest = item.partition("=")
        rest, _, needle = rest.partition("~")
        action, _, probability = rest.partition("@")
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
        if not _valid_action(action):
            raise ValueError(f"bad failpoint action {action!r}: use kill, hang, "
                             f"delay:<seconds up to {MAX_DELAY_S:g}> or error:<ERRNO>")
        try:
            chance = float(probability or 1.0)
        except ValueError:
            chance = -1.0
        if not 0 <= chance <= 1:
            raise ValueError(f"bad failpoint probability {probability!r}: a number in [0, 1]")
        armed[name] = (action, chance, needle)
    _armed.clear()
    _armed.update(armed)


def hit(name: str, text: str = "") -> None:
    """Pass the point ``name`` (with the ``text`` it works on): act as armed (with its
    probability, if ``text`` contains the needle), else do nothing."""
    armed = _armed.get(name)
    if armed is None or armed[2] not in text or random.random() >= armed[1]:
        return
    action = armed[0]
    log.warning("failpoint %s fired: %s", name, action)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        threading.Event().wait()
    if action.startswith("delay:"):
        time.sleep(float(action.removeprefix("delay:")))
        return
    code = getattr(errno, action.removeprefix("error:"))
    raise OSError(code, f"{os.strerror(code)} (failpoint {name})")


def watch(path: Path, stop: threading.Event) -> None:
    """Arm the points ``path`` names whenever its content changes, until ``stop`` is set."""
    seen = ""  # until the file says otherwise, INFERSCALE_FAILPOINTS stands
    while not stop.is_set():
        try:
            spec = path.read_text()
        except (FileNotFoundError, UnicodeDecodeError):
            spec = ""
        except OSError as exc:
            log.error("failpoints file %s unreadable: %s", path, exc)
            spec = seen
        if spec != seen:
            try:
                arm(spec)
                log.warning("failpoints armed from %s: %r", path, spec.strip())
            except ValueError as exc:
                log.error("failpoints file %s: %s; points unchanged", path, exc)
            seen = spec
        stop.wait(WATCH_S)


arm(os.environ.get("INFERSCALE_FAILPOINTS", ""))
if _file := os.environ.get("INFERSCALE_FAILPOINTS_FILE"):
    threading.Thread(target=watch, args=(Path(_file), threading.Event()), daemon=True,
                     name="failpoints-watch").start()
