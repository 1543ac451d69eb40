"""The local admin key: what makes a one-machine server safe with no set-up.

A server started with no ``INFERSCALE_API_KEYS`` (and anonymous memory not chosen) makes one
random admin key, kept in ``<data_dir>/api_key`` with mode 0600, and accepts it; the CLI, the
Python client and the demo on the same machine read it from there when they talk to a loopback
server (``key_for``), so nothing extra is typed. The file is the secret: only its owner can read
it, and nothing here logs the key. ``INFERSCALE_API_KEY`` in the environment wins over the file.

Making the key lives here; reading it, and the rule that it goes only to loopback URLs, live in
the client distribution (``inferscale_client/keys.py``), which clients use without the engine.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from inferscale.core.private_files import private_dir, write_once
from inferscale_client.keys import (
    KEY_ENV,
    KEY_FILE,
    default_data_dir,
    is_loopback,
    is_loopback_host,
    key_for,
    key_path,
    read_key,
)

__all__ = ["KEY_ENV", "KEY_FILE", "default_data_dir", "ensure_key", "is_loopback",
           "is_loopback_host", "key_for", "key_path", "read_key"]


def ensure_key(data_dir: Path) -> tuple[str, bool]:
    """This data directory's admin key, made (0600, atomically: two servers starting at once
    agree, and none reads a file before its key is in it) where there is none; and whether it
    was made now."""
    key = secrets.token_urlsafe(32)
    if write_once(key_path(private_dir(data_dir)), key + "\n"):
        return key, True
    existing = read_key(data_dir)
    if existing is None:
        raise ValueError(f"{key_path(data_dir)} holds no key: remove it to make a new one")
    return existing, False
