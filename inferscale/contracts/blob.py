"""The one KV blob format (safetensors): encode and decode, with its checksum.

``k`` (pre-RoPE) and ``v`` as ``[layers, tokens, kv_heads, head_dim]`` in the model dtype, or
as codes with ``k_params`` and ``v_params`` (``kv_format``: the format, ``kv_format.py``),
``token_ids`` (int32); metadata: model fingerprint, window, dtype, shape (of K as it
dequantises), ``kv_format`` (absent: raw) and a checksum of K, V and the token ids (then the
params and the format's name): BLAKE3 (``checksum_algorithm``), or sha256 in blobs written
before it.
``safetensors`` writes blobs; they are read as views into the buffer they were read into
(``safetensors.torch.load`` copies every tensor into fresh memory, which took 3x as long as
verifying the blob).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from blake3 import blake3
from safetensors.torch import save

from inferscale.contracts.kv_format import RAW, RAW_BITS, KVPiece, bits_of, quantize

if TYPE_CHECKING:
    from _hashlib import HASH


@dataclass(frozen=True, kw_only=True)
class KVBlob(KVPiece):
    """One fact's KV as stored (keys before RoPE), ready to rotate and inject."""

    token_ids: list[int]
    fingerprint: str
    window: int
    checksum: str | None = None  # of its content, verified when it was read

    def piece(self, skip: int = 0) -> KVPiece:
        """Its K/V without the first ``skip`` tokens (views)."""
        return KVPiece(k=self.k, v=self.v, kv_format=self.kv_format, k_params=self.k_params,
                       v_params=self.v_params, out_dtype=self.out_dtype).sliced(skip)


CHECKSUM_ALGORITHM = "blake3"
# sha256 reads ~1.5 GB/s here, BLAKE3 ~4 GB/s: verified page-ins from the durable tier are
# mostly hashing. Blobs without ``checksum_algorithm`` were written with sha256.
_HASHES: dict[str, Callable[[], blake3 | HASH]] = {"blake3": blake3, "sha256": hashlib.sha256}


def blob_checksum(tensors: list[torch.Tensor], kv_format: str = RAW,
                  algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Hex digest over the raw bytes of ``tensors`` (K, V, the token ids, then the params of
    a coded blob) and, for a coded blob, its format's name (a relabelled blob fails it)."""
    return _digest([t.contiguous().view(torch.uint8).numpy().data for t in tensors], kv_format,
                   algorithm)


def _digest(buffers: list[memoryview], kv_format: str, algorithm: str) -> str:
    """``blob_checksum`` of tensors given as their bytes (a read blob's slices of its buffer:
    no tensor op per tensor)."""
    if algorithm not in _HASHES:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    digest = _HASHES[algorithm]()
    for buffer in buffers:
        digest.update(buffer)
    if kv_format != RAW:
        digest.update(kv_format.encode())
    return digest.hexdigest()


def encode_blob(k: torch.Tensor, v: torch.Tensor, token_ids: list[int], fingerprint: str,
                window: int, kv_format: str = RAW) -> tuple[bytes, str]:
    """The blob's bytes (K and V stored in ``kv_format``) and checksum."""
    if k.shape != v.shape or k.dim() != 4 or k.shape[1] != len(token_ids):
        raise ValueError(f"bad KV shape k={tuple(k.shape)} v={tuple(v.shape)} "
                         f"tokens={len(token_ids)}")
    k, v = k.detach().contiguous().cpu(), v.detach().contiguous().cpu()
    stored = quantize(k, v, kv_format)
    tensors = {"k": stored.k, "v": stored.v, "token_ids": torch.tensor(token_ids,
                                                                        dtype=torch.int32)}
    if stored.k_params is not None and stored.v_params is not None:
        tensors |= {"k_params": stored.k_params, "v_params": stored.v_params}
    checksum = blob_checksum(list(tensors.values()), kv_format)
    metadata = {
        "fingerprint": fingerprint, "window": str(window), "checksum": checksum,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "dtype": str(k.dtype).removeprefix("torch."), "shape": ",".join(map(str, k.shape)),
    }
    if kv_format != RAW:
        metadata["kv_format"] = kv_format
    return save(tensors, metadata=metadata), checksum


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "I32": torch.int32, "U8": torch.uint8}
_ROW_DTYPES = {str(dtype).removeprefix("torch."): dtype
               for dtype in (torch.bfloat16, torch.float16, torch.float32)}
_TENSORS = ("k", "v", "token_ids")
_PARAMS = ("k_params", "v_params")


@dataclass(frozen=True)
class _Read:
    """A blob's tensors as views into its buffer, their bytes there, and its metadata."""

    tensors: dict[str, torch.Tensor]
    spans: dict[str, memoryview]
    metadata: dict[str, Any]


def _views(raw: bytes | bytearray | memoryview) -> _Read:
    """A blob's tensors as views into its buffer. A read-only buffer (``bytes``) is copied once;
    a writable one is used in place."""
    buffer = memoryview(raw)
    if buffer.readonly:
        buffer = memoryview(bytearray(buffer))
    if buffer.nbytes < 8:
        raise ValueError("shorter than a safetensors header")
    header_len = struct.unpack("<Q", buffer[:8])[0]
    if header_len > buffer.nbytes - 8:
        raise ValueError(f"a header of {header_len} bytes in a {buffer.nbytes}-byte blob")
    header = json.loads(bytes(buffer[8:8 + header_len]))
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("the metadata is not an object")
    names = _TENSORS if metadata.get("kv_format", RAW) == RAW else _TENSORS + _PARAMS
    if set(header) - {"__metadata__"} != set(names):
        raise ValueError(f"expected exactly the tensors {list(names)}")
    body_start, body_bytes = 8 + header_len, buffer.nbytes - 8 - header_len
    tensors, spans = {}, {}
    for name in names:
        entry = header[name]
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        start, end = entry["data_offsets"]
        if not (type(shape) is list and set(map(type, shape)) <= {int}
                and type(start) is int and type(end) is int and min(shape, default=0) >= 0
                and 0 <= start <= end <= body_bytes
                and end - start == math.prod(shape) * dtype.itemsize):
            raise ValueError(f"tensor {name}: shape {shape} does not fit its data offsets")
        if (body_start + start) % dtype.itemsize:  # the kernels read whole elements
            raise ValueError(f"tensor {name}: misaligned for {entry['dtype']}")
        spans[name] = buffer[body_start + start:body_start + end]
        tensors[name] = (torch.frombuffer(buffer, dtype=dtype, offset=body_start + start,
                                          count=(end - start) // dtype.itemsize)
                         if end > start else torch.empty(0, dtype=dtype)).view(shape)
    return _Read(tensors, spans, metadata)


def _stored(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> KVPiece:
    """The blob's K/V as stored, its tensors checked against each other and its format."""
    kv_format = str(metadata.get("kv_format", RAW))
    bits = bits_of(kv_format)
    k, v, ids = tensors["k"], tensors["v"], tensors["token_ids"]
    if k.shape != v.shape or k.dim() != 4 or ids.dim() != 1 or k.shape[1] != ids.numel() or (
            ids.dtype != torch.int32) or k.dtype != v.dtype:
        raise ValueError(f"inconsistent shapes k={tuple(k.shape)} v={tuple(v.shape)} "
                         f"token_ids={tuple(ids.shape)}")
    if bits == RAW_BITS:
        if k.dtype not in _ROW_DTYPES.values():
            raise ValueError(f"raw K/V of dtype {k.dtype}")
        return KVPiece(k=k, v=v)
    out_dtype = _ROW_DTYPES.get(str(metadata.get("dtype")))
    layers, tokens, heads, width = k.shape
    dim = width * 8 // bits
    k_params, v_params = tensors["k_params"], tensors["v_params"]
    if (k.dtype != torch.uint8 or out_dtype is None
            or k_params.shape != (layers, heads, 2, dim)
            or v_params.shape != (layers, tokens, heads, 2)
            or {k_params.dtype, v_params.dtype} != {torch.bfloat16}):
        raise ValueError(f"a {kv_format} blob whose codes and params do not fit its format")
    return KVPiece(k=k, v=v, kv_format=kv_format, k_params=k_params, v_params=v_params,
                   out_dtype=out_dtype)


def decode_blob(raw: bytes | bytearray | memoryview, known_checksum: str | None = None
                ) -> tuple[KVBlob, str | None]:
    """Decode a blob (its tensors are views into ``raw``); the checksum is None when the content
    does not match its own. ``known_checksum``: what these very bytes were verified to hold
    before (not hashed again if the blob still names it)."""
    read = _views(raw)
    metadata = read.metadata
    stored = _stored(read.tensors, metadata)
    if known_checksum is not None and known_checksum == metadata["checksum"]:
        checksum = known_checksum
    else:
        names = _TENSORS if stored.bits == RAW_BITS else _TENSORS + _PARAMS
        checksum = _digest([read.spans[name] for name in names], stored.kv_format,
                           metadata.get("checksum_algorithm", "sha256"))
    verified = checksum if checksum == metadata["checksum"] else None
    blob = KVBlob(k=stored.k, v=stored.v, kv_format=stored.kv_format, k_params=stored.k_params,
                  v_params=stored.v_params, out_dtype=stored.out_dtype,
                  token_ids=read.tensors["token_ids"].tolist(),
                  fingerprint=str(metadata["fingerprint"]), window=int(metadata["window"]),
                  checksum=verified)
    return blob, verified
