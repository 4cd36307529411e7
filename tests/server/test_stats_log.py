"""Request timings become Prometheus series, and the periodic log line says how the engine does."""

from __future__ import annotations

import logging

from pagoda.engine.metrics import EngineMetrics
from pagoda.step import EngineCoreOutput
from pagoda.wire import SchedulerStats


def test_timings_and_scheduler_stats_feed_series_and_the_log_line(caplog) -> None:
    metrics = EngineMetrics("m", log_interval=0.0)
    metrics.add_sequences(["a"], num_prompt_tokens=7, arrival=0.0)
    stats = SchedulerStats(
        1, 2, 0.5, prefix_cache_queries=32, prefix_cache_hits=16, queue_times=[0.25]
    )
    metrics.record([EngineCoreOutput("a", [1])], stats)
    metrics.record([EngineCoreOutput("a", [2, 3], "length")], None)
    text = metrics.render().decode()
    assert 'pagoda:prompt_tokens_total{model_name="m"} 7.0' in text
    assert 'pagoda:generation_tokens_total{model_name="m"} 3.0' in text
    assert 'pagoda:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'pagoda:inter_token_latency_seconds_count{model_name="m"} 1.0' in text
    assert 'pagoda:e2e_request_latency_seconds_count{model_name="m"} 1.0' in text
    assert 'pagoda:request_queue_time_seconds_sum{model_name="m"} 0.25' in text
    assert 'pagoda:kv_cache_usage_perc{model_name="m"} 0.5' in text
    assert 'pagoda:request_success_total{finished_reason="length",model_name="m"} 1.0' in text
    with caplog.at_level(logging.INFO, logger="pagoda.metrics"):
        metrics.log()
    line = caplog.records[-1].getMessage()
    for part in (
        "generation throughput",
        "Running: 1 reqs",
        "Waiting: 2 reqs",
        "KV cache usage: 50.0%",
        "Prefix cache hit rate: 50.0%",
    ):
        assert part in line, line


def test_aborted_sequences_count_as_aborts_without_latency() -> None:
    metrics = EngineMetrics("m")
    metrics.add_sequences(["a", "b"], num_prompt_tokens=3, arrival=0.0)
    metrics.end_sequences(["a", "b", "unknown"], "abort")
    text = metrics.render().decode()
    assert 'pagoda:request_success_total{finished_reason="abort",model_name="m"} 2.0' in text
    assert 'pagoda:e2e_request_latency_seconds_count{model_name="m"} 0.0' in text
