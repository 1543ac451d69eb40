"""Transform-coded KV (pure logic): a profile fitted on correlated rows finds their axes, coding
loses what its step says and no more, coarser steps take fewer bytes, fixed-rate codes spend the
bits the water-filling gives, and any bytes that are not a coded blob of the profile's shape are
refused by name (never another exception)."""

import struct

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.lab.transform_coding import (
    HEADER,
    MAGIC,
    FixedRateCoder,
    ProfileFit,
    TransformCodingError,
    TransformProfile,
    allocate,
    decode,
    encode,
)

LAYERS, HEADS, DIM = 3, 2, 16


def _rows(tokens: int, seed: int) -> torch.Tensor:
    """K/V-like rows: a few strong directions, an offset and a little noise."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(LAYERS, HEADS, 4, DIM, generator=torch.Generator().manual_seed(99))
    latent = torch.randn(LAYERS, HEADS, tokens, 4, generator=generator) * 3
    rows = latent @ mix + 0.05 * torch.randn(LAYERS, HEADS, tokens, DIM, generator=generator)
    return (rows + 1.5).permute(0, 2, 1, 3).contiguous()  # [layers, tokens, heads, dim]


@pytest.fixture(scope="module")
def profile() -> TransformProfile:
    fit = ProfileFit()
    for seed in range(20):
        fit.add(_rows(30, seed), _rows(30, seed + 100))
    return fit.profile("test-model")


def test_the_profile_finds_orthonormal_axes_ordered_by_variance(profile):
    for kind in ("k", "v"):
        axes = profile.axes[kind]
        eye = torch.eye(DIM).expand(LAYERS, HEADS, DIM, DIM)
        assert torch.allclose(axes.transpose(-1, -2) @ axes, eye, atol=1e-4)
        variance = profile.variance[kind]
        assert (variance[..., :-1] >= variance[..., 1:]).all()
        # four strong directions hold nearly all of it
        assert (variance[..., :4].sum(-1) / variance.sum(-1)).min() > 0.99


def test_coding_loses_what_the_step_says_and_coarser_costs_less(profile):
    k, v = _rows(40, 7).to(torch.bfloat16), _rows(40, 8).to(torch.bfloat16)
    sizes, errors = [], []
    for quality in (0.01, 0.1, 0.5):
        blob = encode(k, v, profile, quality)
        k2, v2 = decode(blob, profile, torch.float32)
        assert k2.shape == k.shape and v2.dtype == torch.float32
        step = profile.steps(quality).max()
        # a rounding error of at most half a step per component, rotated back
        assert (k2 - k.float()).norm(dim=-1).max() <= 0.5 * step * DIM**0.5 + 0.05
        sizes.append(len(blob))
        errors.append(float((k2 - k.float()).pow(2).mean() + (v2 - v.float()).pow(2).mean()))
    assert sizes[0] > sizes[1] > sizes[2]
    assert errors[0] < errors[1] < errors[2]
    raw = k.nbytes + v.nbytes
    assert sizes[2] < raw / 8  # the shared basis and zstd take the zeros away


def test_a_fine_step_takes_wide_codes_and_still_decodes(profile):
    k, v = _rows(5, 1), _rows(5, 2)
    blob = encode(k, v, profile, 0.002)
    assert blob[5] == 2  # two bytes a code
    k2, _ = decode(blob, profile, torch.float32)
    assert torch.allclose(k2, k, atol=0.05)
    with pytest.raises(TransformCodingError, match="too fine"):
        encode(k * 1000, v, profile, 0.002)


def test_a_profile_survives_saving_and_a_broken_one_is_refused(profile, tmp_path):
    path = tmp_path / "profile.safetensors"
    profile.save(path)
    again = TransformProfile.load(path)
    assert again.model == "test-model" and again.shape == (LAYERS, HEADS, DIM)
    assert torch.equal(again.axes["v"], profile.axes["v"])
    (tmp_path / "junk").write_bytes(b"not safetensors")
    with pytest.raises(TransformCodingError):
        TransformProfile.load(tmp_path / "junk")
    with pytest.raises(TransformCodingError):
        TransformProfile.load(tmp_path / "missing")
    broken = TransformProfile({**profile.mean, "k": profile.mean["k"][:, :1]}, profile.axes,
                              profile.variance, "x")
    broken.save(tmp_path / "broken")
    with pytest.raises(TransformCodingError, match="inconsistent"):
        TransformProfile.load(tmp_path / "broken")


def test_kv_of_another_shape_or_a_bad_quality_is_refused(profile):
    k = _rows(4, 3)
    with pytest.raises(TransformCodingError, match="do not fit"):
        encode(k[:, :, :1], k[:, :, :1], profile, 0.1)
    with pytest.raises(TransformCodingError, match="do not fit"):
        encode(k, k[:, :2], profile, 0.1)
    for quality in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(TransformCodingError):
            encode(k, k, profile, quality)


def test_blobs_that_lie_are_refused(profile):
    k = _rows(6, 4)
    blob = encode(k, k, profile, 0.2)
    header, frame = blob[:HEADER.size], blob[HEADER.size:]
    fields = list(HEADER.unpack(header))
    lies = {
        "magic": (b"XXXX", *fields[1:]),
        "version": (MAGIC, 9, *fields[2:]),
        "width": (MAGIC, fields[1], 3, *fields[3:]),
        "layers": (*fields[:3], LAYERS + 1, *fields[4:]),
        "tokens": (*fields[:4], 7, *fields[5:]),  # the frame holds fewer codes
        "huge": (*fields[:4], 1 << 30, *fields[5:]),
        "quality": (*fields[:7], float("nan")),
    }
    for name, lie in lies.items():
        with pytest.raises(TransformCodingError):
            decode(HEADER.pack(*lie) + frame, profile)
        assert name
    with pytest.raises(TransformCodingError):
        decode(header + frame[: len(frame) // 2], profile)
    with pytest.raises(TransformCodingError):
        decode(blob[:10], profile)
    bomb = zstandard.ZstdCompressor().compress(bytes(50_000_000))
    with pytest.raises(TransformCodingError):
        decode(header + bomb, profile)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256), st.integers(0, 40))
def test_any_bytes_decode_or_are_refused_by_name(profile, data, tokens):
    header = struct.pack("<4sBBHIHHf", MAGIC, 1, 1, LAYERS, tokens, HEADS, DIM, 0.2)
    for blob in (data, header + data):
        try:
            k, v = decode(blob, profile)
        except TransformCodingError:
            continue
        assert k.shape == v.shape == (LAYERS, tokens, HEADS, DIM)


def test_water_filling_gives_strong_components_more_bits_and_meets_the_mean():
    variance = torch.tensor([64.0, 16.0, 4.0, 1.0, 0.25, 0.01, 0.001, 0.0001])
    for mean_bits in (0.5, 1.0, 2.0, 4.0):
        widths = allocate(variance, mean_bits)
        assert set(widths.tolist()) <= {0.0, 1.0, 2.0, 4.0, 8.0}
        assert float(widths.mean()) <= mean_bits
        assert (widths[:-1] >= widths[1:]).all()  # never more bits for a weaker component
    assert allocate(variance, 2.0).mean() > allocate(variance, 1.0).mean()


def test_fixed_rate_codes_take_their_bits_and_lose_less_with_more(profile):
    k, v = _rows(40, 11), _rows(40, 12)
    raw_bytes = 2 * k.numel() * 2  # bf16
    errors = []
    for mean_bits in (0.5, 1.0, 2.0, 4.0):
        coder = FixedRateCoder(profile, mean_bits)
        coded = coder.encode(k, v)
        k2, v2 = coder.decode(coded, 40, torch.float32)
        assert k2.shape == k.shape and v2.shape == v.shape
        # packed codes: the allocation's bits, give or take a byte of padding per width
        assert coder.nbytes(coded) <= raw_bytes * coder.mean_bits / 16 + 40 * len(coded)
        errors.append(float((k2 - k).pow(2).mean() + (v2 - v).pow(2).mean()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.01 * errors[0]
    with pytest.raises(TransformCodingError):
        FixedRateCoder(profile, 0.0)
    with pytest.raises(TransformCodingError, match="do not fit"):
        FixedRateCoder(profile, 1.0).encode(k[:, :, :1], v[:, :, :1])
