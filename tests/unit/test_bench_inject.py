"""``bench inject`` on the host with a tiny model: every tier leaves the same bits in the cache,
and the report carries each tier's breakdown and the model baseline."""

import json

from transformers import LlamaConfig

from inferscale.lab.bench import inject


def test_bench_inject_reports_every_tier_and_the_baseline(tmp_path):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                         rope_theta=10000.0)
    report = inject.run(config, tmp_path, ks=(2, 3), requests=2, device="cpu")
    assert json.loads((tmp_path / "inject.json").read_text())["rows"] == report["rows"]
    assert [row["k"] for row in report["rows"]] == [2, 3]
    for row in report["rows"]:
        assert row["injected_tokens"] == row["k"] * inject.TOKENS_PER_FACT
        for tier in ("host", "disk"):
            assert row[tier]["same_bits"] is True
            assert row[tier]["wall"] >= row[tier]["load"] > 0
        assert row["prefill_ms"] > 0 and row["question_ms"] > 0
