"""Seeded tiny random models (Llama, Qwen2 with qkv bias, Qwen3 with key norm) for exactness."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_model(kind: str, tokenizer_dir: Path, out: Path, dtype=torch.float32) -> Path:
    """Save a seeded tiny random model of ``kind`` with the given tokenizer into ``out``."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=64,
                                             rope_parameters={"rope_type": "default",
                                                              "rope_theta": 10000.0}))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0}))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=64, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0}))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # larger weights make attention patterns (and errors) visible
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
