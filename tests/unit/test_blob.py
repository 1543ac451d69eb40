"""The blob codec: BLAKE3 checksums, blobs written with sha256 before it still verify, blobs read
in place, and malformed or damaged blobs are refused with an error."""

import hashlib
import json
import struct

import pytest
import torch
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from inferscale.contracts.blob import CHECKSUM_ALGORITHM, blob_checksum, decode_blob, encode_blob


def _kv(tokens=4):
    g = torch.Generator().manual_seed(1)
    shape = (2, tokens, 2, 8)
    return (torch.randn(shape, generator=g).to(torch.bfloat16),
            torch.randn(shape, generator=g).to(torch.bfloat16))


def _metadata(raw: bytes) -> dict:
    return _header(raw)[0]["__metadata__"]


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


def _header(raw: bytes) -> tuple[dict, bytes]:
    header_len = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + header_len]), raw[8 + header_len:]


def _with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def test_a_writable_buffer_is_decoded_in_place_and_bytes_are_copied_once():
    raw, checksum = encode_blob(*_kv(), [1, 2, 3, 4], "f" * 64, window=0)
    buffer = bytearray(raw)
    blob, verified = decode_blob(buffer)
    assert verified == checksum
    start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    assert start <= blob.k.data_ptr() < start + len(buffer)  # a view, not a copy
    copied, _ = decode_blob(raw)
    assert torch.equal(copied.k, blob.k) and torch.equal(copied.v, blob.v)


def _forgeries() -> list[tuple[str, bytes]]:
    raw, _ = encode_blob(*_kv(), [1, 2, 3, 4], "f" * 64, window=0)
    header, body = _header(raw)

    def edit(change) -> bytes:
        forged = json.loads(json.dumps(header))
        change(forged)
        return _with_header(forged, body)

    return [
        ("empty", b""),
        ("short", raw[:7]),
        ("header longer than the blob", struct.pack("<Q", 1 << 40) + raw[8:]),
        ("header not JSON", struct.pack("<Q", 4) + b"{{{{" + body),
        ("header a list", _with_header([], body)),  # type: ignore[arg-type]
        ("a tensor missing", edit(lambda h: h.pop("v"))),
        ("an extra tensor", edit(lambda h: h.update(x=h["k"]))),
        ("unknown dtype", edit(lambda h: h["k"].update(dtype="F8_E4M3"))),
        ("offsets past the end", edit(lambda h: h["v"].update(
            data_offsets=[h["v"]["data_offsets"][0], len(body) + 2]))),
        ("negative offset", edit(lambda h: h["k"].update(data_offsets=[-2, 126]))),
        ("shape larger than its bytes", edit(lambda h: h["k"].update(shape=[2, 4, 2, 9]))),
        ("shape not a list", edit(lambda h: h["k"].update(shape="2,4,2,8"))),
        ("float dimension", edit(lambda h: h["k"].update(shape=[2.0, 4, 2, 8]))),
        ("misaligned tensor", edit(lambda h: h["token_ids"].update(
            data_offsets=[h["token_ids"]["data_offsets"][0] - 1,
                          h["token_ids"]["data_offsets"][1] - 1]))),
        ("metadata a list", edit(lambda h: h.update(__metadata__=[]))),
        ("no fingerprint", edit(lambda h: h["__metadata__"].pop("fingerprint"))),
        ("token ids as floats", edit(lambda h: h["token_ids"].update(dtype="F32"))),
        ("k and v shapes differ", edit(lambda h: h["v"].update(
            shape=[4, 2, 2, 8]))),
    ]


@pytest.mark.parametrize(("case", "raw"), _forgeries(), ids=[c for c, _ in _forgeries()])
def test_a_malformed_blob_is_refused_with_an_error_never_read_out_of_bounds(case, raw):
    with pytest.raises(Exception) as error:  # the store reports any of them as unreadable
        decode_blob(raw)
    assert isinstance(error.value, (ValueError, KeyError, TypeError, RuntimeError)), case


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_damaged_blob_decodes_unverified_or_raises(data):
    raw, checksum = encode_blob(*_kv(), [1, 2, 3, 4], "f" * 64, window=0)
    damaged = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    damaged = damaged[:data.draw(st.integers(0, len(raw)))] if data.draw(st.booleans()) else damaged
    try:
        blob, verified = decode_blob(damaged)
    except (ValueError, KeyError, TypeError, RuntimeError):
        return
    assert verified in (None, checksum)
    if verified == checksum:  # only damage outside the tensors can leave the digest intact
        assert torch.equal(blob.k, _kv()[0]) and blob.token_ids == [1, 2, 3, 4]
