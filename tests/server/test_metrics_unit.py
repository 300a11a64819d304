"""The Prometheus exporter turns cumulative scheduler stats into the right counter increments."""

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.outputs import FinishedRequestStats, IterationStats, SchedulerStats


def samples(logger):
    out = {}
    for fam in text_string_to_metric_families(logger.render().decode()):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            key = s.name + "".join(f"[{v}]" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def test_counters_follow_cumulative_stats():
    m = PrometheusStatLogger("m", kv_capacity_bytes=1000, kv_capacity_tokens=10, kv_bytes_per_block=100)
    m.record(SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_preemptions=3,
                            num_preemptions_recompute=1, num_preemptions_swap=2, swap_out_blocks=5, swap_in_blocks=4,
                            num_swapped=1, spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=5,
                            spec_accepted_per_pos=[2, 2, 1, 0]),
             IterationStats(num_generation_tokens=7, num_prompt_tokens=20, time_to_first_tokens=[0.1],
                            inter_token_latencies=[0.01, 0.02],
                            finished=[FinishedRequestStats("overloaded", 1.0, 1.0, 20, 0)]))
    m.record(SchedulerStats(num_preemptions=4, num_preemptions_recompute=1, num_preemptions_swap=3,
                            swap_out_blocks=6, swap_in_blocks=6, spec_num_drafts=3, spec_num_draft_tokens=12,
                            spec_num_accepted_tokens=6, spec_accepted_per_pos=[3, 2, 1, 0]), IterationStats())
    s = samples(m)
    assert s["pagedllm:num_preemptions_total[recompute]"] == 1
    assert s["pagedllm:num_preemptions_total[swap]"] == 3
    assert s["pagedllm:swap_out_bytes_total"] == 600 and s["pagedllm:swap_in_bytes_total"] == 600
    assert s["pagedllm:num_requests_swapped"] == 0 and s["pagedllm:num_requests_running"] == 0
    assert s["pagedllm:spec_decode_num_drafts_total"] == 3
    assert s["pagedllm:spec_decode_num_accepted_tokens_total"] == 6
    assert s["pagedllm:spec_decode_num_accepted_tokens_per_pos_total[0]"] == 3
    assert s["pagedllm:generation_tokens_total"] == 7 and s["pagedllm:prompt_tokens_total"] == 20
    assert s["pagedllm:request_success_total[overloaded]"] == 1
    assert s["pagedllm:inter_token_latency_seconds_count"] == 2
    assert s["pagedllm:kv_cache_capacity_bytes"] == 1000


def test_vllm_names_carry_the_same_samples():
    """Each metric vLLM also exports is rendered a second time under ``vllm:`` with the same samples (read from the
    one registry at each scrape); the ones vLLM has no name for are not."""
    from pagedllm.metrics.prometheus import VLLM_NAMES

    m = PrometheusStatLogger("m", kv_capacity_bytes=1000, kv_capacity_tokens=10, kv_bytes_per_block=100)
    m.record(SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25),
             IterationStats(num_generation_tokens=4, num_prompt_tokens=9, time_to_first_tokens=[0.2],
                            finished=[FinishedRequestStats("stop", 1.5, 0.1, 9, 4)]))
    s = samples(m)
    ours = {k.removeprefix("pagedllm:"): v for k, v in s.items() if k.startswith("pagedllm:")}
    theirs = {k.removeprefix("vllm:"): v for k, v in s.items() if k.startswith("vllm:")}
    assert theirs and theirs == {k: v for k, v in ours.items()
                                 if any(k.split("[")[0].startswith(n) for n in VLLM_NAMES)}
    assert theirs["num_requests_running"] == 3 and theirs["kv_cache_usage_perc"] == 0.25
    assert theirs["request_success_total[stop]"] == 1 and "kv_cache_capacity_bytes" not in theirs

