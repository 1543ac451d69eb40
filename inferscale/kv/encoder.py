"""Context-Window Encoding: per-fact K (before RoPE) and V from one batched forward pass.

Each sequence is ``[preamble][context segments][fact segment]``; only the fact segment's K/V is
kept. Keys are captured at the input of the rotary embedding, where the model's family has them
(``model_family.py``): after the key projection (with its bias), after the per-head key norm
where the family has one (Qwen3, Gemma 3), or as the key part of a fused projection (Phi-3).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferscale.contracts.blob_name import PREAMBLE
from inferscale.contracts.layout import MemoryLayout
from inferscale.core.settings import Settings
from inferscale.kv.model_family import attention_shape
from inferscale.kv.store import KVStore


@dataclass(frozen=True)
class EncodeItem:
    """One span to encode: ``prefix_ids`` give context, only ``span_ids`` KV is kept."""

    prefix_ids: list[int]
    span_ids: list[int]


@dataclass(frozen=True)
class EncodedSpan:
    """Pre-RoPE keys and values of one span, ``[layers, tokens, kv_heads, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor
    token_ids: list[int]


def default_device() -> torch.device:
    """GPU when present, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of an ``encode_dtype`` setting (None for "auto")."""
    return None if name == "auto" else getattr(torch, name)


class FactEncoder:
    """Loads a HF causal LM once and encodes batches of spans with hooks on K/V projections."""

    def __init__(self, model_path: Path, device: str | None = None,
                 dtype: torch.dtype | None = None, max_tokens: int = 4096):
        """``dtype`` is the compute dtype (default: float32 on CPU, where it is the fastest, else
        the model's); K/V are always returned in the model's own dtype, as vLLM serves it."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(model_path)
        self.shape = attention_shape(config)  # refuses what pre-RoPE reuse cannot serve
        self.config = config
        self.device = torch.device(device) if device else default_device()
        kv_dtype = getattr(config, "dtype", None) or torch.float32
        self.kv_dtype = getattr(torch, kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else self.kv_dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.layout = MemoryLayout(self.tokenizer)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype,
                                                     attn_implementation="sdpa")
        self.model = model.to(self.device).eval()
        self.max_tokens = max_tokens
        self.pad_id = self.tokenizer.pad_token_id or 0
        self._captured: list[list[torch.Tensor]] = []
        self._index: torch.Tensor | None = None
        self.lock = threading.Lock()  # one forward pass at a time (the model is shared)
        self._register_hooks()

    def _register_hooks(self) -> None:
        layers = self.model.model.layers
        self._captured = [[None, None] for _ in layers]
        family = self.shape.family
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            getattr(attn, family.keys).register_forward_hook(self._hook(i, 0))
            getattr(attn, family.values).register_forward_hook(self._hook(i, 1))

    def _hook(self, layer: int, slot: int
              ) -> Callable[[torch.nn.Module, tuple[Any, ...], torch.Tensor], None]:
        part = self.shape.projection_slice(slot)
        heads_first = slot == 0 and self.shape.family.heads_first

        def capture(_module: torch.nn.Module, _inputs: tuple[Any, ...],
                    output: torch.Tensor) -> None:
            if self._index is None:
                return
            if heads_first:
                output = output.transpose(1, 2)
            flat = output.reshape(output.shape[0], output.shape[1], -1)[..., part]
            rows = torch.arange(flat.shape[0], device=flat.device).unsqueeze(1)
            self._captured[layer][slot] = flat[rows, self._index]

        return capture

    @property
    def kv_heads(self) -> int:
        return self.shape.kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    def _fit(self, item: EncodeItem) -> list[int]:
        """Drop the oldest context tokens (after the preamble) beyond ``max_tokens``."""
        keep = self.max_tokens - len(item.span_ids)
        prefix = item.prefix_ids
        if len(prefix) > keep:
            head = len(self.layout.preamble_ids)
            prefix = prefix[:head] + prefix[len(prefix) - (keep - head):]
        return prefix

    @torch.inference_mode()
    def encode(self, items: Sequence[EncodeItem]) -> list[EncodedSpan]:
        """One padded forward pass over the batch; returns each span's K/V on the CPU."""
        if not items:
            return []
        prefixes = [self._fit(item) for item in items]
        seqs = [p + item.span_ids for p, item in zip(prefixes, items, strict=True)]
        width = max(map(len, seqs))
        span_max = max(len(item.span_ids) for item in items)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        index = torch.zeros((len(seqs), span_max), dtype=torch.long)
        for b, (prefix, seq) in enumerate(zip(prefixes, seqs, strict=True)):
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            index[b] = torch.clamp(torch.arange(span_max) + len(prefix), max=len(seq) - 1)
        with self.lock:
            self._index = index.to(self.device)
            try:
                self.model.model(input_ids=ids.to(self.device),
                                 attention_mask=mask.to(self.device), use_cache=False)
                shape = (len(items), span_max, self.kv_heads, self.head_dim)
                k = torch.stack([layer[0].view(shape) for layer in self._captured], dim=1)
                v = torch.stack([layer[1].view(shape) for layer in self._captured], dim=1)
            finally:
                self._index = None
                for layer in self._captured:
                    layer[0] = layer[1] = None
        k = k.to(device="cpu", dtype=self.kv_dtype)  # [batch, layers, span, heads, dim]
        v = v.to(device="cpu", dtype=self.kv_dtype)
        return [
            EncodedSpan(k=k[b, :, : len(item.span_ids)].contiguous(),
                        v=v[b, :, : len(item.span_ids)].contiguous(), token_ids=item.span_ids)
            for b, item in enumerate(items)
        ]

    def encode_preamble(self) -> EncodedSpan:
        """K/V of the preamble itself (BOS + system header + memory intro), at positions 0.."""
        item = EncodeItem(prefix_ids=[], span_ids=self.layout.preamble_ids)
        span: EncodedSpan = self.encode([item])[0]  # encode is untyped: inference_mode
        return span

    def fact_item(self, fact_text: str, context_texts: Sequence[str]) -> EncodeItem:
        """[preamble][context fact segments][fact segment] as the layout renders them."""
        prefix = list(self.layout.preamble_ids)
        for text in context_texts:
            prefix += self.layout.fact_segment(text)
        return EncodeItem(prefix_ids=prefix, span_ids=self.layout.fact_segment(fact_text))


def load_encoder(settings: Settings) -> FactEncoder:
    """The encoder of the model, device and compute dtype the settings name."""
    from inferscale.core.model_prep import resolve_model_path

    return FactEncoder(resolve_model_path(settings), device=settings.device,
                       dtype=compute_dtype(settings.encode_dtype))


def ensure_preamble(encoder: FactEncoder, store: KVStore) -> None:
    """Encode and store the preamble KV once per model."""
    if not store.exists(PREAMBLE):
        span = encoder.encode_preamble()
        store.put(PREAMBLE, span.k, span.v, span.token_ids, window=0)
