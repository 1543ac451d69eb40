"""The fused Triton writer (vLLM's CUDA cache layout) against the portable chain, run on the
host under Triton's interpreter: the same bits for every case, whichever rotary kernel's
rounding it follows, and the connector's probe picks the rounding that matches."""

import functools
import importlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcases import every_e4m3_code, kv_case, rope_config, window_slots

from inferscale.contracts.kv_format import FORMATS
from inferscale.kv.chain import ChainWriter
from inferscale.kv.fused import FusedTritonWriter, first_exact, writes_like
from inferscale.kv.rope import ChunkedRope
from inferscale.lab.bench.inject import flash_update

pytest.importorskip("triton")
BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def interpreted():
    """The kernel compiled for Triton's interpreter (host tensors), then as it was."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        importlib.reload(importlib.import_module("inferscale.kv._fused_triton"))
        yield
    importlib.reload(importlib.import_module("inferscale.kv._fused_triton"))


def _rope(heads: int, dim: int, partial: float, vllm_kernel: bool,
          per_layer: bool = False) -> ChunkedRope:
    rope = ChunkedRope(rope_config(2, heads, dim, partial, per_layer, max_position=512), BF16)
    if not vllm_kernel:
        rope._kernel = None  # torch's bf16 ops
    return rope


def _vllm_chain(rope: ChunkedRope):
    def chain(pieces, positions, slots, scales, caches):
        ChainWriter(rope).write(pieces, positions, slots, scales, flash_update(caches))
    return chain


@functools.cache
def _vllm_rounds_once() -> bool:
    """Whether vLLM's CPU rotary kernel rounds as the round-once writer does here, by the
    connector's own probe (with AVX-512 it does; without, it lands one bf16 step apart and the
    connector keeps the chain)."""
    rope = _rope(2, 64, 1.0, True)
    return rope._kernel is not None and writes_like(
        FusedTritonWriter(rope, round_once=True, device_type="cpu"), _vllm_chain(rope),
        (2, 2, 64), 16)


def _case(gen, heads, dim, lengths, skips, start, block_size, scaled, formats=None):
    return kv_case(gen, 2, heads, dim, block_size, lengths, skips, start, scaled,
                   formats=formats)


def _zeros(shape):
    return [torch.zeros(shape, dtype=BF16) for _ in range(2)]


@settings(max_examples=12, deadline=None)
@given(heads=st.integers(1, 3), dim=st.sampled_from([32, 64]), partial=st.sampled_from([1.0, 0.5]),
       lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3), start=st.integers(0, 30),
       block_size=st.sampled_from([1, 16]), scaled=st.booleans(), seed=st.integers(0, 99),
       formats=st.none() | st.lists(st.sampled_from(sorted(FORMATS)), min_size=3, max_size=3),
       per_layer=st.booleans(), window=st.none() | st.integers(1, 40))
def test_the_triton_writer_writes_the_chains_bits(heads, dim, partial, lengths, start,
                                                  block_size, scaled, seed, formats, per_layer,
                                                  window):
    """Raw rows and every coded format, mixed in one write; one RoPE table for both layers
    or one each; one slot per token for both layers, or a slot table per group of layers
    whose sliding group skips the blocks before its window."""
    gen = torch.Generator().manual_seed(seed)
    skips = [seed % 3] * len(lengths)
    pieces, positions, slots, scales, shape = _case(gen, heads, dim, lengths, skips, start,
                                                    block_size, scaled,
                                                    formats and formats[:len(lengths)])
    if window is not None:
        slots = window_slots(gen, positions, block_size, shape[0], 2, window)
    kernels = [False, True] if _vllm_rounds_once() else [False]
    for vllm_kernel in kernels:  # torch's bf16 ops round each op; vLLM's CPU kernel once
        rope = _rope(heads, dim, partial, vllm_kernel, per_layer)
        ours, theirs = _zeros(shape), _zeros(shape)
        FusedTritonWriter(rope, round_once=vllm_kernel,
                          device_type="cpu").write(pieces, positions, slots, scales, ours)
        ChainWriter(rope).write(pieces, positions, slots, scales, flash_update(theirs))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_every_e4m3_code_dequantises_as_torch_does():
    """The kernel's e4m3 values (bit operations) are torch's float8_e4m3fn, code by code."""
    piece = every_e4m3_code(torch.Generator().manual_seed(1), 2, 2, 64)
    positions = torch.arange(5, 5 + piece.tokens)
    rope = _rope(2, 64, 1.0, False)
    ours, theirs = _zeros((4, 2, 16, 128)), _zeros((4, 2, 16, 128))
    FusedTritonWriter(rope, device_type="cpu").write([piece], positions, positions + 16, None,
                                                     ours)
    ChainWriter(rope).write([piece], positions, positions + 16, None, flash_update(theirs))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("vllm_kernel", [False, True])
def test_the_probe_picks_the_rounding_of_the_chain(vllm_kernel):
    rope = _rope(2, 64, 1.0, vllm_kernel)
    if vllm_kernel and rope._kernel is None:
        pytest.skip("vLLM is not installed")
    writers = [FusedTritonWriter(rope, round_once, device_type="cpu")
               for round_once in (False, True)]

    chain = _vllm_chain(rope)
    chosen = first_exact(writers, chain, (2, 2, 64), 16)
    if vllm_kernel and not _vllm_rounds_once():  # neither writer: the connector keeps the chain
        assert chosen is None
        return
    assert chosen is writers[int(vllm_kernel)]
    assert first_exact(writers[1 - int(vllm_kernel):2 - int(vllm_kernel)], chain, (2, 2, 64),
                       16) is None


def test_the_triton_writer_refuses_what_it_cannot_take_before_writing():
    rope = _rope(2, 32, 1.0, False)
    writer = FusedTritonWriter(rope, device_type="cpu")
    gen = torch.Generator().manual_seed(0)
    pieces, positions, slots, scales, shape = _case(gen, 2, 32, [5, 4], [0, 1], 3, 16, True)
    caches = _zeros(shape)
    bad = [(positions, slots.clone().fill_(10_000), "slot"),
           (positions + 10_000, slots, "position")]
    for bad_positions, bad_slots, what in bad:
        with pytest.raises(ValueError, match=what):
            writer.write(pieces, bad_positions, bad_slots, scales, caches)
    with pytest.raises(ValueError, match="caches"):
        writer.write(pieces, positions, slots, scales, caches[:1])
    assert not any(cache.any() for cache in caches)


def test_no_triton_writer_for_host_caches():
    """Outside the interpreter the writer is for CUDA caches only."""
    rope = _rope(2, 32, 1.0, False)
    layers = [(i, SimpleNamespace(impl=SimpleNamespace(kv_cache_dtype="auto"),
                                  kv_cache=torch.zeros(4, 2, 16, 64, dtype=BF16)))
              for i in range(2)]
    assert FusedTritonWriter.for_layers(layers, 2, rope) == []
