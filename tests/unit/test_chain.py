"""The portable injection chain (``kvchain``), its cache stand-in for GPU boxes without vLLM
(``bench.inject.flash_update``) and, where a GPU is present, the CUDA store path (pinned page-ins,
non-blocking copies). Runs with ``--noconftest`` where vLLM and the infrastructure are absent."""

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcases import kv_case, window_slots
from transformers import LlamaConfig

from inferscale.contracts.blob_name import BlobName, fact_blob
from inferscale.kv.chain import ChainWriter, LayerSlots, to_device
from inferscale.kv.durable import LocalDir
from inferscale.kv.rope import ChunkedRope
from inferscale.kv.store import KVStore
from inferscale.lab.bench.inject import flash_update

BF16 = torch.bfloat16
CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _rope(layers=2, heads=2, dim=32, device="cpu") -> ChunkedRope:
    config = LlamaConfig(hidden_size=heads * dim * 2, num_attention_heads=heads * 2,
                         num_key_value_heads=heads, num_hidden_layers=layers,
                         intermediate_size=64, vocab_size=100, max_position_embeddings=512,
                         rope_theta=10000.0)
    return ChunkedRope(config, BF16, device)


def test_staging_is_reused_grown_and_never_overlaps():
    chain = ChainWriter(_rope())
    like = torch.zeros(3, 1, 2, 4, dtype=BF16)  # [layers, tokens, heads, head_dim]
    k, v = chain.staged(10, like)
    assert k.shape == v.shape == (3, 10, 2, 4) and k.is_contiguous() and v.is_contiguous()
    k.fill_(1)
    v.fill_(2)
    assert (k == 1).all() and (v == 2).all()  # K and V do not share memory
    first = k.data_ptr()
    k_small, _ = chain.staged(4, like)  # a smaller step: the same memory
    assert k_small.data_ptr() == first
    k_big, v_big = chain.staged(50, like)  # a bigger step: grown
    assert k_big.shape == (3, 50, 2, 4)
    assert v_big.data_ptr() - k_big.data_ptr() == k_big.numel() * k_big.element_size()
    chain.release()
    assert chain._staging is None


def test_staging_follows_the_pieces_dtype():
    chain = ChainWriter(_rope())
    chain.staged(8, torch.zeros(2, 1, 1, 4, dtype=BF16))
    k, _ = chain.staged(8, torch.zeros(2, 1, 1, 4, dtype=torch.float32))
    assert k.dtype == torch.float32


def _case(gen, layers, heads, dim, lengths, skips, start, block_size, device="cpu"):
    pieces, positions, slots, scales, shape = kv_case(gen, layers, heads, dim, block_size,
                                                      lengths, skips, start, True, device)
    caches = [torch.zeros(shape, dtype=BF16, device=device) for _ in range(layers)]
    return pieces, positions, slots, scales, caches


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), data=st.data(),
       start=st.integers(0, 40), block_size=st.sampled_from([1, 16, 128]),
       scaled=st.booleans(), window=st.none() | st.integers(1, 60))
def test_the_chain_writes_each_token_rotated_at_its_slot(lengths, data, start, block_size,
                                                         scaled, window):
    """Token t of the concatenated pieces lands at its slot in every layer (one slot per
    token for all layers, or a slot table per group of layers whose sliding group skips the
    blocks before its window): its key rotated to ``positions[t]`` (times its scale), its
    value as stored; nothing else moves."""
    skips = data.draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))
    gen = torch.Generator().manual_seed(sum(lengths) + start)
    rope = _rope()
    pieces, positions, slots, scales, caches = _case(gen, 2, 2, 32, lengths, skips, start,
                                                     block_size)
    if window is not None:
        slots = window_slots(gen, positions, block_size, caches[0].shape[0], 2, window)
    scales = scales if scaled else None
    stages = ChainWriter(rope).write(pieces, positions, slots, scales, flash_update(caches))
    assert set(stages) == {"gather", "rope", "cache_write"}
    keys = rope.rotate(torch.cat([k for k, _ in pieces], dim=1), positions, scales)
    values = torch.cat([v for _, v in pieces], dim=1)
    layer_slots = LayerSlots.of(slots, 2)
    for layer, cache in enumerate(caches):
        row = layer_slots.table[layer_slots.groups[layer]]
        kept = row >= 0
        assert window is not None or kept.all()
        tokens = cache.transpose(1, 2).flatten(0, 1)  # [slots, heads, 2 * head_dim]
        assert torch.equal(tokens[row[kept]], torch.cat([keys[layer], values[layer]],
                                                        dim=-1)[kept])
        untouched = torch.ones(tokens.shape[0], dtype=torch.bool)
        untouched[row[kept]] = False
        assert not tokens[untouched].any()


def test_to_device_keeps_a_tensor_already_there():
    t = torch.arange(4)
    assert to_device(t, torch.device("cpu")) is t


def _stored(tmp: str, device, **kwargs) -> tuple[KVStore, list[BlobName], list[torch.Tensor]]:
    store = KVStore(LocalDir(Path(tmp)), "f" * 64, device=device, **kwargs)
    gen = torch.Generator().manual_seed(0)
    names, kvs = [], []
    for i in range(4):
        k, v = torch.randn(2, 2, 5 + i, 2, 8, generator=gen).to(BF16)
        names.append(fact_blob(i))
        store.put(names[i], k, v, list(range(5 + i)), window=0)
        kvs.append(torch.stack([k, v]))
    return store, names, kvs


def test_a_cpu_store_reads_page_ins_into_its_arena_not_pinned_memory():
    with tempfile.TemporaryDirectory() as tmp:
        store, names, kvs = _stored(tmp, "cpu", host_bytes=1 << 30)
        assert not store.pinned and store.arena is not None
        blobs = store.load_many(names, [None] * len(names))
        assert all(torch.equal(torch.stack([b.k, b.v]), kv) for b, kv in zip(blobs, kvs,
                                                                            strict=True))


@needs_cuda
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("host_bytes, device_bytes", [(1 << 30, 0), (0, 0), (1 << 30, 1 << 30)])
def test_a_cuda_store_serves_every_tier_on_the_device(pinned, host_bytes, device_bytes):
    """Page-ins bound for a GPU are pinned (unless asked not to), go over without waiting, and
    the device sees what was stored, from the durable tier, the host tier or its own."""
    with tempfile.TemporaryDirectory() as tmp:
        store, names, kvs = _stored(tmp, CUDA, host_bytes=host_bytes, device_bytes=device_bytes,
                                    pinned=pinned)
        assert store.arena is None if pinned else store.arena is not None
        for _ in range(3):  # durable, then memory tiers
            blobs = store.load_many(names, [None] * len(names))
            assert all(b.k.device.type == "cuda" for b in blobs)
            assert all(torch.equal(torch.stack([b.k, b.v]).cpu(), kv)
                       for b, kv in zip(blobs, kvs, strict=True))
        if host_bytes:
            held = store.host.get(store.location_for(names[0]))
            assert held is not None and held.k.is_pinned() == pinned


@needs_cuda
def test_a_cuda_store_keeps_host_sources_until_their_copies_ran():
    with tempfile.TemporaryDirectory() as tmp:
        store, names, _ = _stored(tmp, CUDA, host_bytes=0)
        torch.cuda._sleep(50_000_000)  # the stream is busy: the copies wait behind it
        store.load_many(names, [None] * len(names))
        assert store._copying and len(store._copying[-1][1]) == len(names)
        torch.cuda.synchronize()
        store.load_many(names[:1], [None])  # done copies are let go of at the next call
        assert len(store._copying) <= 1


@needs_cuda
def test_the_chain_on_cuda_writes_what_it_writes_on_the_host():
    gen = torch.Generator().manual_seed(3)
    cpu = _case(gen, 2, 2, 32, [7, 12, 3], [0, 2, 1], 5, 16)
    gen = torch.Generator().manual_seed(3)
    gpu = _case(gen, 2, 2, 32, [7, 12, 3], [0, 2, 1], 5, 16, CUDA)
    ChainWriter(_rope()).write(*cpu[:4], flash_update(cpu[4]))
    ChainWriter(_rope(device=CUDA)).write(*gpu[:4], flash_update(gpu[4]))  # host inputs
    for ours, theirs in zip(gpu[4], cpu[4], strict=True):
        torch.testing.assert_close(ours.cpu(), theirs, atol=2e-2, rtol=1e-2)


@needs_cuda
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_the_triton_writer_on_cuda_writes_the_chains_bits(partial):
    """Compiled for the GPU, the fused writer leaves the bits the chain (torch's bf16 ops)
    leaves, in one launch for every layer."""
    from inferscale.kv.fused import FusedTritonWriter

    config = LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                         num_hidden_layers=3, intermediate_size=64, vocab_size=100,
                         max_position_embeddings=4096, rope_theta=500000.0, head_dim=128,
                         partial_rotary_factor=partial)
    rope = ChunkedRope(config, BF16, CUDA)
    rope._kernel = None
    gen = torch.Generator().manual_seed(5)
    for scaled in (False, True):
        pieces, positions, slots, scales, caches = _case(gen, 3, 4, 128, [44, 37, 51, 9],
                                                         [0, 3, 1, 0], 30, 16, CUDA)
        scales = scales if scaled else None
        theirs = [torch.zeros_like(cache) for cache in caches]
        FusedTritonWriter(rope).write(pieces, positions, slots, scales,
                                                               caches)
        ChainWriter(rope).write(pieces, positions, slots, scales, flash_update(theirs))
        assert all(torch.equal(a, b) for a, b in zip(caches, theirs, strict=True))

