"""InferScale: a memory layer for LLM serving with reusable, pre-RoPE per-fact KV."""

__version__ = "0.1.0"
