"""``bench pagein`` on tiny models: every kind of memory and format is timed, and the report
written."""

import pytest

from inferscale.core.settings import Settings
from inferscale.kv import fused
from inferscale.lab.bench import pagein


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_bench_pagein_times_each_kind_of_memory_and_format(tiny_models, tmp_path, kind):
    """Gemma 3 (windows of 32 tokens, 132 injected): also the write within the windows."""
    report = pagein.run(Settings(kv_url=None), tiny_models[kind], tmp_path, ks=(3,),
                        formats=("raw", "int4"))
    raw, int4 = report["results"]
    assert (raw["format"], int4["format"]) == ("raw", "int4")
    assert int4["blob_bytes"] < raw["blob_bytes"] / 2
    for row in (raw, int4):
        assert row["tier"] == "local directory" and row["k"] == 3
        for column in ("host_tier_ms", "sequential_ms", "fresh_buffers_ms", "concurrent_ms",
                       "reused_ms", "cold_sequential_ms", "cold_concurrent_ms",
                       "cold_concurrent_on_threads_ms", "disk_sequential_ms", "disk_concurrent_ms",
                       "disk_concurrent_on_threads_ms", "concurrent_speedup_vs_raw",
                       "cold_concurrent_speedup_vs_raw", "disk_concurrent_speedup_vs_raw"):
            assert row[column] > 0
        assert (row["fused_write_ms"] is None) == (not fused.available())
        windows = fused.available() and kind == "gemma3"
        assert (row["fused_write_windows_ms"] is not None) == windows
    assert (tmp_path / "pagein.json").exists()
