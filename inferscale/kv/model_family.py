"""What pre-RoPE KV reuse must know of a model's attention, per family, and what it refuses.

Per layer: where its keys are before the rotation (the key projection's output with its bias,
after the per-head key norm where the family has one, or the key part of a fused projection),
the rotation's parameters (one set for every layer, or one per layer type: Gemma 3's local and
global layers), its style (neox halves or interleaved pairs), how many dimensions it turns
(partial rotary) and the layer's attention window (None: full attention). A model whose keys
are not per-head projections turned by a table fixed per position is refused, with the reason,
before anything is encoded or served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


class UnsupportedModel(ValueError):
    """The model cannot be served with pre-RoPE KV reuse."""


@dataclass(frozen=True)
class Family:
    """Where a family's attention module holds its pre-RoPE keys and its values: the output of
    module ``keys`` / ``values`` (``[batch, tokens, ...]``; ``heads_first``: the keys module's
    is ``[batch, heads, tokens, head_dim]``); ``fused``: one q|k|v projection whose output is
    split."""

    keys: str
    values: str
    neox: bool = True
    fused: bool = False
    heads_first: bool = False


FAMILIES = {
    "llama": Family("k_proj", "v_proj"),
    "mistral": Family("k_proj", "v_proj"),
    "qwen2": Family("k_proj", "v_proj"),
    "qwen3": Family("k_norm", "v_proj"),
    "gemma3_text": Family("k_norm", "v_proj", heads_first=True),
    "glm4": Family("k_proj", "v_proj", neox=False),
    "phi3": Family("qkv_proj", "qkv_proj", fused=True),
}
# RoPE variants whose table depends on the sequence's length, not only on the position.
_LENGTH_DEPENDENT_ROPE = {"dynamic": "dynamic NTK scaling", "longrope": "LongRoPE"}
_MLA = ("multi-head latent attention: its keys share one latent and a decoupled RoPE part "
        "across heads, so there are no per-head pre-RoPE keys to store")


@dataclass(frozen=True)
class AttentionShape:
    """The attention of one model as pre-RoPE reuse sees it."""

    family: Family
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_parameters: tuple[dict[str, Any], ...]  # each distinct set once
    layer_rope: tuple[int, ...]  # per layer: its set in ``rope_parameters``
    windows: tuple[int | None, ...]  # per layer: its sliding window in tokens, None: full

    def projection_slice(self, slot: int) -> slice:
        """Where keys (slot 0) or values (1) lie in the last dimension of their module's
        output: all of it, or their part of a fused q|k|v projection."""
        if not self.family.fused:
            return slice(None)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return slice(q, q + kv) if slot == 0 else slice(q + kv, q + 2 * kv)


def _rope_sets(config: PreTrainedConfig, layer_types: list[str]
               ) -> tuple[tuple[dict[str, Any], ...], tuple[int, ...]]:
    params = getattr(config, "rope_parameters", None)
    if not params:
        raise UnsupportedModel("the model has no rotary position embedding")
    per_type = all(isinstance(value, dict) for value in params.values())
    layer_params = [params[kind] for kind in layer_types] if per_type else [params] * len(
        layer_types)
    keys = [json.dumps(p, sort_keys=True) for p in layer_params]
    distinct = list(dict.fromkeys(keys))
    for p in layer_params:
        kind = p.get("rope_type", "default")
        if kind in _LENGTH_DEPENDENT_ROPE:
            raise UnsupportedModel(f"{_LENGTH_DEPENDENT_ROPE[kind]} RoPE ({kind!r}) changes "
                                   "every key's rotation with the sequence's length")
    return (tuple(json.loads(k) for k in distinct),
            tuple(distinct.index(k) for k in keys))


def attention_shape(config: PreTrainedConfig) -> AttentionShape:
    """The attention of the model ``config`` describes; raises ``UnsupportedModel`` naming why
    it cannot be served with pre-RoPE reuse."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise UnsupportedModel(f"model type {model_type!r} uses {_MLA}")
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise UnsupportedModel(f"model type {model_type!r} is not supported "
                               f"(supported: {sorted(FAMILIES)})")
    layers: int = config.num_hidden_layers
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    window: int = getattr(config, "sliding_window", None) or 0
    if model_type == "mistral" and window and not getattr(config, "layer_types", None):
        layer_types = ["sliding_attention"] * layers  # Mistral: every layer slides
    if len(layer_types) != layers or not set(layer_types) <= {"full_attention",
                                                              "sliding_attention"}:
        raise UnsupportedModel(f"layer types {sorted(set(layer_types))} are not supported")
    if "sliding_attention" in layer_types and not window:
        raise UnsupportedModel("sliding-window layers without a window size")
    rope_parameters, layer_rope = _rope_sets(config, layer_types)
    heads: int = config.num_attention_heads
    head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionShape(
        family=family, layers=layers, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        rope_parameters=rope_parameters, layer_rope=layer_rope,
        windows=tuple(window if kind == "sliding_attention" else None
                      for kind in layer_types))
