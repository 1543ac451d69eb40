"""Chunked RoPE: rotate stored pre-RoPE keys to the positions they occupy at serving time.

Each layer turns with its own table (``model_family.py``: one set of parameters for every
layer, or one per layer type), in the family's style (neox halves or interleaved pairs).

The cos/sin table is vLLM's own (``get_rope`` returns the serving model's cached instance) and
the rotation is vLLM's own in-place rotary kernel (the one that rotates serving keys, CPU or
CUDA), called once for all layers, so injected keys match what vLLM computes for the same
positions. Where vLLM is not installed (a GPU box with transformers only) the table is built
from transformers' RoPE init functions, which the test suite checks against vLLM's, and the
rotation is ``apply_rope`` in torch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from inferscale.kv.model_family import UnsupportedModel, attention_shape

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def model_head_dim(config: PreTrainedConfig) -> int:
    """Per-head dimension of a HF decoder config."""
    dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return dim


def _vllm_cos_sin(config: PreTrainedConfig, params: dict[str, Any], neox: bool,
                  max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope

    def build() -> RotaryEmbedding:
        return get_rope(model_head_dim(config), max_position=max_position, is_neox_style=neox,
                        rope_parameters=params, dtype=dtype)

    if get_current_vllm_config_or_none() is not None:  # inside a vLLM process
        rope = build()
    else:
        with set_current_vllm_config(VllmConfig()):
            rope = build()
    return rope.cos_sin_cache, rope.rotary_dim


def _hf_cos_sin(config: PreTrainedConfig, params: dict[str, Any], max_position: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(model_head_dim(config) * params.get("partial_rotary_factor", 1.0))
        exponent = torch.arange(0, dim, 2, dtype=torch.float) / dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
    else:
        one_set = copy.copy(config)  # transformers reads the parameters from the config
        one_set.rope_parameters = params
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](one_set, "cpu")
    freqs = torch.einsum("i,j -> ij", torch.arange(max_position, dtype=torch.float), inv_freq)
    cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    return cache.to(dtype), 2 * inv_freq.numel()


def cos_sin_table(config: PreTrainedConfig, params: dict[str, Any], neox: bool,
                  max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(cos|sin table [max_position, rotary_dim], rotary_dim) for one set of RoPE parameters
    of this model, vLLM's if present."""
    try:
        return _vllm_cos_sin(config, params, neox, max_position, dtype)
    except ImportError:
        return _hf_cos_sin(config, params, max_position, dtype)


def apply_rope(x: torch.Tensor, rows: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
               neox: bool = True) -> torch.Tensor:
    """Rotation of ``x [..., tokens, heads, head_dim]`` by the ``cos_sin`` rows ``rows
    [tokens]``: neox style (the first and second halves of the rotary dimensions are the pairs)
    or interleaved (neighbouring dimensions are)."""
    cos, sin = cos_sin.index_select(0, rows).unsqueeze(-2).chunk(2, dim=-1)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def _vllm_kernel() -> Callable[..., None] | None:
    """vLLM's in-place rotary kernel, or None where vLLM is not installed."""
    try:
        from vllm import _custom_ops
    except ImportError:
        return None
    kernel: Callable[..., None] = _custom_ops.rotary_embedding
    return kernel


class ChunkedRope:
    """Rotates ``[layers, tokens, kv_heads, head_dim]`` keys for all layers in one call, each
    layer with its own RoPE table (one per distinct set of parameters: Gemma 3's local and
    global layers differ), neox style or interleaved as the family rotates."""

    def __init__(self, config: PreTrainedConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_position: int | None = None) -> None:
        shape = attention_shape(config)
        self.max_position = max_position or config.max_position_embeddings
        self.neox = shape.family.neox
        built = [cos_sin_table(config, params, self.neox, self.max_position, dtype)
                 for params in shape.rope_parameters]
        dims = {rotary_dim for _, rotary_dim in built}
        if len(dims) != 1:
            raise UnsupportedModel(f"layers rotate different numbers of dimensions: {dims}")
        self.rotary_dim = dims.pop()
        #: every table's rows, one after the other: ``[tables * max_position, rotary_dim]``
        self.cos_sin = torch.cat([table for table, _ in built]).to(device=device, dtype=dtype)
        #: per layer: the row of ``cos_sin`` where its table starts (position 0)
        self.layer_rows = torch.tensor(shape.layer_rope, dtype=torch.int64,
                                       device=device) * self.max_position
        self._kernel = _vllm_kernel()

    def rows(self, layers: int, positions: torch.Tensor) -> torch.Tensor:
        """The ``cos_sin`` rows of ``positions`` in each of the first ``layers`` layers,
        ``[layers * tokens]`` on the table's device."""
        positions = positions.to(self.cos_sin.device)
        return (self.layer_rows[:layers, None] + positions[None, :]).flatten()

    def rotate_(self, keys: torch.Tensor, positions: torch.Tensor,
                scales: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate contiguous keys in place to ``positions`` (one per token, shared by every
        layer) and multiply them by ``scales [layers, tokens]`` where given; returns ``keys``.

        Scales ride in the rotation: each (layer, token) row gets its own cos|sin row times its
        scale, so rotating and scaling is one pass over the keys instead of two (the keys are
        ~3x the table's size: one per KV head)."""
        layers, tokens, heads, head_dim = keys.shape
        table, rows = self.cos_sin, self.rows(layers, positions)
        if scales is not None:
            scales = scales.to(self.cos_sin.device, self.cos_sin.dtype)
            table = self.cos_sin.index_select(0, rows) * scales.reshape(-1, 1)
            rows = torch.arange(layers * tokens, device=self.cos_sin.device)
            if self.rotary_dim < head_dim:  # the dimensions RoPE leaves alone
                keys[..., self.rotary_dim:].mul_(scales[..., None, None])
        flat = keys.view(layers * tokens, heads, head_dim)
        if self._kernel is None:
            flat.copy_(apply_rope(flat, rows, table, self.rotary_dim, self.neox))
        else:
            self._kernel(rows, flat.view(layers * tokens, heads * head_dim), None, head_dim,
                         table, self.neox)
        return keys

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor,
               scales: torch.Tensor | None = None) -> torch.Tensor:
        """Keys rotated to ``positions`` (and scaled, see ``rotate_``): a rotated copy."""
        return self.rotate_(keys.clone(memory_format=torch.contiguous_format), positions, scales)
