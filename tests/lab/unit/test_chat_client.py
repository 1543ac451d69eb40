"""Metric scraping for the benches (pure logic): prometheus_client parses, totals sum."""

from inferscale.devstack.chat_client import parse_metrics, totals
from inferscale.lab.bench.ttft import computed_tokens

EXPOSITION = """\
# HELP inferscale_stage_seconds Host time per request stage
# TYPE inferscale_stage_seconds histogram
inferscale_stage_seconds_bucket{le="0.001",stage="gather"} 1.0
inferscale_stage_seconds_bucket{le="+Inf",stage="gather"} 2.0
inferscale_stage_seconds_count{stage="gather"} 2.0
inferscale_stage_seconds_sum{stage="gather"} 0.004
inferscale_stage_seconds_count{stage="rope"} 2.0
inferscale_stage_seconds_sum{stage="rope"} 0.5
# HELP vllm:time_to_first_token_seconds TTFT
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="a"} 1.5
vllm:time_to_first_token_seconds_sum{engine="1",model_name="a"} 0.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="a"} 3.0
"""


def test_totals_sum_the_matching_label_sets():
    samples = parse_metrics(EXPOSITION)
    assert totals(samples, "inferscale_stage_seconds_sum", stage="gather") == 0.004
    assert totals(samples, "inferscale_stage_seconds_sum") == 0.504
    assert totals(samples, "vllm:time_to_first_token_seconds_sum") == 2.0
    assert totals(samples, "vllm:time_to_first_token_seconds_sum", engine="1") == 0.5
    assert totals(samples, "inferscale_stage_seconds_sum", stage="write") == 0
    assert totals(samples, "no_such_metric") == 0


def _counters(prompt: float, hits: float, injected: float) -> dict:
    return parse_metrics(f"""\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{engine="0",model_name="a"}} {prompt}
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="a"}} {hits}
# TYPE inferscale_kv_injected_tokens counter
inferscale_kv_injected_tokens_total {injected}
""")


def test_computed_tokens_leave_out_prefix_hits_and_injected_tokens():
    start = _counters(100, 0, 0)
    hit = _counters(100 + 2170, 2048, 0)  # a hit covers whole blocks: 122 tokens computed
    inject = _counters(100 + 2170 + 2170, 2048, 2130)  # 40 tokens after the memory
    assert computed_tokens([(start, hit)]) == 122
    assert computed_tokens([(hit, inject)]) == 40
    assert computed_tokens([(start, hit), (hit, inject)]) == 81
    assert computed_tokens([]) == 0
