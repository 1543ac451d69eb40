"""Chunked RoPE equals vLLM's rotary embedding for the same positions."""

import torch
from transformers import AutoConfig, LlamaConfig

from inferscale.rope import ChunkedRope, _hf_cos_sin, _vllm_cos_sin


def _vllm_rope(config, dtype):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(config.head_dim, max_position=config.max_position_embeddings,
                        is_neox_style=True, rope_parameters=config.rope_parameters, dtype=dtype)


def test_batched_rotation_is_bit_equal_to_vllm_per_layer(smollm2_dir):
    config = AutoConfig.from_pretrained(smollm2_dir)
    rope = _vllm_rope(config, torch.float32)
    torch.manual_seed(0)
    layers, tokens = config.num_hidden_layers, 57
    keys = torch.randn(layers, tokens, config.num_key_value_heads, config.head_dim)
    positions = torch.randint(0, 8000, (tokens,))
    ours = ChunkedRope(config, torch.float32).rotate(keys, positions)
    for layer in range(layers):
        flat = keys[layer].reshape(tokens, -1).clone()
        _, ref = rope.forward_native(positions, flat.clone(), flat)
        assert torch.equal(ours[layer], ref.view_as(keys[layer]))
    # vLLM's fused CPU kernel agrees to rounding.
    flat = keys[0].reshape(tokens, -1).clone()
    _, fused = rope.forward_cpu(positions, flat.clone(), flat)
    torch.testing.assert_close(ours[0], fused.view_as(keys[0]), rtol=0, atol=2e-6)


def test_transformers_fallback_table_equals_vllm():
    for params in ({"rope_type": "default", "rope_theta": 500000.0},
                   {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}):
        config = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                             max_position_embeddings=16384, rope_parameters=params)
        ours, ours_dim = _hf_cos_sin(config, 16384, torch.float32)
        ref, ref_dim = _vllm_cos_sin(config, 16384, torch.float32)
        assert ours_dim == ref_dim == 128
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
