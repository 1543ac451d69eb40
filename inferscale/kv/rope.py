"""Chunked RoPE: rotate stored pre-RoPE keys to the positions they occupy at serving time.

The cos/sin table is vLLM's own (``get_rope`` returns the serving model's cached instance) and
the rotation is vLLM's own in-place rotary kernel (the one that rotates serving keys, CPU or
CUDA), called once for all layers, so injected keys match what vLLM computes for the same
positions. Where vLLM is not installed (a GPU box with transformers only) the table is built
from transformers' RoPE init functions, which the test suite checks against vLLM's, and the
rotation is ``apply_rope`` in torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def model_head_dim(config: PreTrainedConfig) -> int:
    """Per-head dimension of a HF decoder config."""
    dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return dim


def _vllm_cos_sin(config: PreTrainedConfig, max_position: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, int]:
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope

    def build() -> RotaryEmbedding:
        return get_rope(model_head_dim(config), max_position=max_position, is_neox_style=True,
                        rope_parameters=config.rope_parameters, dtype=dtype)

    if get_current_vllm_config_or_none() is not None:  # inside a vLLM process
        rope = build()
    else:
        with set_current_vllm_config(VllmConfig()):
            rope = build()
    return rope.cos_sin_cache, rope.rotary_dim


def _hf_cos_sin(config: PreTrainedConfig, max_position: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, int]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(model_head_dim(config) * params.get("partial_rotary_factor", 1.0))
        exponent = torch.arange(0, dim, 2, dtype=torch.float) / dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    freqs = torch.einsum("i,j -> ij", torch.arange(max_position, dtype=torch.float), inv_freq)
    cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    return cache.to(dtype), 2 * inv_freq.numel()


def cos_sin_table(config: PreTrainedConfig, max_position: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, int]:
    """(cos|sin table [max_position, rotary_dim], rotary_dim) for this model, vLLM's if present."""
    try:
        return _vllm_cos_sin(config, max_position, dtype)
    except ImportError:
        return _hf_cos_sin(config, max_position, dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               rotary_dim: int) -> torch.Tensor:
    """Neox-style rotation of ``x [..., tokens, heads, head_dim]`` at ``positions [tokens]``."""
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(-2).chunk(2, dim=-1)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
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
    """Rotates ``[layers, tokens, kv_heads, head_dim]`` keys for all layers in one call."""

    def __init__(self, config: PreTrainedConfig, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings
        table, self.rotary_dim = cos_sin_table(config, max_position, dtype)
        self.cos_sin = table.to(device=device, dtype=dtype)
        self._kernel = _vllm_kernel()

    def rotate_(self, keys: torch.Tensor, positions: torch.Tensor,
                scales: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate contiguous keys in place to ``positions`` (one per token, shared by every
        layer) and multiply them by ``scales [layers, tokens]`` where given; returns ``keys``.

        Scales ride in the rotation: each (layer, token) row gets its own cos|sin row times its
        scale, so rotating and scaling is one pass over the keys instead of two (the keys are
        ~3x the table's size: one per KV head)."""
        layers, tokens, heads, head_dim = keys.shape
        positions = positions.to(self.cos_sin.device)
        if scales is None:
            table, rows = self.cos_sin, positions.repeat(layers)
        else:
            scales = scales.to(self.cos_sin.device, self.cos_sin.dtype)
            table = (self.cos_sin.index_select(0, positions) * scales[..., None]).view(
                layers * tokens, -1)
            rows = torch.arange(layers * tokens, device=self.cos_sin.device)
            if self.rotary_dim < head_dim:  # the dimensions RoPE leaves alone
                keys[..., self.rotary_dim:].mul_(scales[..., None, None])
        flat = keys.view(layers * tokens, heads, head_dim)
        if self._kernel is None:
            flat.copy_(apply_rope(flat, rows, table, self.rotary_dim))
        else:
            self._kernel(rows, flat.view(layers * tokens, heads * head_dim), None, head_dim,
                         table, True)
        return keys

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor,
               scales: torch.Tensor | None = None) -> torch.Tensor:
        """Keys rotated to ``positions`` (and scaled, see ``rotate_``): a rotated copy."""
        return self.rotate_(keys.clone(memory_format=torch.contiguous_format), positions, scales)
