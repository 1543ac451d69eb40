"""Folders and files only their owner reads: the data directory (0700) and the secrets in it
(0600), so other accounts on a shared machine see neither facts, KV nor passwords."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

# Running as root, the embedded Postgres runs as a user of its own (``devstack/infra.py``) that
# must traverse the data directory to its pgdata: others' x bit (no listing) stays then.
_TRAVERSE = 0o001


def private_dir(path: Path) -> Path:
    """``path`` made (with any missing parents) mode 0700, or, where it exists and is ours,
    with the group's and others' bits taken off (others' x kept when we are root)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = path.stat()
    loose = 0o077 & ~(_TRAVERSE if os.geteuid() == 0 else 0)
    if status.st_uid == os.geteuid() and status.st_mode & loose:
        path.chmod(status.st_mode & 0o7777 & ~loose)
    return path


def write_once(path: Path, text: str) -> bool:
    """Write ``text`` to a new file ``path`` (mode 0600) unless one exists; whether it was
    written. Atomic: processes starting at once agree, and none reads a half-written file."""
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.link(draft, path)  # the whole file appears at once, or not at all if one exists
    except FileExistsError:
        return False
    finally:
        draft.unlink(missing_ok=True)
    return True
