"""The key a client sends: the one given, else ``INFERSCALE_API_KEY``, else, for a server on
this machine (a loopback URL), the local admin key ``inferscale serve`` keeps in
``<data_dir>/api_key``. The local key is never sent to any other URL and never logged.

Pure stdlib: the server's side (``inferscale/core/local_key.py``, which makes the key) reuses
these readers, so both agree on where the key is and who may receive it.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

KEY_FILE = "api_key"
KEY_ENV = "INFERSCALE_API_KEY"


def default_data_dir() -> Path:
    """The data directory the settings use by default (``INFERSCALE_DATA_DIR`` or
    ``~/.inferscale``)."""
    return Path(os.environ.get("INFERSCALE_DATA_DIR") or Path.home() / ".inferscale")


def key_path(data_dir: Path) -> Path:
    return data_dir / KEY_FILE


def read_key(data_dir: Path) -> str | None:
    """The key kept in this data directory (None: none, or unreadable); a file others may read
    is made private first."""
    path = key_path(data_dir)
    try:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        key = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return key or None


def is_loopback_host(host: str) -> bool:
    """Whether a host name is this machine's: ``localhost`` or a loopback address (127.0.0.0/8,
    ::1), never a name that merely starts like one."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback(url: str) -> bool:
    """Whether a server URL names this machine by a loopback name or address."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    return host is not None and is_loopback_host(host)


def key_for(url: str, data_dir: Path | None = None) -> str | None:
    """The key a client on this machine sends to ``url`` when none is given:
    ``INFERSCALE_API_KEY``, else the local admin key for a loopback server (never sent
    elsewhere)."""
    if given := os.environ.get(KEY_ENV):
        return given
    if not is_loopback(url):
        return None
    return read_key(data_dir or default_data_dir())
