"""The blob codec: BLAKE3 checksums, and blobs written with sha256 before it still verify."""

import hashlib
import json
import struct

import pytest
import torch
from blake3 import blake3
from safetensors.torch import save

from inferscale.blob import CHECKSUM_ALGORITHM, blob_checksum, decode_blob, encode_blob


def _kv(tokens=4):
    g = torch.Generator().manual_seed(1)
    shape = (2, tokens, 2, 8)
    return (torch.randn(shape, generator=g).to(torch.bfloat16),
            torch.randn(shape, generator=g).to(torch.bfloat16))


def _metadata(raw: bytes) -> dict:
    header_len = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + header_len])["__metadata__"]


def test_new_blobs_carry_a_blake3_checksum_of_their_tensors():
    k, v = _kv()
    raw, checksum = encode_blob(k, v, [5, 6, 7, 8], "f" * 64, window=3)
    ids = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    expected = blake3(b"".join(t.view(torch.uint8).numpy().tobytes() for t in (k, v, ids)))
    assert CHECKSUM_ALGORITHM == "blake3" and checksum == expected.hexdigest()
    assert _metadata(raw)["checksum_algorithm"] == "blake3"
    blob, verified = decode_blob(raw)
    assert verified == checksum and torch.equal(blob.k, k) and blob.token_ids == [5, 6, 7, 8]


def test_blobs_written_with_sha256_before_blake3_still_verify():
    k, v = _kv()
    ids = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    legacy = blob_checksum(k, v, ids, "sha256")
    assert legacy == hashlib.sha256(
        b"".join(t.view(torch.uint8).numpy().tobytes() for t in (k, v, ids))).hexdigest()
    raw = save({"k": k, "v": v, "token_ids": ids}, metadata={
        "fingerprint": "f" * 64, "window": "0", "checksum": legacy, "dtype": "bfloat16",
        "shape": ",".join(map(str, k.shape))})
    blob, verified = decode_blob(raw)
    assert verified == legacy and torch.equal(blob.v, v)


@pytest.mark.parametrize("algorithm", ["sha256", "md5", ""])
def test_a_blob_whose_algorithm_was_changed_is_refused(algorithm):
    raw, checksum = encode_blob(*_kv(), [1, 2, 3, 4], "f" * 64, window=0)
    metadata = _metadata(raw)
    k, v = _kv()
    metadata["checksum_algorithm"] = algorithm
    forged = save({"k": k, "v": v, "token_ids": torch.tensor([1, 2, 3, 4], dtype=torch.int32)},
                  metadata=metadata)
    if algorithm == "sha256":
        assert decode_blob(forged)[1] is None  # the digest no longer matches
    else:
        with pytest.raises(ValueError, match="unknown checksum algorithm"):
            decode_blob(forged)  # the store reports it unreadable (ChecksumMismatch)
