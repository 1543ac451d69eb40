"""``bench inject`` on the host with a tiny model: every tier leaves the same bits in the cache,
and the report carries each tier's breakdown and the model baseline."""

import json

import pytest
from kvcases import rope_config

from inferscale.kv.model_family import attention_shape
from inferscale.lab.bench import inject


@pytest.mark.parametrize("per_layer", [False, True])
def test_bench_inject_reports_every_tier_and_the_baseline(tmp_path, per_layer):
    """A Llama and a Gemma 3 (a RoPE table per layer type, sliding windows) of tiny shapes."""
    config = rope_config(2, 2, 16, 1.0, per_layer)
    report = inject.run(config, tmp_path, ks=(2, 3), requests=2, device="cpu")
    assert json.loads((tmp_path / "inject.json").read_text())["rows"] == report["rows"]
    assert [row["k"] for row in report["rows"]] == [2, 3]
    for row in report["rows"]:
        assert row["injected_tokens"] == row["k"] * inject.TOKENS_PER_FACT
        for tier in ("host", "disk"):
            assert row[tier]["same_bits"] is True
            assert row[tier]["wall"] >= row[tier]["load"] > 0
        assert row["prefill_ms"] > 0 and row["question_ms"] > 0


@pytest.mark.parametrize("name, kv_bytes_per_token", [
    ("llama-3.1-8b", 32 * 8 * 128 * 2 * 2), ("qwen3-8b", 36 * 8 * 128 * 2 * 2),
    ("gemma-3-12b", 48 * 8 * 256 * 2 * 2)])
def test_the_named_shapes_are_the_models_kv(name, kv_bytes_per_token):
    shape = attention_shape(inject.SHAPES[name]())
    assert shape.layers * shape.kv_heads * shape.head_dim * 2 * 2 == kv_bytes_per_token
