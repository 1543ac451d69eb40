"""The local admin key: what makes a one-machine server safe with no set-up.

A server started with no ``INFERSCALE_API_KEYS`` (and anonymous memory not chosen) makes one
random admin key, kept in ``<data_dir>/api_key`` with mode 0600, and accepts it; the CLI, the
Python client and the demo on the same machine read it from there when they talk to a loopback
server (``key_for``), so nothing extra is typed. The file is the secret: only its owner can read
it, and nothing here logs the key. ``INFERSCALE_API_KEY`` in the environment wins over the file.

Pure stdlib: the memory client imports this without the engine.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
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


def ensure_key(data_dir: Path) -> tuple[str, bool]:
    """This data directory's admin key, made (0600, atomically: two servers starting at once
    agree) where there is none; and whether it was made now."""
    path = key_path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        existing = read_key(data_dir)
        if existing is None:
            raise ValueError(f"{path} holds no key: remove it to make a new one") from None
        return existing, False
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    return key, True


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
