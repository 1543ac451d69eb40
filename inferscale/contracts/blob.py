"""The one KV blob format (safetensors): encode and decode, with its checksum.

``k`` (pre-RoPE) and ``v`` as ``[layers, tokens, kv_heads, head_dim]`` in the model dtype,
``token_ids`` (int32); metadata: model fingerprint, window, dtype, shape and a checksum of K, V
and the token ids: BLAKE3 (``checksum_algorithm``), or sha256 in blobs written before it.
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

if TYPE_CHECKING:
    from _hashlib import HASH


@dataclass(frozen=True)
class KVBlob:
    """One fact's KV, ready to rotate and inject."""

    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim], keys before RoPE
    v: torch.Tensor
    token_ids: list[int]
    fingerprint: str
    window: int
    checksum: str | None = None  # of its content, verified when it was read

    @property
    def nbytes(self) -> int:
        nbytes: int = self.k.nbytes + self.v.nbytes
        return nbytes


CHECKSUM_ALGORITHM = "blake3"
# sha256 reads ~1.5 GB/s here, BLAKE3 ~4 GB/s: verified page-ins from the durable tier are
# mostly hashing. Blobs without ``checksum_algorithm`` were written with sha256.
_HASHES: dict[str, Callable[[], blake3 | HASH]] = {"blake3": blake3, "sha256": hashlib.sha256}


def blob_checksum(k: torch.Tensor, v: torch.Tensor, token_ids: torch.Tensor,
                  algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Hex digest over the raw bytes of K, V and the token ids."""
    if algorithm not in _HASHES:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    digest = _HASHES[algorithm]()
    for tensor in (k, v, token_ids):
        digest.update(tensor.contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def encode_blob(k: torch.Tensor, v: torch.Tensor, token_ids: list[int], fingerprint: str,
                window: int) -> tuple[bytes, str]:
    """The blob's bytes and checksum."""
    if k.shape != v.shape or k.dim() != 4 or k.shape[1] != len(token_ids):
        raise ValueError(f"bad KV shape k={tuple(k.shape)} v={tuple(v.shape)} "
                         f"tokens={len(token_ids)}")
    k, v = k.detach().contiguous().cpu(), v.detach().contiguous().cpu()
    ids = torch.tensor(token_ids, dtype=torch.int32)
    checksum = blob_checksum(k, v, ids)
    metadata = {
        "fingerprint": fingerprint, "window": str(window), "checksum": checksum,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "dtype": str(k.dtype).removeprefix("torch."), "shape": ",".join(map(str, k.shape)),
    }
    return save({"k": k, "v": v, "token_ids": ids}, metadata=metadata), checksum


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "I32": torch.int32}
_TENSORS = ("k", "v", "token_ids")


def _views(raw: bytes | bytearray | memoryview
           ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A blob's tensors as views into its buffer, and its metadata. A read-only buffer
    (``bytes``) is copied once; a writable one is used in place."""
    buffer = memoryview(raw)
    if buffer.readonly:
        buffer = memoryview(bytearray(buffer))
    if buffer.nbytes < 8:
        raise ValueError("shorter than a safetensors header")
    header_len = struct.unpack("<Q", buffer[:8])[0]
    if header_len > buffer.nbytes - 8:
        raise ValueError(f"a header of {header_len} bytes in a {buffer.nbytes}-byte blob")
    header = json.loads(bytes(buffer[8:8 + header_len]))
    if not isinstance(header, dict) or set(header) - {"__metadata__"} != set(_TENSORS):
        raise ValueError(f"expected exactly the tensors {list(_TENSORS)}")
    body = buffer[8 + header_len:]
    data = torch.frombuffer(body, dtype=torch.uint8) if body.nbytes else torch.empty(
        0, dtype=torch.uint8)
    tensors = {}
    for name in _TENSORS:
        entry = header[name]
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        start, end = entry["data_offsets"]
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0
                                                for n in (*shape, start, end))
                and start <= end <= data.numel()
                and end - start == math.prod(shape) * dtype.itemsize):
            raise ValueError(f"tensor {name}: shape {shape} does not fit its data offsets")
        tensors[name] = data[start:end].view(dtype).view(shape)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("the metadata is not an object")
    return tensors, metadata


def decode_blob(raw: bytes | bytearray | memoryview, known_checksum: str | None = None
                ) -> tuple[KVBlob, str | None]:
    """Decode a blob (its tensors are views into ``raw``); the checksum is None when the content
    does not match its own. ``known_checksum``: what these very bytes were verified to hold
    before (not hashed again if the blob still names it)."""
    tensors, metadata = _views(raw)
    k, v, ids = tensors["k"], tensors["v"], tensors["token_ids"]
    if k.shape != v.shape or k.dim() != 4 or ids.dim() != 1 or k.shape[1] != ids.numel() or (
            ids.dtype != torch.int32):
        raise ValueError(f"inconsistent shapes k={tuple(k.shape)} v={tuple(v.shape)} "
                         f"token_ids={tuple(ids.shape)}")
    if known_checksum is not None and known_checksum == metadata["checksum"]:
        checksum = known_checksum
    else:
        checksum = blob_checksum(k, v, ids, metadata.get("checksum_algorithm", "sha256"))
    verified = checksum if checksum == metadata["checksum"] else None
    blob = KVBlob(k=k, v=v, token_ids=ids.tolist(), fingerprint=str(metadata["fingerprint"]),
                  window=int(metadata["window"]), checksum=verified)
    return blob, verified
