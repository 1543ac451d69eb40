"""``inferscale calibrate transform``: a transform-coding profile (``transform_coding.py``) for
the served model, fitted on calibration conversations' facts, each encoded as the worker
encodes it (after its ``w`` nearest earlier facts, HF in fp32) and rounded to bf16 as stored.
The profile names the model's fingerprint; keep evaluation conversations out of the fit."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from inferscale.lab.drift import Encodings, Memory, load_locomo
from inferscale.lab.transform_coding import ProfileFit


def run(settings, data: Path, out: Path | None, conversations: Sequence[int] = (1,),
        facts: int = 150, w: int = 10, seed: int = 0, threads: int = 2) -> Path:
    """Fit on up to ``facts`` facts (seeded sample) of each conversation; writes the profile
    (default ``transform-<model folder>.safetensors``) and returns its path."""
    from inferscale.contracts.fingerprint import model_fingerprint
    from inferscale.core.model_prep import resolve_model_path
    from inferscale.kv.encoder import load_encoder
    from inferscale.pipeline.embedder import load_embedder

    torch.set_num_threads(threads)
    started = time.perf_counter()
    model = resolve_model_path(settings)
    embedder = load_embedder(settings)
    encoder = load_encoder(settings.model_copy(update={"device": "cpu",
                                                       "encode_dtype": "float32"}))
    encoder.kv_dtype = torch.float32
    fit = ProfileFit()
    for conversation in conversations:
        texts, _ = load_locomo(data, conversation, None, 0, seed)
        memory = Memory(texts, embedder.encode(texts),
                        [encoder.layout.fact_segment(t) for t in texts])
        chosen = random.Random(seed).sample(range(len(texts)), min(facts, len(texts)))
        keys = {(fact, memory.neighbours(fact, w)) for fact in chosen}
        encodings = Encodings(encoder, memory)
        encodings.ensure(keys)
        for key in sorted(keys):
            k, v = encodings.kv[key]
            fit.add(k.to(torch.bfloat16), v.to(torch.bfloat16))
    profile = fit.profile(model_fingerprint(model))
    path = out or Path(f"transform-{model.name}.safetensors")
    profile.save(path)
    print(f"wrote {path}: {fit.count} tokens of {len(conversations)} conversation(s), "
          f"{time.perf_counter() - started:.0f} s")
    return path
