"""A short soak (``inferscale bench soak``): a few users under KV budgets that evict all the time,
turns streaming in, two OpenAI-API clients asking and editing memory, and one fault of each
cheap kind (kill -9 of a worker mid-encode, a broker restart, a Postgres restart, a full disk
under the durable tier for 15 s; the server's restart, a vLLM start, is the long soak's). The
end-of-run checks must hold: every published turn stored and extracted once, every live fact's
KV present or re-encodable, no answer served a retired or another user's fact, the budgets held
within the policy's bound.

Users replay the shipped sample conversation from offsets of their own. The tiny random Llama
serves and encodes (the checks are about what is served, not how well),
so encoding keeps up and evicted facts come back within the run.
"""

from __future__ import annotations

import pytest

from conftest import EXTERNAL_INFRA, SAMPLE, lay_key
from inferscale.devstack import infra
from inferscale.lab.bench.soak import Restarts, SoakConfig, durable_broker, soak

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(EXTERNAL_INFRA, reason="restarts the embedded Postgres")]


async def test_short_soak_loses_nothing_and_serves_nothing_stale(base_settings, settings,
                                                                 tiny_models, tmp_path):
    local = base_settings.model_copy(update={"kafka_bootstrap": None, "database_url": None})
    lay_key(tmp_path)
    config = SoakConfig(minutes=2.5, users=6, memory_turns=4, clients=2, request_rate=1.5,
                        turn_rate=0.5, edit_share=0.15, budget_mb=0.6, user_budget_mb=0.2,
                        grace_s=10, evict_interval_s=5, fault_s=15,
                        faults=("worker", "broker", "postgres", "disk_full"),
                        drain_s=300, server_args=("--enforce-eager", "--dtype", "float32",
                                                  "--max-model-len", "2048"))
    with durable_broker(settings.model_copy(update={"data_dir": tmp_path / "broker"})) as (
            bootstrap, restart_broker):
        cfg = settings.model_copy(update={
            "kafka_bootstrap": bootstrap, "model_path": tiny_models["llama"],
            "data_dir": tmp_path, "kv_dir": tmp_path / "kv", "vllm_kv_cache_gib": 1,
            # a killed worker's leases run out within the drain
            "extract_lease_s": 10, "encode_lease_s": 10})
        report = await soak(cfg, SAMPLE, tmp_path / "out", config, Restarts(
            broker=restart_broker, postgres=lambda: infra.restart_postgres(local)))

    checks = report["checks"]
    assert [f["what"] for f in report["faults"]] == ["worker", "broker", "postgres", "disk_full"]
    assert report["faults"][0]["mid_encode"]
    assert report["faults"][3]["encode_failures"] > 0  # encodes met the full disk, and came back
    assert checks["turns"]["published"] == report["data"]["turns_published"] > 6 * 4
    assert (checks["turns"]["lost"], checks["turns"]["duplicated"],
            checks["turns"]["facts_lost"], checks["turns"]["facts_duplicated"]) == (0, 0, 0, 0)
    assert not {"broken", "quarantined", "failed"} & set(checks["kv"]), checks["kv"]
    assert checks["stale_answers"] == [] and checks["foreign_answers"] == []
    # sampled all along (a few samples may meet Postgres restarting), and within the bound
    assert checks["budget"]["samples"] >= 0.8 * len(report["samples"]), report["samples"][-3:]
    assert checks["budget"]["tier_over_bound"] == [] and checks["budget"]["user_over_bound"] == []
    assert checks["passed"]
    # The run did what it is for: answers, edits, evictions and KV encoded again.
    totals = report["samples"][-1]["totals"]
    assert report["overall"]["requests"] > 0 and report["data"]["edits"] > 0
    assert totals["evicted_facts"] > 0 and totals["restored"] > 0, totals
