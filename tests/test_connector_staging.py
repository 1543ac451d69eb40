"""The connector's staging buffer: K and V views for a step, kept and grown across steps."""

import torch

from inferscale.connector import InferScaleConnector


def _connector() -> InferScaleConnector:
    connector = InferScaleConnector.__new__(InferScaleConnector)
    connector._staging = None
    return connector


def test_staging_is_reused_grown_and_never_overlaps():
    connector = _connector()
    like = torch.zeros(3, 1, 2, 4, dtype=torch.bfloat16)  # [layers, tokens, heads, head_dim]
    k, v = connector._staged(10, like)
    assert k.shape == v.shape == (3, 10, 2, 4) and k.is_contiguous() and v.is_contiguous()
    k.fill_(1)
    v.fill_(2)
    assert (k == 1).all() and (v == 2).all()  # K and V do not share memory
    first = connector._staging.data_ptr()
    k_small, _ = connector._staged(4, like)  # a smaller step: the same memory
    assert connector._staging.data_ptr() == first and k_small.data_ptr() == first
    k_big, v_big = connector._staged(50, like)  # a bigger step: grown
    assert k_big.shape == (3, 50, 2, 4) and connector._staging.numel() == 2 * 3 * 50 * 2 * 4
    assert v_big.data_ptr() - k_big.data_ptr() == k_big.numel() * k_big.element_size()


def test_staging_follows_the_pieces_dtype():
    connector = _connector()
    connector._staged(8, torch.zeros(2, 1, 1, 4, dtype=torch.bfloat16))
    k, _ = connector._staged(8, torch.zeros(2, 1, 1, 4, dtype=torch.float32))
    assert k.dtype == torch.float32
    torch.cat([torch.ones(2, 3, 1, 4), torch.ones(2, 5, 1, 4)], dim=1, out=k)
    assert (k == 1).all()
