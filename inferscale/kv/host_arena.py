"""Host memory for blobs paged in from the durable tier: reused, huge-page-backed buffers.

Reading a 1 MB blob into fresh memory faults its pages in one 4 KiB page at a time: on this
host 51 such blobs (a k = 50 page-in) took 22.6 ms to read into fresh buffers, 4.0 ms into one
mapping advised for huge pages and 3.2 ms into memory already faulted in (docs/results/ttft.md). The
arena maps chunks advised for transparent huge pages and hands out blocks of them first-fit. A
block goes back to the arena when the last view of it (a decoded blob's tensors) is freed, so
memory evicted from the host tier is reused already faulted in. Past its byte cap, or where a
block does not fit, it hands out fresh memory. Page-ins bound for a GPU go to pinned memory
instead (``pinned_buffer``).
"""

from __future__ import annotations

import bisect
import collections
import mmap
import threading
import weakref

import numpy as np
import torch

from inferscale.kv.durable import fresh_buffer

GRANULE = 64 << 10  # block sizes are multiples of this
CHUNK = 64 << 20  # bytes mapped at a time (a larger block gets a mapping of its own)


def pinned_buffer(size: int) -> np.ndarray:
    """``size`` bytes of page-locked memory from PyTorch's caching host allocator (reused once
    the array and its views are gone), for page-ins bound for a GPU."""
    buffer: np.ndarray = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
    return buffer


def _rounded(size: int) -> int:
    return max(GRANULE, -(-size // GRANULE) * GRANULE)


class HostArena:
    """Blocks of huge-page-advised chunks (``chunk_bytes`` each) mapped once and never
    unmapped, at most ``cap_bytes`` in all. Thread-safe: finalizers only queue a freed block;
    ``take`` returns them."""

    def __init__(self, cap_bytes: int, chunk_bytes: int = CHUNK):
        self.cap = cap_bytes
        self.chunk = _rounded(chunk_bytes)
        self.mapped = 0
        self._chunks: list[np.ndarray] = []
        self._free: list[list[tuple[int, int]]] = []  # per chunk: sorted (start, size) spans
        self._freed: collections.deque[tuple[int, int, int]] = collections.deque()
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """A writable uint8 array of ``size`` bytes: a block of the arena (back in it once the
        array and every view of it are gone) or, past the cap, fresh memory."""
        need = _rounded(size)
        with self._lock:
            self._return_freed()
            place = self._fit(need)
            if place is None and self.mapped + max(need, self.chunk) <= self.cap:
                place = self._map(max(need, self.chunk), need)
        if place is None:
            return fresh_buffer(size)
        chunk, start = place
        block = self._chunks[chunk][start:start + size]
        weakref.finalize(block, self._freed.append, (chunk, start, need))
        return block

    def free_bytes(self) -> int:
        """Bytes of mapped blocks not handed out (freed blocks counted once returned)."""
        with self._lock:
            self._return_freed()
            return sum(size for spans in self._free for _, size in spans)

    def _fit(self, need: int) -> tuple[int, int] | None:
        for chunk, spans in enumerate(self._free):
            for i, (start, size) in enumerate(spans):
                if size >= need:
                    if size == need:
                        del spans[i]
                    else:
                        spans[i] = (start + need, size - need)
                    return chunk, start
        return None

    def _map(self, nbytes: int, need: int) -> tuple[int, int]:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)
        self._chunks.append(np.frombuffer(memory, dtype=np.uint8))
        self._free.append([(need, nbytes - need)] if nbytes > need else [])
        self.mapped += nbytes
        return len(self._chunks) - 1, 0

    def _return_freed(self) -> None:
        """Put the blocks freed since into their chunks' free spans, merged with neighbours."""
        while self._freed:
            chunk, start, size = self._freed.popleft()
            spans = self._free[chunk]
            i = bisect.bisect(spans, (start, size))
            if i < len(spans) and start + size == spans[i][0]:
                size += spans.pop(i)[1]
            if i > 0 and spans[i - 1][0] + spans[i - 1][1] == start:
                start, size = spans[i - 1][0], spans[i - 1][1] + size
                i -= 1
                del spans[i]
            spans.insert(i, (start, size))
