"""The local admin key (``core/local_key.py``): made once, private, found by this machine's
clients for a loopback server and never sent anywhere else."""

import os
import stat
import threading

import pytest

from inferscale.core.local_key import KEY_ENV, ensure_key, key_for, key_path, read_key


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


def test_made_once_private_and_kept(tmp_path):
    key, made = ensure_key(tmp_path)
    assert made and len(key) >= 32
    assert stat.S_IMODE(key_path(tmp_path).stat().st_mode) == 0o600
    assert ensure_key(tmp_path) == (key, False)
    assert read_key(tmp_path) == key


def test_servers_starting_at_once_agree_on_one_key(tmp_path):
    keys: list[str] = []
    threads = [threading.Thread(target=lambda: keys.append(ensure_key(tmp_path)[0]))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1  # each got the key, none saw a half-made file


def test_a_key_file_others_may_read_is_made_private(tmp_path):
    key, _ = ensure_key(tmp_path)
    key_path(tmp_path).chmod(0o644)
    assert read_key(tmp_path) == key
    assert stat.S_IMODE(key_path(tmp_path).stat().st_mode) == 0o600


def test_an_empty_key_file_is_no_key(tmp_path):
    key_path(tmp_path).write_text("\n")
    assert read_key(tmp_path) is None
    with pytest.raises(ValueError):
        ensure_key(tmp_path)


@pytest.mark.parametrize(("url", "sent"), [
    ("http://127.0.0.1:8000", True), ("http://localhost:8000/", True), ("http://[::1]:8000", True),
    ("http://127.9.9.9", True),
    ("http://127.0.0.1.attacker.example:8000", False), ("http://localhost.attacker.example", False),
    ("http://10.0.0.5:8000", False), ("https://memory.example.com", False), ("not a url", False),
    ("http://[::1", False),
])
def test_the_local_key_goes_to_loopback_servers_only(tmp_path, url, sent):
    key, _ = ensure_key(tmp_path)
    assert key_for(url, tmp_path) == (key if sent else None)


def test_the_environment_wins(tmp_path, monkeypatch):
    ensure_key(tmp_path)
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert key_for("https://memory.example.com", tmp_path) == "from-env"
    assert key_for("http://127.0.0.1:8000", tmp_path) == "from-env"


def test_no_key_file_no_key(tmp_path):
    assert key_for("http://127.0.0.1:8000", tmp_path / "none") is None
    assert not os.path.exists(tmp_path / "none")
