"""Embedder: the ONNX Runtime query path gives the torch path's vectors; its export is cached."""

import numpy as np
import pytest

from inferscale.pipeline.embedder import ONNX_MAX_TEXTS, Embedder, load_embedder

TEXTS = ["What did Caroline research?", "", "x", "日本語のテキスト 🤖",
         "When did Melanie paint a sunrise? " * 40]


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("embedders")


@pytest.fixture(scope="module")
def onnx_embedder(onnx_cache):
    return Embedder(onnx_cache=onnx_cache)


def test_onnx_queries_match_torch(onnx_embedder, embedder):
    torch_only = Embedder()
    for text in TEXTS:
        fast, ref = onnx_embedder.encode([text]), torch_only.encode([text])
        assert fast.shape == ref.shape == (1, 384) and fast.dtype == np.float32
        assert np.allclose(fast, ref, atol=1e-4)
        assert np.isclose(np.linalg.norm(fast), 1.0, atol=1e-5)
    few = onnx_embedder.encode(TEXTS[:ONNX_MAX_TEXTS])  # padded together: same vectors
    assert np.allclose(few, torch_only.encode(TEXTS[:ONNX_MAX_TEXTS]), atol=1e-4)
    assert np.allclose(embedder.encode(TEXTS), torch_only.encode(TEXTS), atol=1e-4)
    assert onnx_embedder.encode([]).shape == (0, 384)


def test_the_export_is_made_once_and_reused(onnx_embedder, onnx_cache):
    exports = list(onnx_cache.iterdir())
    assert len(exports) == 1 and exports[0].suffix == ".onnx"  # no temp file left
    made = exports[0].stat().st_mtime_ns
    again = Embedder(onnx_cache=onnx_cache)
    assert list(onnx_cache.iterdir()) == exports and exports[0].stat().st_mtime_ns == made
    assert np.allclose(again.encode(["cat"]), onnx_embedder.encode(["cat"]))


def test_settings_choose_the_query_path(base_settings):
    off = load_embedder(base_settings.model_copy(update={"embed_queries_with_onnx": False}))
    on = load_embedder(base_settings)
    assert (off.query_path, on.query_path) == ("torch", "onnx")
    assert load_embedder(base_settings) is on  # one per process and settings
    assert (base_settings.data_dir / "embedders").is_dir()


def test_a_damaged_export_falls_back_to_torch_and_is_made_again(onnx_embedder, onnx_cache,
                                                                 tmp_path, caplog):
    export = next(onnx_cache.iterdir())
    damaged = tmp_path / "embedders"
    damaged.mkdir()
    (damaged / export.name).write_bytes(b"not an onnx model")
    fallback = Embedder(onnx_cache=damaged)
    assert fallback.query_path == "torch" and "embedding them with torch" in caplog.text
    assert np.allclose(fallback.encode(["cat"]), onnx_embedder.encode(["cat"]), atol=1e-4)
    assert not (damaged / export.name).exists()  # removed, so the next start exports again
    again = Embedder(onnx_cache=damaged)
    assert again.query_path == "onnx" and (damaged / export.name).stat().st_size > 1000


@pytest.mark.parametrize("value", ["maybe", "2", "", "[]", "null"])
def test_the_onnx_setting_refuses_what_is_not_a_boolean(value, monkeypatch):
    from pydantic import ValidationError

    from inferscale.core.settings import Settings

    monkeypatch.setenv("INFERSCALE_EMBED_QUERIES_WITH_ONNX", value)
    with pytest.raises(ValidationError):
        Settings()
