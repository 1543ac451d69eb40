"""Fused injection into vLLM's paged cache: one pass instead of three.

The portable chain (``chain.py``) copies the facts' K/V into a staging buffer, rotates the
keys in place with vLLM's rotary kernel and writes each layer with the attention backend's cache
update: three passes over the K/V (~52 MB at k = 50 on SmolLM2-135M, ~290 MB on an 8B model) and,
on a GPU, a kernel launch per layer. A fused writer reads each stored row once, rotates and
scales it as that chain does and stores it straight into the backend's block layout, for all
layers at once:

- ``FusedCpuWriter``: ``_fused_cpu.c``, in OpenMP threads over layers (the same libgomp team as
  torch's), for the layouts of vLLM's CPU attention ("amx" or "vec");
- ``FusedTritonWriter``: ``_fused_triton.py``, one launch for vLLM's CUDA attention layout
  ``[blocks, heads, block_size, 2 * head_dim]``.

The connector uses a writer only after it wrote the same bits as the portable path on a probe
(``ConnectorWorker.fused_writer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from inferscale.contracts.kv_format import (
    FORMATS,
    FP8,
    RAW_BITS,
    KVPiece,
    PieceLike,
    as_piece,
    quantize,
)
from inferscale.kv.chain import SKIP, LayerSlots, to_device
from inferscale.kv.rope import ChunkedRope

_fused_cpu: ModuleType | None
_fused_triton: ModuleType | None
try:
    from inferscale.kv import _fused_cpu
except ImportError:  # built without a C compiler: the portable path only
    _fused_cpu = None
try:
    from inferscale.kv import _fused_triton
except ImportError:  # no Triton: the portable path only
    _fused_triton = None

log = logging.getLogger("inferscale.kv.fused")
# (pieces, positions, slots, scales, caches): the portable chain into ``caches`` (one per layer)
ChainWrite = Callable[[list[PieceLike], torch.Tensor, LayerSlots, torch.Tensor,
                       list[torch.Tensor]], object]
# vLLM CPU attention's ISA -> the cache layout the kernel writes (its LAYOUT_* constants)
LAYOUTS = {"amx": 0, "vec": 1}


def available() -> bool:
    """Whether the C kernel was built with this install."""
    return _fused_cpu is not None


def triton_available() -> bool:
    """Whether Triton (the CUDA writer's kernel) imports here."""
    return _fused_triton is not None


def _pointers(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


class _FusedWriter:
    """Writes ``[layers, tokens, heads, head_dim]`` K/V pieces into the caches of ``layers``
    attention layers (cache ``[blocks, heads, block_size, 2 * head_dim]`` each), rotating the
    keys to their positions with each layer's table of ``rope`` and scaling them."""

    device_type = "cpu"

    def __init__(self, rope: ChunkedRope):
        self._rope = rope
        self._cos_sin = rope.cos_sin.contiguous()
        self._rotary_dim = rope.rotary_dim

    def _is_cache(self, cache: Any) -> bool:
        """Whether ``cache`` is memory the kernel may write: a 4-d bf16 tensor on the device."""
        return (isinstance(cache, torch.Tensor) and cache.device.type == self.device_type
                and cache.dim() == 4 and cache.dtype == torch.bfloat16)

    def _takes(self, layers: Sequence[tuple[int, Any]], num_layers: int) -> bool:
        """Whether this writer can take these attention layers (index, layer): every layer
        present, each cache one it may write, unquantised, and its tables bf16 on their
        device, turning neox halves (the kernels' rotation)."""
        cos_sin = self._cos_sin
        return (self._rope.neox
                and sorted(index for index, _ in layers) == list(range(num_layers))
                and all(self._is_cache(layer.kv_cache) for _, layer in layers)
                and all(getattr(layer.impl, "kv_cache_dtype", "auto") == "auto"
                        for _, layer in layers)
                and cos_sin.dtype == torch.bfloat16 and cos_sin.device.type == self.device_type
                and cos_sin.dim() == 2 and cos_sin.shape[1] == self._rotary_dim)

    def _tables(self, pieces: Sequence[PieceLike], positions: torch.Tensor,
                slots: torch.Tensor | LayerSlots, scales: torch.Tensor | None,
                caches: Sequence[torch.Tensor]) -> dict[str, Any] | None:
        """Check the request against the caches and build, on the host, per token: the
        addresses of its stored K and V rows of layer 0, its blob's layer stride (row
        elements), its rows' bits (16: bf16, else codes) and whether its codes are fp8, with
        the addresses of its params and its position; then its slot per group of layers
        (``SKIP``: not written) and each layer's group, the scales and the caches' addresses.
        None: no tokens.
        Raises ValueError for anything the kernel cannot take as it is."""
        stored = [as_piece(piece) for piece in pieces]
        layers, _, heads, dim = stored[0].shape
        if not all(self._is_cache(cache) for cache in caches):
            raise ValueError(f"fused KV write: a cache is not bf16 on {self.device_type}")
        blocks, cache_heads, block_size, width = caches[0].shape
        tokens = sum(piece.tokens for piece in stored)
        if len(caches) != layers or (cache_heads, width) != (heads, 2 * dim) or any(
                c.shape != caches[0].shape or c.stride() != caches[0].stride() for c in caches):
            raise ValueError("fused KV write: caches do not match the pieces")
        for piece in stored:
            self._check_piece(piece, (layers, heads, dim))
        layer_slots = LayerSlots.of(slots, layers)
        table, groups = layer_slots.table, layer_slots.groups
        if positions.numel() != tokens or table.dim() != 2 or layer_slots.tokens != tokens:
            raise ValueError("fused KV write: positions and slots must have one per token")
        if groups.shape != (layers,) or bool(((groups < 0) | (groups >= table.shape[0])).any()):
            raise ValueError("fused KV write: every layer needs a row of the slot table")
        if positions.device.type != "cpu" or table.device.type != "cpu":
            raise ValueError("fused KV write: positions and slots are checked on the host")
        if tokens == 0:
            return None
        if int(positions.min()) < 0 or int(positions.max()) >= self._rope.max_position:
            raise ValueError("fused KV write: a position lies outside the RoPE table")
        if int(table.min()) < SKIP or int(table.max()) >= blocks * block_size:
            raise ValueError("fused KV write: a slot lies outside the cache")
        if scales is not None and scales.shape != (layers, tokens):
            raise ValueError("fused KV write: scales must be [layers, tokens]")
        counts = torch.tensor([piece.tokens for piece in stored])
        within = torch.arange(tokens) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)

        def per_token(values: list[int]) -> torch.Tensor:
            return torch.repeat_interleave(torch.tensor(values, dtype=torch.int64), counts)

        def rows(tensors: list[torch.Tensor | None]) -> torch.Tensor:
            """Per token: the address of its layer-0 row of its piece's tensor (0: none)."""
            starts = per_token([0 if t is None else t.data_ptr() for t in tensors])
            row_bytes = per_token([0 if t is None else t.stride(1) * t.element_size()
                                   for t in tensors])
            return starts + within * row_bytes

        v_params = [piece.v_params for piece in stored]
        return {
            "layers": layers, "heads": heads, "dim": dim, "tokens": tokens,
            "block_size": block_size, "keys": rows([piece.k for piece in stored]),
            "values": rows([piece.v for piece in stored]),
            "strides": per_token([piece.k.stride(0) for piece in stored]),
            "bits": per_token([piece.bits for piece in stored]),
            "fp8": per_token([piece.kv_format == FP8 for piece in stored]),
            "k_params": per_token([0 if piece.k_params is None else piece.k_params.data_ptr()
                                   for piece in stored]),
            "v_params": rows(v_params),
            "v_params_strides": per_token([0 if p is None else p.stride(0) for p in v_params]),
            "positions": positions.to(torch.int64).contiguous(),
            "slots": table.to(torch.int64).contiguous().flatten(),
            "groups": groups.to(torch.int64).contiguous(),
            "scales": None if scales is None else scales.to(torch.bfloat16).contiguous(),
            "caches": _pointers(caches)}

    def _check_piece(self, piece: KVPiece, shape: tuple[int, int, int]) -> None:
        """Raise ValueError unless the kernel can read ``piece`` as it lies: rows (bf16, or
        codes with bf16 params) of ``shape`` (layers, heads, head_dim), heads and elements
        contiguous, K and V alike, on the writer's device, dequantising to bf16."""
        layers, heads, dim = shape
        if piece.kv_format not in FORMATS or piece.dtype != torch.bfloat16:
            raise ValueError("fused KV write: a piece does not hold bf16 K/V")
        if piece.v.stride(0) != piece.k.stride(0):
            raise ValueError("fused KV write: a piece's K and V are laid out differently")
        width = dim if piece.bits == RAW_BITS else dim * piece.bits // 8
        row_dtype = torch.bfloat16 if piece.bits == RAW_BITS else torch.uint8
        for part in (piece.k, piece.v):
            if (part.shape[0], *part.shape[2:]) != (layers, heads, width) or (
                    part.dtype != row_dtype or part.device.type != self.device_type
                    or part.stride()[2:] != (width, 1) or part.stride(1) != heads * width):
                raise ValueError("fused KV write: a piece is not rows of the layout")
        if piece.bits == RAW_BITS:
            return
        k_params, v_params = piece.k_params, piece.v_params
        if k_params is None or v_params is None or not (
                k_params.shape == (layers, heads, 2, dim) and k_params.is_contiguous()
                and v_params.shape == (layers, piece.tokens, heads, 2)
                and v_params.stride()[1:] == (heads * 2, 2, 1)
                and k_params.dtype == v_params.dtype == torch.bfloat16
                and k_params.device.type == v_params.device.type == self.device_type):
            raise ValueError("fused KV write: a coded piece's params do not fit its rows")


class FusedCpuWriter(_FusedWriter):
    """The C kernel, for the layouts of vLLM's CPU attention (``layout``: ``LAYOUTS[isa]``);
    caches contiguous in host memory."""

    name = "fused CPU kernel"

    def __init__(self, layout: int, rope: ChunkedRope):
        super().__init__(rope)
        self._layout = layout
        self._layer_rows = rope.layer_rows.cpu()

    def _is_cache(self, cache: Any) -> bool:
        return super()._is_cache(cache) and cache.is_contiguous()

    @classmethod
    def for_layers(cls, layers: Sequence[tuple[int, Any]], num_layers: int,
                   rope: ChunkedRope) -> FusedCpuWriter | None:
        """A writer for these attention layers (index, layer), or None where the kernel does
        not apply: not built, another ISA, not bf16, a quantised cache, a layer missing."""
        if _fused_cpu is None:
            return None
        isas = {getattr(layer, "isa", None) for _, layer in layers}
        if len(isas) != 1 or (isa := isas.pop()) not in LAYOUTS:
            return None
        writer = cls(LAYOUTS[isa], rope)
        return writer if writer._takes(layers, num_layers) else None

    def write(self, pieces: Sequence[PieceLike], positions: torch.Tensor,
              slots: torch.Tensor | LayerSlots, scales: torch.Tensor | None,
              caches: Sequence[torch.Tensor]) -> None:
        """Write the pieces' tokens, in order, at ``slots`` (one per token for every layer, or
        ``LayerSlots``) with keys rotated to ``positions`` and multiplied by
        ``scales [layers, tokens]`` (None: unscaled), coded rows dequantised; ``caches[i]`` is
        layer i's. Raises ValueError for anything the kernel cannot take as it is."""
        t = self._tables(pieces, positions, slots, scales, caches)
        if t is None:
            return
        assert _fused_cpu is not None  # writers are used only where the kernel is built
        _fused_cpu.inject(self._layout, t["layers"], t["heads"], t["dim"], self._rotary_dim,
                        t["block_size"], t["tokens"], t["keys"].data_ptr(),
                        t["values"].data_ptr(), t["strides"].data_ptr(), t["bits"].data_ptr(),
                        t["fp8"].data_ptr(), t["k_params"].data_ptr(), t["v_params"].data_ptr(),
                        t["v_params_strides"].data_ptr(), t["slots"].data_ptr(),
                        t["groups"].data_ptr(), t["positions"].data_ptr(),
                        self._cos_sin.data_ptr(), self._layer_rows.data_ptr(),
                        0 if t["scales"] is None else t["scales"].data_ptr(),
                        t["caches"].data_ptr())


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class FusedTritonWriter(_FusedWriter):
    """The Triton kernel, for vLLM's CUDA attention layout: per layer ``[blocks, heads,
    block_size, 2 * head_dim]`` (any strides but the last), K then V in the last dimension.
    One launch for every layer; the host-built tables go over in one non-blocking copy.
    ``round_once``: round each rotated element once (vLLM's CPU rotary kernel) instead of after
    every bf16 op (torch's ops). ``device_type`` "cpu" runs it under Triton's interpreter
    (``TRITON_INTERPRET=1``, tests)."""

    def __init__(self, rope: ChunkedRope, round_once: bool = False, device_type: str = "cuda"):
        super().__init__(rope)
        self.round_once = round_once
        self.device_type = device_type
        self.name = f"fused Triton kernel ({'one rounding' if round_once else 'bf16 ops'})"

    def _is_cache(self, cache: Any) -> bool:
        return super()._is_cache(cache) and cache.stride(-1) == 1

    @classmethod
    def roundings(cls, rope: ChunkedRope) -> list[FusedTritonWriter]:
        """One writer per rounding, in the order they are probed."""
        return [cls(rope, round_once) for round_once in (False, True)]

    @classmethod
    def for_layers(cls, layers: Sequence[tuple[int, Any]], num_layers: int,
                   rope: ChunkedRope) -> list[FusedTritonWriter]:
        """Writers for these CUDA attention layers, one per rounding (none where the kernel
        does not apply: no Triton, not bf16, a quantised cache, a layer missing)."""
        if _fused_triton is None:
            return []
        return [writer for writer in cls.roundings(rope)
                if writer._takes(layers, num_layers)]

    def write(self, pieces: Sequence[PieceLike], positions: torch.Tensor,
              slots: torch.Tensor | LayerSlots, scales: torch.Tensor | None,
              caches: Sequence[torch.Tensor]) -> None:
        """As ``FusedCpuWriter.write``; positions, slots and scales on the host."""
        t = self._tables(pieces, positions, slots, scales, caches)
        if t is None:
            return
        tokens, layers = t["tokens"], t["layers"]
        per_token = ("keys", "values", "strides", "bits", "fp8", "k_params", "v_params",
                     "v_params_strides", "positions")
        ints = torch.cat([t[name] for name in (*per_token, "caches", "groups", "slots")])
        scaled = t["scales"] is not None
        packed = to_device(torch.cat([ints.view(torch.uint8)] + (
            [t["scales"].flatten().view(torch.uint8)] if scaled else [])), caches[0].device)
        on_device = packed[:ints.numel() * 8].view(torch.int64)  # one copy for every table
        tables = on_device[:len(per_token) * tokens].view(len(per_token), tokens)
        scales = packed[ints.numel() * 8:].view(torch.bfloat16) if scaled else tables[0]
        heads, dim, rotary = t["heads"], t["dim"], self._rotary_dim
        stride_block, stride_head, stride_slot = caches[0].stride()[:3]
        assert _fused_triton is not None  # writers are used only where Triton imports
        caches_at = len(per_token) * tokens
        slots_at = caches_at + 2 * layers
        _fused_triton.inject_kernel[(tokens, layers)](
            *tables, on_device[slots_at:], on_device[caches_at + layers:slots_at],
            self._cos_sin, scales, on_device[caches_at:caches_at + layers],
            self._rope.layer_rows, tokens,
            t["block_size"], stride_block, stride_head, stride_slot, HEADS=heads, DIM=dim,
            ROT=rotary, HEADS_P2=_pow2(heads), HALF_P2=_pow2(rotary // 2),
            REST_P2=_pow2(max(dim - rotary, 1)), DIM_P2=_pow2(dim),
            SCALED=scaled, ROUND_ONCE=self.round_once)


def fused_writers(layers: Sequence[tuple[int, Any]], num_layers: int, rope: ChunkedRope
                  ) -> list[FusedCpuWriter | FusedTritonWriter]:
    """The fused writers that apply to these attention layers (see ``for_layers``), to be
    probed in order: the first that writes what the chain writes is used."""
    cpu = FusedCpuWriter.for_layers(layers, num_layers, rope)
    return [cpu] if cpu else [*FusedTritonWriter.for_layers(layers, num_layers, rope)]


def writes_like(writer: FusedCpuWriter | FusedTritonWriter, chain: ChainWrite,
                kv_shape: tuple[int, int, int], block_size: int) -> bool:
    """Both write random pieces (bf16 rows, one not starting at its blob's first token, and
    int4, int8 and fp8 codes), scaled, at positions across block boundaries, into two small caches
    on the writer's device, every other layer in a second group of layers that keeps no block
    for the first block's positions (a sliding window): same bits? ``kv_shape``: (layers, KV
    heads, head_dim)."""
    gen = torch.Generator().manual_seed(0)
    num_layers, heads, dim = kv_shape
    device, dtype = writer._cos_sin.device, torch.bfloat16

    def random(tokens: int) -> torch.Tensor:
        return torch.randn(num_layers, tokens, heads, dim, generator=gen).to(device, dtype)

    pieces: list[PieceLike] = [
        (random(7)[:, 2:], random(7)[:, 2:]),
        quantize(random(block_size + 1), random(block_size + 1), "int4").sliced(1),
        quantize(random(3), random(3), "int8"), quantize(random(2), random(2), FP8)]
    tokens = 10 + block_size
    positions = torch.arange(3, 3 + tokens)
    blocks = (3 + tokens) // block_size + 1
    groups = min(num_layers, 2)
    table = torch.stack([torch.randperm(blocks, generator=gen)[positions // block_size]
                         * block_size + positions % block_size for _ in range(groups)])
    table[groups - 1, positions < block_size] = SKIP
    slots = LayerSlots(table, torch.arange(num_layers) % groups)
    scales = (torch.rand(num_layers, tokens, generator=gen) + 0.5).to(dtype)
    caches = [[torch.zeros((blocks, heads, block_size, 2 * dim), dtype=dtype, device=device)
               for _ in range(num_layers)] for _ in range(2)]
    writer.write(pieces, positions, slots, scales, caches[0])
    chain(pieces, positions, slots, scales, caches[1])
    return all(torch.equal(a, b) for a, b in zip(*caches, strict=True))


def first_exact(writers: Sequence[FusedCpuWriter | FusedTritonWriter], chain: ChainWrite,
                kv_shape: tuple[int, int, int], block_size: int
                ) -> FusedCpuWriter | FusedTritonWriter | None:
    """The first of ``writers`` that writes what ``chain`` writes (``writes_like``); None
    where none does or none can run its probe."""
    for writer in writers:
        try:
            if writes_like(writer, chain, kv_shape, block_size):
                return writer
            log.warning("%s differs from the portable path here: not used", writer.name)
        except Exception:  # noqa: BLE001 - a probe that cannot run: not that writer
            log.exception("%s probe failed: not used", writer.name)
    return None
