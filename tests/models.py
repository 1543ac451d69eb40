"""Seeded tiny random models of every supported family, for exactness (fp32).

``llama`` (default RoPE), ``llama3`` (Llama 3.1's rope scaling), ``qwen2`` (qkv bias),
``qwen3`` (key norm), ``mistral`` (a sliding window on every layer), ``gemma3`` (sliding and
full layers with their own RoPE bases, key norm), ``glm4`` (interleaved rotary on half the
dimensions), ``phi3`` (one fused q|k|v projection, partial rotary). Windows are a few dozen
tokens, so that a served prompt reaches past them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KINDS = ("llama", "llama3", "qwen2", "qwen3", "mistral", "gemma3", "glm4", "phi3")


def _rope(theta: float = 10000.0, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **extra}


def _config(kind: str, common: dict[str, Any]):
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(**common, head_dim=64, rope_parameters=_rope())
    if kind == "llama3":
        return tf.LlamaConfig(**common, head_dim=64, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024})
    if kind == "qwen2":
        return tf.Qwen2Config(**common, rope_parameters=_rope())
    if kind == "qwen3":
        return tf.Qwen3Config(**common, head_dim=64, rope_parameters=_rope())
    if kind == "mistral":
        return tf.MistralConfig(**common, head_dim=64, sliding_window=32,
                                rope_parameters=_rope())
    if kind == "gemma3":
        kinds = ["sliding_attention", "sliding_attention", "full_attention"]
        return tf.Gemma3TextConfig(**{**common, "num_key_value_heads": 1}, head_dim=64,
                                   query_pre_attn_scalar=64, sliding_window=32,
                                   layer_types=kinds, rope_parameters={
                                       "sliding_attention": _rope(),
                                       "full_attention": _rope(1000000.0)})
    if kind == "glm4":
        return tf.Glm4Config(**common, head_dim=64, pad_token_id=None,
                             rope_parameters=_rope(partial_rotary_factor=0.5))
    if kind == "phi3":
        # head_dim 64 (hidden / heads): vLLM's bf16 CPU rotary kernel needs 48 rotary dims,
        # not 24
        return tf.Phi3Config(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1},
                             rope_parameters=_rope(partial_rotary_factor=0.75))
    raise ValueError(kind)


def tiny_model(kind: str, tokenizer_dir: Path, out: Path, dtype=torch.float32) -> Path:
    """Save a seeded tiny random model of ``kind`` with the given tokenizer into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind, common))
    with torch.no_grad():  # larger weights make attention patterns (and errors) visible
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
