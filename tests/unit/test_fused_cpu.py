"""The fused CPU KV writer writes exactly what the portable chain writes (vLLM's rotary kernel
through ChunkedRope, then vLLM's CPU cache update), for each cache layout it takes, and refuses
what it cannot take without touching the cache."""

import importlib.util
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcases import every_e4m3_code, kv_case, rope_config, window_slots
from vllm import _custom_ops as ops

from inferscale.contracts.blob_name import BlobName, fact_blob
from inferscale.contracts.kv_format import FORMATS, as_piece
from inferscale.kv import fused as kvwrite
from inferscale.kv.chain import LayerSlots
from inferscale.kv.fused import LAYOUTS, FusedCpuWriter
from inferscale.kv.rope import ChunkedRope

needs_kernel = pytest.mark.skipif(not kvwrite.available(), reason="built without a compiler")
BF16 = torch.bfloat16




@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_kernel_is_built_where_a_compiler_is():
    """The install builds the kernel optionally (a failed compile is only a warning), so this
    is where a broken or stale build shows: built, and from the source as it is now."""
    assert kvwrite.available()
    built = importlib.util.find_spec("inferscale.kv._fused_cpu")
    assert built is not None and built.origin is not None
    source = Path(kvwrite.__file__).with_name("_fused_cpu.c")
    assert Path(built.origin).stat().st_mtime >= source.stat().st_mtime


def _rope(layers: int, heads: int, dim: int, partial: float,
          per_layer: bool = False) -> ChunkedRope:
    return ChunkedRope(rope_config(layers, heads, dim, partial, per_layer), BF16)


class _CpuImpl:
    """The cache update of vLLM's CPU attention backend, for layers built here."""

    kv_cache_dtype = "auto"

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        blocks, heads, block_size, _ = kv_cache.shape
        k_cache, v_cache = kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, layer.isa,
                                       1.0, 1.0, "auto")


def _chain(pieces, positions, slots, scales, caches, rope, isa):
    rows = [as_piece(piece).dequantized() for piece in pieces]
    k = torch.cat([row[0] for row in rows], dim=1)
    v = torch.cat([row[1] for row in rows], dim=1)
    rope.rotate_(k, positions, scales)
    layer_slots = LayerSlots.of(slots, len(caches))
    for layer, cache in enumerate(caches):
        row = layer_slots.table[layer_slots.groups[layer]]
        kept = row >= 0
        _CpuImpl().do_kv_cache_update(SimpleNamespace(isa=isa), k[layer, kept], v[layer, kept],
                                      cache, row[kept])


def _vllm_writes(isa: str) -> bool:
    """Whether this host's vLLM has the cache update of ``isa`` (its AMX layout needs a CPU
    with AMX or AVX-512: an AMD EPYC without them refuses it)."""
    key = torch.zeros(1, 1, 64, dtype=BF16)
    cache = torch.zeros(1, 1, 32, 64, dtype=BF16)
    try:
        ops.cpu_attn_reshape_and_cache(key, key.clone(), cache, cache.clone(), torch.tensor([0]),
                                       isa, 1.0, 1.0, "auto")
    except RuntimeError:
        return False
    return True


def _vllm_rotates_as_the_kernel(isa: str) -> bool:
    """The connector's own probe (``fused.writes_like``): where vLLM's rotary kernel rounds
    otherwise (one bf16 step apart on a CPU without AVX-512), the fused writer is not bit-equal
    to vLLM's chain and the connector keeps the chain."""
    from inferscale.kv.fused import writes_like

    rope = _rope(2, 2, 64, 1.0)

    def chain(pieces, positions, slots, scales, caches):
        _chain(pieces, positions, slots, scales, caches, rope, isa)

    return writes_like(FusedCpuWriter(LAYOUTS[isa], rope), chain, (2, 2, 64), 32)


RUNS = [isa for isa in sorted(LAYOUTS) if _vllm_writes(isa)]  # "vec" runs everywhere
COMPARABLE = [isa for isa in RUNS if kvwrite.available() and _vllm_rotates_as_the_kernel(isa)]
needs_comparable = pytest.mark.skipif(
    not COMPARABLE, reason="this host's vLLM rotates keys with other rounding than the fused "
                           "kernel: the connector keeps vLLM's chain here (tested below)")


@needs_kernel
@needs_comparable
@settings(max_examples=40, deadline=None)
@given(isa=st.sampled_from(COMPARABLE or RUNS), heads=st.integers(1, 3),
       dim=st.sampled_from([32, 64, 128]), partial=st.sampled_from([1.0, 0.5]),
       block_size=st.sampled_from([32, 128]),
       lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       start=st.integers(0, 300), scaled=st.booleans(), seed=st.integers(0, 2**16),
       formats=st.none() | st.lists(st.sampled_from(sorted(FORMATS)), min_size=4, max_size=4),
       per_layer=st.booleans(), window=st.none() | st.integers(1, 200))
def test_fused_write_is_bit_equal_to_the_chain(isa, heads, dim, partial, block_size, lengths,
                                                start, scaled, seed, formats, per_layer, window):
    """Raw rows and every coded format, mixed in one write (a store may hold several); one
    RoPE table for all layers or one per layer type; one slot per token for every layer, or
    a slot table per group of layers whose sliding group skips the blocks before its
    window."""
    gen = torch.Generator().manual_seed(seed)
    layers = 3
    skips = torch.randint(0, 4, (len(lengths),), generator=gen).tolist()
    pieces, positions, slots, scales, shape = kv_case(gen, layers, heads, dim, block_size,
                                                    lengths, skips, start, scaled,
                                                    formats=formats and formats[:len(lengths)])
    rope = _rope(layers, heads, dim, partial, per_layer)
    if window is not None:
        slots = window_slots(gen, positions, block_size, shape[0], layers, window)
    ours = [torch.zeros(shape, dtype=BF16) for _ in range(layers)]
    theirs = [torch.zeros(shape, dtype=BF16) for _ in range(layers)]
    FusedCpuWriter(LAYOUTS[isa], rope).write(
        pieces, positions, slots, scales, ours)
    _chain(pieces, positions, slots, scales, theirs, rope, isa)
    for layer in range(layers):
        assert torch.equal(ours[layer], theirs[layer])
    assert all(cache.abs().sum() > 0 for cache in ours)  # something was written


@needs_kernel
@pytest.mark.parametrize("isa", COMPARABLE)
def test_every_e4m3_code_dequantises_as_torch_does(isa):
    """The kernel's e4m3 values (subnormals, signed zeros, 448) are torch's float8_e4m3fn."""
    gen = torch.Generator().manual_seed(1)
    piece = every_e4m3_code(gen, 2, 2, 64)
    positions = torch.arange(5, 5 + piece.tokens)
    slots = positions + 32
    rope = _rope(2, 2, 64, 1.0)
    ours = [torch.zeros(4, 2, 32, 128, dtype=BF16) for _ in range(2)]
    theirs = [torch.zeros(4, 2, 32, 128, dtype=BF16) for _ in range(2)]
    FusedCpuWriter(LAYOUTS[isa], rope).write([piece], positions, slots, None, ours)
    _chain([piece], positions, slots, None, theirs, rope, isa)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _writer_and_case(**overrides):
    gen = torch.Generator().manual_seed(0)
    rope = _rope(2, 2, 64, 1.0)
    pieces, positions, slots, scales, shape = kv_case(gen, 2, 2, 64, 32, [5, 9], [0, 1], 3, True)
    case = {"pieces": pieces, "positions": positions, "slots": slots, "scales": scales,
            "caches": [torch.zeros(shape, dtype=BF16) for _ in range(2)]}
    case.update(overrides)
    return FusedCpuWriter(LAYOUTS["vec"], rope), case


@needs_kernel
@pytest.mark.parametrize("hostile", [
    {"slots": torch.arange(14) + 10_000},                       # outside the cache
    {"slots": torch.arange(14) - 2},                            # negative slot
    {"slots": LayerSlots(torch.arange(14)[None], torch.tensor([0, 1]))},  # a group missing
    {"slots": LayerSlots(torch.arange(14)[None], torch.tensor([0]))},  # a layer's group missing
    {"positions": torch.arange(14) + 4090},                     # beyond the RoPE table
    {"slots": torch.arange(13)},                                # one slot short
    {"scales": torch.ones(2, 13, dtype=BF16)},                  # scales for other tokens
    {"caches": [torch.zeros(4, 2, 32, 128, dtype=BF16)]},       # a layer's cache missing
    {"caches": [torch.zeros(4, 3, 32, 128, dtype=BF16)] * 2},   # other heads
    {"caches": [torch.zeros(4, 2, 32, 128, dtype=torch.float16)] * 2},  # not bf16
    {"caches": [torch.zeros(4, 2, 128, 32, dtype=BF16).transpose(2, 3)] * 2},  # not contiguous
    {"pieces": [(torch.zeros(2, 5, 2, 64), torch.zeros(2, 5, 2, 64))]},  # fp32 rows
    {"pieces": [(torch.zeros(2, 5, 64, 2, dtype=BF16).transpose(2, 3),
                 torch.zeros(2, 5, 2, 64, dtype=BF16))]},       # rows not contiguous
])
def test_what_the_kernel_cannot_take_is_refused_untouched(hostile):
    writer, case = _writer_and_case(**hostile)
    before = [cache.clone() for cache in case["caches"]]
    with pytest.raises(ValueError, match="fused KV write"):
        writer.write(**case)
    assert all(torch.equal(a, b) for a, b in zip(case["caches"], before, strict=True))


def _layers(isa="amx", dtype=BF16, cache_dtype="auto", indices=(0, 1)):
    return [(i, SimpleNamespace(isa=isa, impl=SimpleNamespace(kv_cache_dtype=cache_dtype),
                                kv_cache=torch.zeros(2, 1, 32, 128, dtype=dtype)))
            for i in indices]


@needs_kernel
@pytest.mark.parametrize(("layers", "applies"), [
    (_layers(), True),
    (_layers(isa="vec"), True),
    (_layers(isa="vec16"), False),
    (_layers(isa="neon"), False),
    (_layers(dtype=torch.float16), False),
    (_layers(cache_dtype="fp8"), False),
    (_layers(indices=(0,)), False),   # a layer of the model has no cache here
])
def test_writer_applies_only_where_the_kernel_does(layers, applies):
    rope = _rope(2, 1, 64, 1.0)
    writer = FusedCpuWriter.for_layers(layers, 2, rope)
    assert (writer is not None) == applies


@needs_kernel
def test_interleaved_rotary_goes_the_portable_way():
    """The kernel turns neox halves; a family that turns neighbouring pairs (GLM) is written
    by the portable chain."""
    from transformers import Glm4Config

    config = Glm4Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=64, num_hidden_layers=2, vocab_size=100, pad_token_id=None)
    assert FusedCpuWriter.for_layers(_layers(isa="vec"), 2, _rope(2, 1, 64, 1.0)) is not None
    assert FusedCpuWriter.for_layers(_layers(isa="vec"), 2, ChunkedRope(config, BF16)) is None


@needs_kernel
@pytest.mark.parametrize("isa", COMPARABLE)
def test_caches_not_aligned_to_lines_are_written_alike(isa):
    """Whole groups go out as streamed 64-byte lines; a cache that does not start on a 16-byte
    boundary takes plain stores, with the same bits."""
    gen = torch.Generator().manual_seed(1)
    rope = _rope(2, 2, 64, 1.0)
    pieces, positions, slots, scales, shape = kv_case(gen, 2, 2, 64, 32, [40, 30], [0, 2], 0,
                                                    True)
    size = torch.Size(shape).numel()
    ours = [torch.zeros(size + 1, dtype=BF16)[1:].view(shape) for _ in range(2)]
    assert all(cache.data_ptr() % 16 for cache in ours)
    theirs = [torch.zeros(shape, dtype=BF16) for _ in range(2)]
    FusedCpuWriter(LAYOUTS[isa], rope).write(
        pieces, positions, slots, scales, ours)
    _chain(pieces, positions, slots, scales, theirs, rope, isa)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _worker_half(tmp_path, isa="vec", layer_groups=None):
    from inferscale.kv.durable import LocalDir
    from inferscale.kv.store import KVStore
    from inferscale.serving.connector_worker import ConnectorWorker

    store = KVStore(LocalDir(tmp_path), "f" * 64, host_bytes=0)
    worker = ConnectorWorker(store, _rope(2, 2, 64, 1.0), BF16, (2, 2, 64), 32, None,
                             layer_groups)
    layers = [(i, SimpleNamespace(isa=isa, impl=_CpuImpl(),
                                  kv_cache=torch.zeros(4, 2, 32, 128, dtype=BF16)))
              for i in range(2)]
    return worker, layers


@needs_kernel
@pytest.mark.parametrize("isa", RUNS)
def test_connector_uses_the_writer_only_where_it_passes_its_probe(isa, tmp_path):
    """Where vLLM here writes as the kernel does, the connector takes the kernel; where its
    rotary rounds otherwise, it keeps vLLM's chain (never other bits than vLLM's)."""
    worker, layers = _worker_half(tmp_path, isa)
    writer = worker.fused_writer(layers)
    if isa in COMPARABLE:
        assert isinstance(writer, FusedCpuWriter)
    else:
        assert writer is None


@needs_kernel
def test_connector_keeps_the_portable_path_when_the_probe_differs(monkeypatch, tmp_path):
    worker, layers = _worker_half(tmp_path)
    rope = worker.rope
    monkeypatch.setattr(FusedCpuWriter, "for_layers", classmethod(  # the other layout's writer
        lambda cls, *_: cls(LAYOUTS["amx"], rope)))
    assert worker.fused_writer(layers) is None
    assert worker.fused_writer(layers) is None  # decided once


@needs_kernel
def test_connector_keeps_the_portable_path_when_the_probe_cannot_run(monkeypatch, tmp_path):
    worker, layers = _worker_half(tmp_path)

    def broken(*_):
        raise ValueError("fused KV write: broken")

    monkeypatch.setattr(FusedCpuWriter, "write", broken)
    assert worker.fused_writer(layers) is None


def _stored_fact(worker, name: BlobName, tokens: int):
    """A blob of ``tokens`` random bf16 tokens in the worker's store, and its segment."""
    from inferscale.contracts.plan import Segment

    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, tokens, 2, 64, generator=gen).to(BF16)
    ids = list(range(100, 100 + tokens))
    stored = worker.store.put(name, k, v, ids, window=0)
    return (k, v), Segment.of(name, 0, ids, stored.checksum)


@needs_kernel
def test_a_group_keeps_no_block_before_its_window_and_nothing_is_written_there(tmp_path):
    """Two KV cache groups (the hybrid manager): layer 0 full, layer 1 sliding, whose table
    holds the null block (0) for the first block. Each layer is written at its own group's
    slots, the sliding layer not at all before its window, the same bits as vLLM's ops; the
    asynchronous load is reported received, and not failed."""
    from inferscale.serving.connector_scheduler import LoadSpec

    worker, layers = _worker_half(tmp_path, "vec", layer_groups=[0, 1])
    kv, segment = _stored_fact(worker, fact_blob(1), 40)
    spec = LoadSpec("req-a", 0, 40, [segment], block_ids=[[1, 2], [0, 3]], asynchronous=True)
    worker.load([spec], SimpleNamespace(no_compile_layers=dict(
        (f"model.layers.{i}.self_attn.attn", layer) for i, layer in layers)))
    positions = torch.arange(40)
    table = torch.stack([torch.tensor([1, 2])[positions // 32] * 32 + positions % 32,
                         torch.where(positions < 32, -1, 3 * 32 + positions % 32)])
    expected = [torch.zeros(4, 2, 32, 128, dtype=BF16) for _ in range(2)]
    _chain([kv], positions, LayerSlots(table, torch.tensor([0, 1])), None, expected,
           worker.rope, "vec")
    assert all(torch.equal(layer.kv_cache, want)
               for (_, layer), want in zip(layers, expected, strict=True))
    assert layers[0][1].kv_cache[1:3].any() and not layers[1][1].kv_cache[:3].any()
    assert layers[1][1].kv_cache[3].any()
    assert worker.take_transfer_results() == ({"req-a"}, set())
    assert worker.take_transfer_results() == (set(), set())  # reported once
    assert worker.take_failed_blocks() == set()


@needs_kernel
def test_a_failed_load_is_reported_per_request_where_asynchronous_else_per_block(tmp_path):
    """A blob that is not there: an asynchronous load is received and failed (vLLM takes only
    request-level failures with several groups); a synchronous one fails its blocks, never
    the null block."""
    from inferscale.contracts.plan import Segment
    from inferscale.serving.connector_scheduler import LoadSpec

    worker, layers = _worker_half(tmp_path, "vec", layer_groups=[0, 1])
    missing = Segment.of(fact_blob(999), 0, list(range(40)))
    context = SimpleNamespace(no_compile_layers={})
    worker.load([LoadSpec("req-b", 0, 40, [missing], block_ids=[[1, 2], [0, 3]],
                          asynchronous=True)], context)
    assert worker.take_transfer_results() == ({"req-b"}, {"req-b"})
    assert worker.take_failed_blocks() == set()
    worker.load([LoadSpec("req-c", 0, 40, [missing], block_ids=[[1, 2], [0, 3]])], context)
    assert worker.take_failed_blocks() == {1, 2, 3}
    assert worker.take_transfer_results() == (set(), set())
    assert not any(layer.kv_cache.any() for _, layer in layers)


def test_layers_are_mapped_to_their_kv_cache_groups_by_name():
    from inferscale.serving.connector_worker import layer_groups

    config = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=["model.layers.2.self_attn.attn"]),
        SimpleNamespace(layer_names=["model.layers.0.self_attn.attn",
                                     "model.layers.1.self_attn.attn"])])
    assert layer_groups(config, 3) == [1, 1, 0]
    assert layer_groups(SimpleNamespace(kv_cache_groups=config.kv_cache_groups[:1]), 1) is None
    assert layer_groups(None, 3) is None
    with pytest.raises(ValueError, match="KV cache groups cover"):
        layer_groups(config, 4)  # a layer in no group
