"""The connector's portable injection path on one device, without vLLM (``bench inject``).

Runs where vLLM does not (a GPU box with torch and transformers only). Per request: the k
facts' blobs from a real store (a local directory, the host tier, the device tier) written,
keys rotated and scaled, into per-layer paged caches in the layout of vLLM's attention
(``[blocks, kv_heads, block_size, 2 * head_dim]``), by the connector's chain
(``chain.ChainWriter`` with ``ChunkedRope``; ``flash_update`` stands in for vLLM's
``reshape_and_cache_flash``) and, on CUDA, by the fused Triton writer
(``kv/_fused_triton.py``). Blob values are random, in the shapes of a model's K/V
(``SHAPES``: Llama-3.1-8B's, Qwen3-8B's, Gemma-3-12B's, or the served model's). Every tier and
writer must leave the same bits in the cache as the chain from the first tier.

The baseline is the forward of a randomly initialised model of the same shapes
(transformers): the prefill of memory + question (text prefill) and the question's forward over
the memory's cached KV (what a prefix-cache hit computes; an injection computes the same and
adds the chain's time).
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    DynamicCache,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedConfig,
    Qwen3Config,
)

from inferscale.contracts.blob_name import BlobName, FactId, fact_blob
from inferscale.kv import fused as kvwrite
from inferscale.kv.chain import CacheUpdate, ChainWriter
from inferscale.kv.durable import LocalDir
from inferscale.kv.fused import FusedTritonWriter
from inferscale.kv.rope import ChunkedRope, model_head_dim
from inferscale.kv.store import KVStore
from inferscale.lab.bench.common import print_table, write_report

TOKENS_PER_FACT = 44  # LoCoMo turn facts with SmolLM2's tokenizer, on average
PREAMBLE_TOKENS = 30  # positions before the first fact (BOS + system text)
QUESTION_TOKENS = 40
FINGERPRINT = "c" * 64


def _llama_3_1_8b() -> PreTrainedConfig:
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=131072, rope_parameters={
                           "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})


def _qwen3_8b() -> PreTrainedConfig:
    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _gemma_3_12b() -> PreTrainedConfig:
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    return Gemma3TextConfig(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                            vocab_size=262208, max_position_embeddings=131072,
                            query_pre_attn_scalar=256, sliding_window=1024,
                            layer_types=kinds * 8, rope_parameters={
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                   "rope_theta": 1000000.0}})


# The shapes of models a GPU fleet serves (random values; the memory's K/V and the baseline's
# forward take their sizes).
SHAPES: dict[str, Callable[[], PreTrainedConfig]] = {
    "llama-3.1-8b": _llama_3_1_8b, "qwen3-8b": _qwen3_8b, "gemma-3-12b": _gemma_3_12b}


def flash_update(caches: list[torch.Tensor]) -> CacheUpdate:
    """Cache updates into ``caches[i] [blocks, heads, block_size, 2 * head_dim]`` for layer i:
    token t's K and V go to slot ``slots[t]`` (block ``slot // block_size``), K in the first
    half of the last dimension, V in the second."""

    def update(layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        cache = caches[layer]
        block_size, dim = cache.shape[2], k.shape[-1]
        blocks, offsets = slots // block_size, slots % block_size
        cache[blocks, :, offsets, :dim] = k
        cache[blocks, :, offsets, dim:] = v

    return update


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write_blobs(store: KVStore, shape: tuple[int, int, int], n: int) -> list[BlobName]:
    layers, heads, dim = shape
    gen = torch.Generator().manual_seed(0)
    names = [fact_blob(FactId(uuid.uuid4().int >> 65)) for _ in range(n)]  # unused ids
    for name in names:
        k, v = (torch.randn((layers, TOKENS_PER_FACT, heads, dim), generator=gen).to(
            torch.bfloat16) for _ in range(2))
        store.put(name, k, v, list(range(TOKENS_PER_FACT)), window=0)
    return names


def _stores(durable: LocalDir, device: torch.device) -> dict[str, KVStore]:
    """The tiers a request's blobs come from, each its own store."""
    big = 1 << 40
    stores = {"host": KVStore(durable, FINGERPRINT, host_bytes=big, device=device)}
    if device.type == "cuda":
        stores = {"device": KVStore(durable, FINGERPRINT, big, big, device), **stores,
                  "host_pageable": KVStore(durable, FINGERPRINT, big, device=device,
                                           pinned=False)}
    stores["disk"] = KVStore(durable, FINGERPRINT, host_bytes=0, device=device)
    return stores


Write = Callable[[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor,
                  torch.Tensor], dict[str, float]]


def _writers(stores: dict[str, KVStore], rope: ChunkedRope, caches: list[torch.Tensor]
             ) -> tuple[list[tuple[str, KVStore, Write]], str | None]:
    """(column, store, write) to time: the chain from every tier, and on CUDA the fused
    writer that passes the connector's probe, from the device and host tiers; its name."""
    chain = ChainWriter(rope)

    def chained(pieces, positions, slots, scales):
        return chain.write(pieces, positions, slots, scales, flash_update(caches))

    out = [(tier, store, chained) for tier, store in stores.items()]
    fused = None
    if caches[0].device.type == "cuda" and kvwrite.triton_available():
        def probe_chain(pieces, positions, slots, scales, probe_caches):
            ChainWriter(rope).write(pieces, positions, slots, scales, flash_update(probe_caches))

        _, heads, block_size, width = caches[0].shape
        fused = kvwrite.first_exact(FusedTritonWriter.roundings(rope),
                                    probe_chain, (len(caches), heads, width // 2), block_size)
    if fused is not None:
        def fused_write(pieces, positions, slots, scales):
            fused.write(pieces, positions, slots, scales, caches)
            return {}

        out += [(f"{tier}_fused", stores[tier], fused_write) for tier in ("device", "host")]
    return out, fused.name if fused else None


def _request(store: KVStore, write: Write, names: list[BlobName], positions: torch.Tensor,
             slots: torch.Tensor, scales: torch.Tensor, device: torch.device
             ) -> dict[str, float]:
    """One request's injection, in ms: ``load`` and ``launch`` on the host, ``wall`` until the
    device is done; on CUDA also ``copy_device`` and ``chain_device`` from events."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if (
        device.type == "cuda") else None
    began = time.perf_counter()
    if events:
        events[0].record()
    blobs = store.load_many(names, [None] * len(names))
    loaded = time.perf_counter()
    if events:
        events[1].record()
    stages = write([(blob.k, blob.v) for blob in blobs], positions, slots, scales)
    launched = time.perf_counter()
    if events:
        events[2].record()
    _sync(device)
    row = {"wall": time.perf_counter() - began, "load": loaded - began,
           "launch": launched - loaded, **stages}
    row = {name: seconds * 1e3 for name, seconds in row.items()}
    if events:
        row["copy_device"] = events[0].elapsed_time(events[1])
        row["chain_device"] = events[1].elapsed_time(events[2])
    return row


def _written(caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """What the caches hold at ``slots``: [layers, tokens, heads, 2 * head_dim] on the host."""
    slots = slots.to(caches[0].device)
    block_size = caches[0].shape[2]
    return torch.stack([cache[slots // block_size, :, slots % block_size]
                        for cache in caches]).cpu()


def _model_baseline(config: PreTrainedConfig, k: int, device: torch.device, repeats: int,
                    model: torch.nn.Module) -> dict[str, float]:
    """Median ms of the prefill of memory + question, and of the question over cached memory."""
    memory = PREAMBLE_TOKENS + k * TOKENS_PER_FACT
    gen = torch.Generator().manual_seed(k)
    ids = torch.randint(0, config.vocab_size, (1, memory + QUESTION_TOKENS), generator=gen).to(
        device)

    def timed(step: Callable[[], object]) -> float:
        samples = []
        for i in range(repeats + 2):  # two warm-ups
            _sync(device)
            began = time.perf_counter()
            step()
            _sync(device)
            if i >= 2:
                samples.append((time.perf_counter() - began) * 1e3)
        return statistics.median(samples)

    with torch.inference_mode():
        prefill = timed(lambda: model(ids, logits_to_keep=1))
        # every layer's cache whole (sliding-window layers too), so that crop() applies
        cache = model(ids[:, :memory], use_cache=True,
                      past_key_values=DynamicCache()).past_key_values

        def question():
            model(ids[:, memory:], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-QUESTION_TOKENS)

        return {"prefill_ms": prefill, "question_ms": timed(question)}


def run(config: PreTrainedConfig, out_dir: Path | None, ks: tuple[int, ...] = (20, 50),
        requests: int = 20, device: str | torch.device | None = None, model: bool = True,
        block_size: int | None = None) -> dict:
    """Time injections of k facts from each tier (and the model's forward where ``model``);
    returns the report (also written to ``out_dir/inject.json`` where given)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    block_size = block_size or (16 if dev.type == "cuda" else 128)  # vLLM's defaults
    shape = (config.num_hidden_layers, config.num_key_value_heads, model_head_dim(config))
    rope = ChunkedRope(config, torch.bfloat16, dev, max_position=PREAMBLE_TOKENS
                       + max(ks) * TOKENS_PER_FACT + QUESTION_TOKENS)
    forward = None
    if model:
        from transformers import AutoModelForCausalLM

        with torch.device(dev):
            forward = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        durable = LocalDir(Path(tmp))
        stores = _stores(durable, dev)
        names = _write_blobs(stores["disk"], shape, max(ks))
        for k in ks:
            tokens = k * TOKENS_PER_FACT
            blocks = -(-(PREAMBLE_TOKENS + tokens) // block_size) + 1
            caches = [torch.zeros(blocks, shape[1], block_size, 2 * shape[2],
                                  dtype=torch.bfloat16, device=dev) for _ in range(shape[0])]
            gen = torch.Generator().manual_seed(k)
            positions = torch.arange(PREAMBLE_TOKENS, PREAMBLE_TOKENS + tokens)
            order = torch.randperm(blocks, generator=gen)
            slots = order[positions // block_size] * block_size + positions % block_size
            scales = (torch.rand(shape[0], tokens, generator=gen) * 0.4 + 0.8).to(torch.bfloat16)
            row: dict = {"k": k, "injected_tokens": tokens,
                         "kv_mb": 2 * tokens * shape[0] * shape[1] * shape[2] * 2 / 1e6}
            reference = None
            writers, row["fused_writer"] = _writers(stores, rope, caches)
            for tier, store, write in writers:
                for cache in caches:
                    cache.zero_()
                samples = [_request(store, write, names[:k], positions, slots, scales, dev)
                           for _ in range(requests + 3)][3:]  # three warm-ups
                written = _written(caches, slots)
                reference = written if reference is None else reference
                row[tier] = {name: statistics.median(s[name] for s in samples)
                             for name in samples[0]}
                row[tier]["same_bits"] = bool(torch.equal(written, reference))
            if forward is not None:
                row.update(_model_baseline(config, k, dev, requests, forward))
            rows.append(row)
            del caches
    report = {"device": str(dev), "device_name": torch.cuda.get_device_name(dev)
              if dev.type == "cuda" else "cpu", "shape": {
                  "layers": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
                  "hidden_size": config.hidden_size}, "block_size": block_size,
              "tokens_per_fact": TOKENS_PER_FACT, "requests": requests, "rows": rows}
    _print(report)
    if out_dir is not None:
        print(f"report: {write_report(out_dir, 'inject', report)}")
    return report


def _print(report: dict) -> None:
    tiers = [tier for tier in ("device", "device_fused", "host", "host_fused", "host_pageable",
                               "disk") if tier in report["rows"][0]]
    table = []
    for row in report["rows"]:
        line = [row["k"], row["injected_tokens"]]
        line += [row[tier]["wall"] for tier in tiers]
        line += [row.get("question_ms", "-"), row.get("prefill_ms", "-")]
        table.append(line)
    print_table(["k", "tokens", *[f"{tier} ms" for tier in tiers], "question fwd ms",
                 "prefill ms"], table)
    parts = ["load", "launch", "gather", "rope", "cache_write", "copy_device", "chain_device"]
    print_table(["k", "tier", *[f"{part} ms" for part in parts], "same bits"],
                [[row["k"], tier, *[row[tier].get(part, "-") for part in parts],
                  row[tier]["same_bits"]] for row in report["rows"] for tier in tiers])
