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
    legacy = blob_checksum([k, v, ids], algorithm="sha256")
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
        ("misaligned keys", edit(lambda h: h["k"].update(
            data_offsets=[h["k"]["data_offsets"][0] + 1, h["k"]["data_offsets"][1] + 1]))),
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


CODED = ["int8", "fp8", "int4", "int2"]


@pytest.mark.parametrize("kv_format", ["raw", *CODED])
def test_each_format_round_trips_within_half_a_step(kv_format):
    """Codes dequantise to within half a quantisation step (fp8: half an e4m3 step, relative)
    plus the dtype's rounding of the encoded K/V; raw blobs are exact. The format is recorded
    and verified with the blob."""
    k, v = _kv(tokens=9)
    raw, checksum = encode_blob(k, v, list(range(9)), "f" * 64, window=0, kv_format=kv_format)
    blob, verified = decode_blob(raw)
    assert verified == checksum and blob.shape == tuple(k.shape) and blob.dtype == k.dtype
    got_k, got_v = blob.dequantized()
    if kv_format == "raw":
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        return
    assert blob.k_params is not None and blob.v_params is not None
    k_params = blob.k_params[:, None].float().transpose(-1, -2)  # per channel
    v_params = blob.v_params.float()[..., None, :]  # per token
    for got, want, params in ((got_k, k, k_params), (got_v, v, v_params)):
        error = (got.float() - want.float()).abs()
        scale, zero = params[..., 0], params[..., 1]
        if kv_format == "fp8":  # 3 mantissa bits; subnormal steps of 2^-9
            step = (want.float() - zero).abs() * 2**-3 + scale * 2**-9
        else:
            step = scale
        assert (error <= step * 0.51 + want.float().abs() * 2**-7).all()


def test_coded_formats_take_the_bytes_their_bits_say():
    """A SmolLM2-135M-shaped fact (30 layers, 44 tokens, 3 KV heads, head_dim 64)."""
    k, v = torch.randn(2, 30, 44, 3, 64).to(torch.bfloat16)
    sizes = {f: len(encode_blob(k, v, [1] * 44, "f" * 64, 0, f)[0]) for f in ["raw", *CODED]}
    assert sizes["int8"] < 0.56 * sizes["raw"] and sizes["fp8"] == sizes["int8"]
    assert sizes["int4"] < 0.30 * sizes["raw"]
    assert sizes["int2"] < 0.17 * sizes["raw"]


def test_an_unknown_format_is_refused_when_writing():
    with pytest.raises(ValueError, match="unknown KV format"):
        encode_blob(*_kv(), [1, 2, 3, 4], "f" * 64, window=0, kv_format="int3")


def _coded_forgeries() -> list[tuple[str, bytes]]:
    raw, _ = encode_blob(*_kv(), [1, 2, 3, 4], "f" * 64, window=0, kv_format="int4")
    header, body = _header(raw)
    int8, _ = encode_blob(*_kv(), [1, 2, 3, 4], "f" * 64, window=0, kv_format="int8")

    def relabelled(blob: bytes, name: str) -> bytes:  # the same bytes under another format
        forged, rest = _header(blob)
        forged["__metadata__"]["kv_format"] = name
        return _with_header(forged, rest)

    def edit(change) -> bytes:
        forged = json.loads(json.dumps(header))
        change(forged)
        return _with_header(forged, body)

    def label(name):
        return lambda h: h["__metadata__"].update(kv_format=name)

    return [
        ("labelled int2", edit(label("int2"))),
        ("labelled int8", edit(label("int8"))),
        ("labelled raw", edit(label("raw"))),
        ("label dropped", edit(lambda h: h["__metadata__"].pop("kv_format"))),
        ("labelled fp8", edit(label("fp8"))),
        ("int8 codes labelled fp8", relabelled(int8, "fp8")),  # fits the shapes: the digest
        ("unknown format", edit(label("fp4"))),
        ("params missing", edit(lambda h: h.pop("k_params"))),
        ("params as codes", edit(lambda h: h["v_params"].update(dtype="U8"))),
        ("codes as bf16", edit(lambda h: h["k"].update(dtype="BF16", shape=[2, 4, 2, 2]))),
        ("unknown dequantised dtype", edit(lambda h: h["__metadata__"].update(dtype="int8"))),
    ]


@pytest.mark.parametrize(("case", "raw"), _coded_forgeries(),
                         ids=[c for c, _ in _coded_forgeries()])
def test_a_mislabelled_or_malformed_coded_blob_is_refused_or_unverified(case, raw):
    """Never read as K/V that passes its checksum: the store then recomputes the blocks."""
    try:
        _, verified = decode_blob(raw)
    except (ValueError, KeyError, TypeError, RuntimeError):
        return
    assert verified is None, case


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(CODED))
def test_a_damaged_coded_blob_decodes_unverified_or_raises(data, kv_format):
    raw, checksum = encode_blob(*_kv(), [1, 2, 3, 4], "f" * 64, window=0, kv_format=kv_format)
    damaged = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        blob, verified = decode_blob(damaged)
    except (ValueError, KeyError, TypeError, RuntimeError):
        return
    assert verified in (None, checksum)
    if verified == checksum:  # damage outside the tensors: the same K/V
        expected, _ = decode_blob(raw)
        assert all(torch.equal(a, b) for a, b in zip(blob.dequantized(), expected.dequantized(),
                                                     strict=True))
