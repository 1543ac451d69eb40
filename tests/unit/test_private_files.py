"""Private folders and secret files (``core/private_files.py``): the data directory is its
owner's alone, secrets are written once, whole, 0600."""

import os
import stat
import threading

import pytest

from inferscale.core.private_files import private_dir, write_once

# Running as root, others keep the x bit (the embedded Postgres's own user passes through).
TRAVERSE = 0o001 if os.geteuid() == 0 else 0


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_folder_and_its_missing_parents_are_made_private(tmp_path):
    folder = private_dir(tmp_path / "data" / "infra")
    assert folder.is_dir() and _mode(folder) == 0o700


@pytest.mark.parametrize("loose", [0o755, 0o775, 0o777, 0o711])
def test_an_existing_folder_of_ours_is_tightened(tmp_path, loose):
    folder = tmp_path / "data"
    folder.mkdir()
    folder.chmod(loose)
    private_dir(folder)
    assert _mode(folder) == 0o700 | (loose & TRAVERSE)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_folder_of_someone_else_is_left_as_it_is(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    os.chown(folder, 65534, 65534)  # nobody
    private_dir(folder)
    assert _mode(folder) == 0o755


def test_a_secret_is_written_once_and_private(tmp_path):
    path = tmp_path / "secret"
    assert write_once(path, "first\n")
    assert not write_once(path, "second\n")
    assert path.read_text() == "first\n" and _mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]  # no draft left behind


def test_writers_at_once_agree_on_one_secret(tmp_path):
    path = tmp_path / "secret"
    won: list[str] = []
    threads = [threading.Thread(target=lambda i=i: write_once(path, f"{i}\n") and won.append(i))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and path.read_text() == f"{won[0]}\n"
