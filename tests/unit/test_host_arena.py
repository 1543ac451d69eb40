"""Host arena: page-in buffers reused once every view of them is gone, within a byte cap."""

import gc
import random
import threading
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.contracts.blob_name import fact_blob
from inferscale.kv.durable import LocalDir
from inferscale.kv.host_arena import CHUNK, GRANULE, HostArena
from inferscale.kv.store import KVStore


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_block_returns_only_when_its_last_view_is_gone():
    arena = HostArena(4 * CHUNK)
    block = arena.take(3 * GRANULE + 1)
    block[:] = 7
    tensor = torch.frombuffer(memoryview(block)[GRANULE:], dtype=torch.uint8)
    address = _address(block)
    del block
    gc.collect()
    assert arena.free_bytes() == CHUNK - 4 * GRANULE  # the tensor still reads the block
    assert _address(arena.take(GRANULE)) != address
    assert int(tensor.sum()) == 7 * (2 * GRANULE + 1)
    del tensor
    gc.collect()
    assert _address(arena.take(4 * GRANULE)) == address  # reused, already faulted in


def test_past_its_cap_it_hands_out_fresh_memory():
    arena = HostArena(CHUNK)
    held = [arena.take(CHUNK // 2) for _ in range(2)]
    extra = arena.take(GRANULE)
    assert arena.mapped == CHUNK and extra.base is None  # fresh, its own memory
    big = arena.take(2 * CHUNK)
    assert big.size == 2 * CHUNK and arena.mapped == CHUNK
    assert all(b.flags.writeable for b in (*held, extra, big))


def test_a_block_larger_than_a_chunk_gets_a_mapping_of_its_own():
    arena = HostArena(4 * CHUNK)
    big = arena.take(CHUNK + 1)
    assert arena.mapped == CHUNK + GRANULE and big.size == CHUNK + 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3 * GRANULE), st.booleans()), min_size=1,
                max_size=60), st.integers(0, 2**32))
def test_blocks_never_overlap_and_freed_space_merges_back(sizes, seed):
    arena = HostArena(16 * GRANULE, chunk_bytes=8 * GRANULE)  # two chunks, then fresh memory
    live: list[np.ndarray] = []
    rng = random.Random(seed)
    for size, release in sizes:
        live.append(arena.take(size))
        assert live[-1].size == size
        if release:
            live.pop(rng.randrange(len(live)))
        spans = sorted((_address(b), _address(b) + b.size) for b in live if b.base is not None)
        assert all(end <= start for (_, end), (start, _) in pairwise(spans))
    live.clear()
    assert arena.free_bytes() == arena.mapped  # every block back, the spans merged whole
    assert arena.mapped == 0 or arena.take(8 * GRANULE).base is not None


def test_concurrent_takes_and_frees_stay_consistent():
    arena = HostArena(64 * GRANULE, chunk_bytes=16 * GRANULE)

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            block = arena.take(rng.randrange(1, 4 * GRANULE))
            block[:8] = seed

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert arena.free_bytes() == arena.mapped and 0 < arena.mapped <= arena.cap


@pytest.mark.parametrize("host_bytes", [0, 1 << 30])
def test_page_ins_decode_the_same_from_the_arena(tmp_path, host_bytes):
    writer = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=0)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn((3, 5, 2, 16), generator=g).to(torch.bfloat16) for _ in range(2))
    stored = writer.put(fact_blob(3), k, v, [1] * 5, window=0)
    reader = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=host_bytes)
    blob = reader.get(stored.location, stored.checksum)
    assert torch.equal(blob.k, k) and torch.equal(blob.v, v)
    assert reader.arena.mapped == CHUNK  # with no host tier too (PAGE_IN_ARENA_MIN)
