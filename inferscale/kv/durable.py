"""The durable KV tier: whole blobs as bytes, by relative location ("<fp16>/<shard>/<name>...").

Two backends behind one interface: :class:`LocalDir` (a directory; atomic writes by temp file,
fsync, rename) and :class:`S3Objects` (an S3-compatible bucket; one PUT is atomic).
:func:`open_durable` picks one from the settings. A location is a relative, ``/``-separated path
with no empty, ``.``-led (``..``, hidden, temp) or backslashed part: anything else names no blob,
so no location reaches outside the directory or key prefix. Failures of the storage itself
(disk full, bucket unreachable) raise ``OSError``, as a local disk would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Generator, Hashable, Iterator
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy

from inferscale.core import failpoints
from inferscale.core.procs import pid_alive, process_cpus

if TYPE_CHECKING:
    from inferscale.core.settings import Settings

_read_files: ModuleType | None
try:  # the C reads (optional: built where a C compiler was at install)
    from inferscale.kv import _read_files
except ImportError:
    _read_files = None

S3_CONNECTIONS = 32  # pooled HTTP connections of one S3 client, shared by all its threads
S3_MAX_ATTEMPTS = 3  # botocore "standard" retries: throttling, 5xx, connection errors
# A page-in waits on these while a request waits for its first token: a blob (~1 MB) that takes
# longer is better recomputed by the engine than waited for (botocore's defaults are 60 s).
S3_CONNECT_TIMEOUT_S = 2.0
S3_READ_TIMEOUT_S = 5.0
S3_DELETE_BATCH = 1000  # keys per DeleteObjects request (the S3 maximum)

Alloc = Callable[[int], numpy.ndarray]  # size -> a writable uint8 buffer of that many bytes
Read = tuple[bytes | memoryview, Hashable | None]  # a blob's bytes and version
# Files read in one call (readahead of all of them first): the first batch on the caller's
# thread, the others on the reading threads while the caller checks what came before.
READ_BATCH = 8
# A file changed this recently has no version (see ``file_version``): a change within the
# timestamps' granularity (a clock tick) of the last one could leave them as they were.
RACY_S = 2.0


def fresh_buffer(size: int) -> numpy.ndarray:
    """Uninitialised memory of its own (``bytearray`` would zero it first)."""
    return numpy.empty(size, dtype=numpy.uint8)


class KVBlobError(RuntimeError):
    """A blob that cannot be used; serving falls back to prefilling the fact's text."""

    reason = "error"

    def __init__(self, location: str, detail: str):
        super().__init__(f"{self.reason}: {location}: {detail}")
        self.location = location


class BlobMissing(KVBlobError):
    reason = "missing"


def valid_location(location: str) -> bool:
    """Whether ``location`` can name a blob (see the module docstring)."""
    return ("\\" not in location and "\0" not in location
            and all(part and not part.startswith(".") for part in location.split("/")))


class Durable(ABC):
    """Blobs by location; a written blob is visible whole or not at all."""

    read_threads = 8  # reads worth running at once: a bucket's reads wait on the network

    def read(self, location: str, alloc: Alloc | None = None) -> bytes | memoryview:
        """The blob's bytes (a writable buffer where the backend fills one in place, taken from
        ``alloc(size)``, by default ``fresh_buffer``); ``BlobMissing`` when there is none."""
        return self.read_versioned(location, alloc)[0]

    def read_many(self, locations: list[str], alloc: Alloc | None = None,
                  pool: Executor | None = None) -> Generator[Read | None, None, None]:
        """``read_versioned`` of each blob, in order, as they come (later ones may be read on
        ``pool`` meanwhile), where the storage reads many at once; None for one it did not read
        (the caller then reads it as usual, and learns why). Most storage cannot: all None."""
        yield from [None] * len(locations)

    def read_versioned(self, location: str, alloc: Alloc | None = None
                       ) -> tuple[bytes | memoryview, Hashable | None]:
        """``read``, and the version of the blob read: two reads with equal versions read the
        same stored bytes. None where the backend cannot tell."""
        if not valid_location(location):
            raise BlobMissing(location, "not a blob location")
        failpoints.hit("kv.read")
        return self._read(location, alloc or fresh_buffer)

    def write(self, location: str, data: bytes) -> None:
        """Store ``data`` atomically (replacing any blob there); ``ValueError`` for a location
        that cannot name a blob."""
        if not valid_location(location):
            raise ValueError(f"not a blob location: {location!r}")
        self._write(location, data)

    def exists(self, location: str) -> bool:
        return valid_location(location) and self._exists(location)

    def delete(self, location: str) -> bool:
        """Remove the blob; whether there was one."""
        return valid_location(location) and self._delete(location)

    def delete_many(self, locations: list[str]) -> int:
        """Remove the blobs; how many there were (each location counted once)."""
        return sum(self.delete(location) for location in dict.fromkeys(locations))

    def list(self, prefix: str = "") -> Iterator[str]:
        """Locations of every blob under the folder ``prefix`` ("" or ending in "/"); none
        for a prefix that is not a folder location."""
        if prefix and not (prefix.endswith("/") and valid_location(prefix[:-1])):
            return iter(())
        return self._list(prefix)

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[str]: ...

    @abstractmethod
    def folders(self) -> Iterator[str]:
        """Names of the top-level folders (one per model)."""

    @abstractmethod
    def sweep_temp(self) -> int:
        """Remove what writers that died mid-write left; returns how many."""

    @abstractmethod
    def _read(self, location: str, alloc: Alloc
              ) -> tuple[bytes | memoryview, Hashable | None]: ...

    @abstractmethod
    def _write(self, location: str, data: bytes) -> None: ...

    @abstractmethod
    def _exists(self, location: str) -> bool: ...

    @abstractmethod
    def _delete(self, location: str) -> bool: ...


@dataclass(frozen=True)
class _Opened:
    """A file open for a whole read: its descriptor, a buffer of its size, its stat."""

    fd: int
    buffer: memoryview
    stat: os.stat_result


def _opened(root: Path, location: str, alloc: Alloc | None) -> _Opened | None:
    """The file at ``location`` opened, with a buffer of its size from ``alloc``; None if it
    cannot be opened (or the location names no blob)."""
    if not valid_location(location):
        return None
    try:
        fd = os.open(root / location, os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.fstat(fd)
        # numpy's stubs declare ndarray.__buffer__ for Python 3.12+ only
        buffer = memoryview((alloc or fresh_buffer)(stat.st_size))  # type: ignore[arg-type]
    except BaseException:
        os.close(fd)
        raise
    return _Opened(fd, buffer, stat)


def _files(batch: list[_Opened | None]) -> list[_Opened]:
    return [file for file in batch if file is not None]


def _close(batch: list[_Opened | None]) -> None:
    for file in _files(batch):
        os.close(file.fd)


def _read_whole(files: list[_Opened]) -> list[bool]:
    """Whether each file filled its buffer and ends there, readahead of all of them asked for
    first: in one call where ``_read_files`` is built, else calls of their own."""
    try:
        failpoints.hit("kv.read")
    except OSError:  # each file is then read alone, and that read says why
        return [False] * len(files)
    whole: list[bool] = []
    if _read_files is not None:
        whole = _read_files.read_files([f.fd for f in files], [f.buffer for f in files])
        return whole
    for file in files:
        with contextlib.suppress(OSError):  # a file system without readahead
            os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_WILLNEED)
    for file in files:
        try:
            whole.append(os.preadv(file.fd, [file.buffer], 0) == file.buffer.nbytes
                         and not os.pread(file.fd, 1, file.buffer.nbytes))
        except OSError:
            whole.append(False)
    return whole


def file_version(stat: os.stat_result) -> tuple[int, ...] | None:
    """A file's identity, size and change times: any write, truncation or replacement of the
    file changes them (the kernel sets the change time; no call sets it back). None while the
    last change is under ``RACY_S`` old: a change within the same clock tick could leave the
    times as they were (git calls such files "racily clean")."""
    if time.time() - stat.st_ctime < RACY_S:
        return None
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


class LocalDir(Durable):
    """A directory; writes go to a temp file (``.<name>.<pid>.<thread>.tmp``, mode 0600: an
    owner's memory is for this account only), are fsynced and renamed into place."""

    def __init__(self, root: Path):
        self.root = Path(root)
        # A read from the page cache, and its hash, keep a CPU busy: more threads than CPUs
        # only queue on the GIL (k = 50 on 2 CPUs: 17 ms with 2 threads, 26 ms with 8).
        self.read_threads = len(process_cpus())

    def read_many(self, locations: list[str], alloc: Alloc | None = None,
                  pool: Executor | None = None) -> Generator[Read | None, None, None]:
        """The files read ``READ_BATCH`` at a time, each batch in one call that holds no GIL
        (where ``_read_files`` is built) after asking for readahead of all its files (the disk
        reads them together): the first batch on the caller's thread, the next ones on
        ``pool`` (one per reading thread at a time) while the caller checks the files before.
        None for a file not read whole (not there, or changed size). At most the files of the
        batches in flight are open."""
        starts = iter(range(0, len(locations), READ_BATCH))
        # the batch being checked and those read meanwhile (one per thread), files open
        pending: deque[tuple[list[_Opened | None], Future[list[bool]] | None]] = deque()

        def start() -> None:
            """Open the next batch's files and, past the first, read them on the pool."""
            if (at := next(starts, None)) is None:
                return
            batch: list[_Opened | None] = []
            pending.append((batch, None))  # its files are closed whatever happens
            for location in locations[at:at + READ_BATCH]:
                batch.append(_opened(self.root, location, alloc))
            if pool and at:
                pending[-1] = (batch, pool.submit(_read_whole, _files(batch)))

        try:
            for _ in range(1 + (self.read_threads if pool else 0)):
                start()
            while pending:
                batch, reading = pending[0]
                whole = iter(reading.result() if reading else _read_whole(_files(batch)))
                for file in batch:
                    yield (file.buffer, file_version(file.stat)) if file and next(whole) else None
                _close(pending.popleft()[0])
                start()
        finally:
            wait([reading for _, reading in pending if reading])  # no file is closed mid-read
            for batch, _ in pending:
                _close(batch)

    def _read(self, location: str, alloc: Alloc) -> tuple[memoryview, Hashable | None]:
        """The file read with one copy into a buffer from ``alloc``, which the decoded tensors
        then view (``read_bytes`` gives immutable bytes), and its version before the read."""
        try:
            with (self.root / location).open("rb", buffering=0) as f:
                stat = os.fstat(f.fileno())
                # numpy's stubs declare ndarray.__buffer__ for Python 3.12+ only
                buffer = memoryview(alloc(stat.st_size))  # type: ignore[arg-type]
                if f.readinto(buffer) != stat.st_size or f.read(1):
                    raise OSError(errno.EIO, f"{location} changed size while it was read")
                return buffer, file_version(stat)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise BlobMissing(location, "no such blob") from None

    def _write(self, location: str, data: bytes) -> None:
        path = self.root / location
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(data[:len(data) // 2])
                failpoints.hit("kv.mid_write")
                f.write(data[len(data) // 2:])
                f.flush()
                os.fsync(f.fileno())
            failpoints.hit("kv.before_rename")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    def _exists(self, location: str) -> bool:
        return (self.root / location).is_file()

    def _delete(self, location: str) -> bool:
        path = self.root / location
        if not path.is_file():
            return False
        path.unlink(missing_ok=True)
        return True

    def _list(self, prefix: str) -> Iterator[str]:
        for path in (self.root / prefix).rglob("*"):
            location = path.relative_to(self.root).as_posix()
            if valid_location(location) and path.is_file():
                yield location

    def folders(self) -> Iterator[str]:
        if self.root.is_dir():
            yield from (d.name for d in self.root.iterdir() if d.is_dir())

    def sweep_temp(self) -> int:
        """Remove temp files of writers whose pid is gone."""
        removed = 0
        for tmp in self.root.glob("*/*/.*.tmp"):
            try:
                pid = int(tmp.name.rsplit(".", 3)[-3])
            except (ValueError, IndexError):
                continue
            if pid != os.getpid() and not pid_alive(pid):
                tmp.unlink(missing_ok=True)
                removed += 1
        return removed


class S3Objects(Durable):
    """Objects ``<prefix>/<location>`` in an S3-compatible bucket, through one boto3 client
    (thread-safe, pooled connections, botocore's standard retries). Endpoint, region and
    credentials come the usual AWS way (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
    Opening checks the bucket: a wrong name or credentials fail at start with ``OSError``,
    not later as every blob "missing"."""

    def __init__(self, bucket: str, prefix: str = ""):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self._client = boto3.client("s3", config=Config(
            max_pool_connections=S3_CONNECTIONS, connect_timeout=S3_CONNECT_TIMEOUT_S,
            read_timeout=S3_READ_TIMEOUT_S,
            retries={"mode": "standard", "max_attempts": S3_MAX_ATTEMPTS}))
        self._check_bucket()

    def _check_bucket(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        where = f"s3://{self.bucket} at {self._client.meta.endpoint_url}"
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("404", "NoSuchBucket"):
                raise OSError(errno.ENOENT, f"{where}: no such bucket") from None
            if code in ("403", "AccessDenied"):
                raise OSError(errno.EACCES, f"{where}: access denied (credentials?)") from None
            raise OSError(errno.EIO, f"{where}: {exc}") from exc
        except BotoCoreError as exc:
            raise OSError(errno.EIO, f"{where}: {exc}") from exc

    @contextlib.contextmanager
    def _errors(self, location: str, missing: str = "NoSuchKey") -> Iterator[None]:
        """``BlobMissing`` for the error code ``missing``, ``OSError`` for any other failure."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (BotoCoreError, ClientError) as exc:
            if (isinstance(exc, ClientError)
                    and exc.response.get("Error", {}).get("Code") == missing):
                raise BlobMissing(location, "no such blob") from None
            raise OSError(errno.EIO, f"s3://{self.bucket}/{self.prefix}{location}: {exc}") from exc

    def _read(self, location: str, alloc: Alloc) -> tuple[bytes, None]:
        with self._errors(location):  # the client's own buffer: no copy into alloc's
            response = self._client.get_object(Bucket=self.bucket, Key=self.prefix + location)
            return response["Body"].read(), None

    def _write(self, location: str, data: bytes) -> None:
        # Nothing is sent before both points: a crash at either leaves no object.
        failpoints.hit("kv.mid_write")
        failpoints.hit("kv.before_rename")
        with self._errors(location):
            self._client.put_object(Bucket=self.bucket, Key=self.prefix + location, Body=data)

    def _exists(self, location: str) -> bool:
        try:
            with self._errors(location, missing="404"):
                self._client.head_object(Bucket=self.bucket, Key=self.prefix + location)
        except BlobMissing:
            return False
        return True

    def _delete(self, location: str) -> bool:
        if not self._exists(location):
            return False
        with self._errors(location):
            self._client.delete_object(Bucket=self.bucket, Key=self.prefix + location)
        return True

    def delete_many(self, locations: list[str]) -> int:
        """HEAD requests in parallel (to count what was there), then DeleteObjects by 1,000."""
        from concurrent.futures import ThreadPoolExecutor

        candidates = [loc for loc in dict.fromkeys(locations) if valid_location(loc)]
        with ThreadPoolExecutor(S3_CONNECTIONS) as pool:
            present = [loc for loc, there in zip(candidates, pool.map(self._exists, candidates),
                                                 strict=True) if there]
        for start in range(0, len(present), S3_DELETE_BATCH):
            batch = present[start:start + S3_DELETE_BATCH]
            with self._errors(batch[0]):
                response = self._client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self.prefix + loc} for loc in batch], "Quiet": True})
            if errors := response.get("Errors"):
                raise OSError(errno.EIO, f"s3://{self.bucket}: {len(errors)} of {len(batch)} "
                                         f"deletes failed, first: {errors[0]}")
        return len(present)

    def _pages(self, prefix: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        with self._errors(prefix):
            yield from self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix, **kwargs)

    def _list(self, prefix: str) -> Iterator[str]:
        for page in self._pages(prefix):
            for item in page.get("Contents", []):
                location = item["Key"][len(self.prefix):]
                if valid_location(location):
                    yield location

    def folders(self) -> Iterator[str]:
        for page in self._pages("", Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                yield common["Prefix"][len(self.prefix):].rstrip("/")

    def sweep_temp(self) -> int:
        """Nothing to sweep: a blob is one PUT (no temp object, no multipart upload)."""
        return 0


def open_durable(settings: Settings) -> Durable:
    """The durable tier the settings name: ``kv_url`` s3://bucket/prefix, else ``kv_path``."""
    s3 = settings.kv_bucket
    return LocalDir(settings.kv_path) if s3 is None else S3Objects(s3.bucket, s3.prefix)
