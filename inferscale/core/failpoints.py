"""Named fault points for drills: crash or fail a process at an exact step of its work.

Armed from ``INFERSCALE_FAILPOINTS`` (read once at import) or with :func:`arm`, as a comma list
of ``name=action[@probability][~needle]``; actions are ``kill`` (SIGKILL this process: no
cleanup, no flush, like a power cut), ``hang`` (block the calling thread for good, like a call
that never returns) or ``error:ENOSPC`` / ``error:EACCES`` (raise that
``OSError``); with ``~needle`` the point acts only when the text it is passed contains needle
(a poison input). Example: ``INFERSCALE_FAILPOINTS="kv.mid_write=kill@0.02"``. Unarmed points
cost one dict lookup; a point that fires logs ``failpoint <name> fired: <action>`` first.

Points: ``ingest.before_db_commit``, ``ingest.before_offset_commit``, ``extract.before_model``
(a batch of turns about to enter the extractor; its text: the turns' texts),
``extract.before_db_commit`` (facts extracted, not yet committed), ``kv.mid_write`` (half of
the blob written to its temp file, not synced; on S3: before the PUT), ``kv.before_rename``
(temp file synced, not yet renamed; on S3: before the PUT), ``encode.before_forward`` (a
batch about to enter the model; its text: the facts' texts), ``encode.before_db_commit``
(blobs in place, their rows not yet committed), ``kv.evict.before_delete`` (evicted facts'
rows committed, their blobs not yet deleted).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import threading

POINTS = ("ingest.before_db_commit", "ingest.before_offset_commit", "extract.before_model",
          "extract.before_db_commit", "kv.mid_write", "kv.before_rename",
          "encode.before_forward", "encode.before_db_commit", "kv.evict.before_delete")

_armed: dict[str, tuple[str, float, str]] = {}  # name -> (action, probability, needle)
log = logging.getLogger(__name__)


def arm(spec: str) -> None:
    """Replace the armed points with ``spec`` (empty disarms all)."""
    armed = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rest = item.partition("=")
        rest, _, needle = rest.partition("~")
        action, _, probability = rest.partition("@")
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
        if action not in ("kill", "hang") and not (action.startswith("error:")
                                     and hasattr(errno, action.removeprefix("error:"))):
            raise ValueError(f"bad failpoint action {action!r}: use kill, hang or error:<ERRNO>")
        armed[name] = (action, float(probability or 1.0), needle)
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
    code = getattr(errno, action.removeprefix("error:"))
    raise OSError(code, f"{os.strerror(code)} (failpoint {name})")


arm(os.environ.get("INFERSCALE_FAILPOINTS", ""))
