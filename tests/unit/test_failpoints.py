"""Failpoints: the spec language (hostile specs refused whole), the delay action, and arming a
running process from a file (``INFERSCALE_FAILPOINTS_FILE``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.core import failpoints
from inferscale.kv.durable import LocalDir


@pytest.fixture(autouse=True)
def disarmed():
    failpoints.arm("")
    yield
    failpoints.arm("")


def test_an_armed_error_raises_that_errno_and_disarming_stops_it():
    failpoints.arm("kv.read=error:ENOSPC")
    with pytest.raises(OSError) as raised:
        failpoints.hit("kv.read")
    assert raised.value.errno == 28
    failpoints.hit("kv.mid_write")  # another point: untouched
    failpoints.arm("")
    failpoints.hit("kv.read")


def test_delay_blocks_the_caller_for_that_long_and_then_lets_it_go_on():
    failpoints.arm("kv.read=delay:0.2")
    began = time.monotonic()
    failpoints.hit("kv.read")
    assert time.monotonic() - began >= 0.2


def test_a_needle_limits_the_point_to_matching_text():
    failpoints.arm("encode.before_forward=error:EIO~poison")
    failpoints.hit("encode.before_forward", "a clean fact")
    with pytest.raises(OSError):
        failpoints.hit("encode.before_forward", "a poison fact")


@pytest.mark.parametrize("spec", [
    "nowhere=kill", "kv.read=explode", "kv.read=error:ENOTANERRNO", "kv.read=delay:0",
    "kv.read=delay:-1", "kv.read=delay:61", "kv.read=delay:nan", "kv.read=delay:inf",
    "kv.read=delay:", "kv.read=kill@1.5", "kv.read=kill@-0.1", "kv.read=kill@x",
    "kv.read=kill@nan", "kv.read", "kv.read=error:ENOSPC,kv.read=nope"])
def test_a_bad_spec_is_refused_whole_and_leaves_the_points_as_they_were(spec):
    failpoints.arm("kv.mid_write=error:EIO")
    with pytest.raises(ValueError):
        failpoints.arm(spec)
    with pytest.raises(OSError):
        failpoints.hit("kv.mid_write")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_spec_either_arms_or_raises_value_error(spec):
    try:
        failpoints.arm(spec)
    except ValueError:
        pass
    failpoints.arm("")


def _wait_until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the watcher did not act in time"
        time.sleep(0.05)


def _armed(point: str) -> bool:
    try:
        failpoints.hit(point)
    except OSError:
        return True
    return False


def test_a_watched_file_arms_and_disarms_a_running_process(tmp_path: Path, caplog):
    spec_file = tmp_path / "failpoints"
    failpoints.arm("kv.mid_write=error:EIO")  # as INFERSCALE_FAILPOINTS would
    stop = threading.Event()
    watcher = threading.Thread(target=failpoints.watch, args=(spec_file, stop), daemon=True)
    watcher.start()
    try:
        time.sleep(3 * failpoints.WATCH_S)
        assert _armed("kv.mid_write"), "a missing file must leave the points from the environment"
        spec_file.write_text("kv.read=error:ENOSPC\n")
        _wait_until(lambda: _armed("kv.read"))
        assert not _armed("kv.mid_write")  # the file's spec replaced the points
        spec_file.write_text("kv.read=error:NOPE")  # a bad spec: logged, points unchanged
        _wait_until(lambda: "points unchanged" in caplog.text)
        assert _armed("kv.read")
        spec_file.write_text("")
        _wait_until(lambda: not _armed("kv.read"))
        spec_file.write_text("kv.read=error:EIO")
        _wait_until(lambda: _armed("kv.read"))
        spec_file.unlink()  # gone: disarmed
        _wait_until(lambda: not _armed("kv.read"))
    finally:
        stop.set()
        watcher.join(5)
    assert not watcher.is_alive()


def test_a_failing_durable_read_fails_each_blob_alone_and_loses_nothing(tmp_path: Path):
    store = LocalDir(tmp_path)
    locations = [f"model/owner/fact-{n}.kv" for n in range(3)]
    for n, location in enumerate(locations):
        store.write(location, bytes([n]) * 64)
    failpoints.arm("kv.read=error:EIO")
    assert list(store.read_many(locations)) == [None, None, None]  # the batch read fails...
    with pytest.raises(OSError) as raised:
        store.read(locations[0])  # ...and so does each read on its own, saying why
    assert raised.value.errno == 5
    failpoints.arm("kv.read=delay:0.1")
    began = time.monotonic()
    assert bytes(store.read(locations[2])) == bytes([2]) * 64  # slow, but whole
    assert time.monotonic() - began >= 0.1
    failpoints.arm("")
    assert [bytes(read[0]) for read in store.read_many(locations)] == [
        bytes([n]) * 64 for n in range(3)]

