"""A local directory's reads of a request's blobs in batches (``_read_files.c``, and the
per-file reads that stand in where it is not built): in order, with or without threads; a file
counts as read only when it filled its buffer exactly; hostile arguments raise, never crash."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy
import pytest

from hostile import open_under
from inferscale.kv import durable as durable_module
from inferscale.kv.durable import READ_BATCH, LocalDir

built = importlib.util.find_spec("inferscale.kv._read_files")
needs_reads = pytest.mark.skipif(built is None, reason="built without a compiler")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_the_reads_are_built_where_a_compiler_is():
    assert built is not None and built.origin is not None
    source = Path(durable_module.__file__).with_name("_read_files.c")
    assert Path(built.origin).stat().st_mtime >= source.stat().st_mtime


@pytest.fixture(params=["C", "per file"])
def reads(request, monkeypatch):
    """LocalDir's batched reads, with the C reads or without them."""
    if request.param == "C" and built is None:
        pytest.skip("built without a compiler")
    if request.param == "per file":
        monkeypatch.setattr(durable_module, "_read_files", None)
    return request.param


@pytest.mark.parametrize("threads", [0, 2])
def test_read_many_gives_whole_files_in_order_and_none_for_the_rest(tmp_path, reads, threads):
    folder = tmp_path / "ab"
    folder.mkdir()
    sizes = {"a": 1, "b": 300_000, "c": 0, "d": 8192}
    for name, size in sizes.items():
        (folder / name).write_bytes(numpy.random.default_rng(size).bytes(size))
    (folder / "dir").mkdir()
    durable = LocalDir(tmp_path)
    names = ["ab/b", "ab/missing", "ab/a", "..", "ab/dir", "ab/c", "/etc/passwd", "ab/d"] * 3
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(threads)) if threads else None
        got = list(durable.read_many(names, pool=pool))
    assert len(got) == len(names) > READ_BATCH
    for name, read in zip(names, got, strict=True):
        if name.removeprefix("ab/") in sizes:
            assert read is not None and bytes(read[0]) == (tmp_path / name).read_bytes()
        else:
            assert read is None
    assert list(durable.read_many([])) == []


def test_only_the_batches_in_flight_hold_files_open(tmp_path, reads):
    names = [f"f{i}" for i in range(12 * READ_BATCH)]
    for name in names:
        (tmp_path / name).write_bytes(name.encode())
    durable = LocalDir(tmp_path)
    durable.read_threads = 2
    most = 0
    with ThreadPoolExecutor(2) as pool:
        for name, read in zip(names, durable.read_many(names, pool=pool), strict=True):
            assert read is not None and bytes(read[0]) == name.encode()
            most = max(most, len(open_under(tmp_path)))
    assert 0 < most <= 3 * READ_BATCH < len(names)
    assert not open_under(tmp_path)


def test_a_buffer_of_another_size_is_not_a_whole_read(tmp_path, reads):
    """A file that grew or shrank between its size and its read is not read whole."""
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 4096)
    calls = []

    def off_by(size: int) -> numpy.ndarray:
        calls.append(size)
        return numpy.empty(size + (1 if len(calls) == 1 else -1), dtype=numpy.uint8)

    assert list(LocalDir(tmp_path).read_many(["blob", "blob"], off_by)) == [None, None]
    assert calls == [4096, 4096]


def test_a_failed_allocation_loses_no_file(tmp_path, reads):
    """An allocation that fails mid-batch raises, and every file opened before it is closed."""
    for name in "abcdefghijkl":
        (tmp_path / name).write_bytes(b"z" * 64)
    calls = []

    def failing(size: int) -> numpy.ndarray:
        calls.append(size)
        if len(calls) == READ_BATCH + 3:
            raise MemoryError("no buffer")
        return numpy.empty(size, dtype=numpy.uint8)

    with ThreadPoolExecutor(2) as pool, pytest.raises(MemoryError):
        list(LocalDir(tmp_path).read_many(list("abcdefghijkl"), failing, pool))
    assert not open_under(tmp_path)


@needs_reads
def test_hostile_arguments_to_the_c_reads_raise_and_bad_files_are_not_read(tmp_path):
    from inferscale.kv import _read_files

    path = tmp_path / "blob"
    path.write_bytes(b"y" * 100)
    buffer = numpy.empty(100, dtype=numpy.uint8)
    fd = os.open(path, os.O_RDONLY)
    folder = os.open(tmp_path, os.O_RDONLY)
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)
    try:
        assert _read_files.read_files([fd, closed, folder], [buffer] * 3) == [True, False, False]
        assert bytes(buffer) == b"y" * 100
        # a buffer too small for the file, or too large
        for size in (0, 99, 101):
            assert _read_files.read_files([fd], [numpy.empty(size, dtype=numpy.uint8)]) == [False]
        assert _read_files.read_files([], []) == []
        for fds, buffers, error in [
                ([fd], [], ValueError), ([fd], [b"x" * 100], (TypeError, BufferError)),
                ([-1], [buffer], ValueError), ([1 << 40], [buffer], (ValueError, OverflowError)),
                (["3"], [buffer], TypeError), (fd, [buffer], TypeError),
                ([fd], [buffer[::2]], (TypeError, BufferError, ValueError)),
                ([fd], [memoryview(b"x" * 100)], (TypeError, BufferError))]:
            with pytest.raises(error):
                _read_files.read_files(fds, buffers)
    finally:
        os.close(fd)
        os.close(folder)
