"""Drafts and acceptances become vLLM's ``pagoda:spec_decode_*`` series and a "SpecDecoding
metrics" line in the periodic log, with the acceptance rate and mean acceptance length."""

from __future__ import annotations

import logging

from pagoda.engine.metrics import EngineMetrics
from pagoda.spec_decode import SpecDecodingStats
from pagoda.wire import SchedulerStats


def test_spec_counters_and_the_log_line(caplog) -> None:
    metrics = EngineMetrics("m", log_interval=0.0)
    # Two steps: 3 drafts of 4 tokens with 2, 4 and 0 accepted, then 1 draft with 1 accepted.
    for drafts, tokens, accepted, per_pos in ((3, 12, 6, [2, 2, 1, 1]), (1, 4, 1, [1, 0, 0, 0])):
        stats = SchedulerStats(3, 0, 0.1, spec_num_drafts=drafts, spec_num_draft_tokens=tokens)
        stats.spec_num_accepted_tokens = accepted
        stats.spec_accepted_per_pos = per_pos
        metrics.record([], stats)
    text = metrics.render().decode()
    assert 'pagoda:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'pagoda:spec_decode_num_draft_tokens_total{model_name="m"} 16.0' in text
    assert 'pagoda:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    series = "pagoda:spec_decode_num_accepted_tokens_per_pos_total"
    assert series + '{model_name="m",position="0"} 3.0' in text
    with caplog.at_level(logging.INFO, logger="pagoda.metrics"):
        metrics.log()
    line = next(r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage())
    assert "Mean acceptance length: 2.75" in line, line  # 1 + 7 / 4
    assert "Avg Draft acceptance rate: 43.8%" in line, line  # 7 / 16
    assert "Per-position acceptance rate: 0.750, 0.500, 0.250, 0.250" in line, line


def test_stats_merge_and_rates() -> None:
    a = SpecDecodingStats()
    a.observe(4, 2)
    a.observe(2, 2)
    b = SpecDecodingStats()
    b.observe(3, 0)
    a.merge(b)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (3, 9, 4)
    assert a.accepted_per_pos == [2, 2, 0, 0]
    assert a.acceptance_rate == 4 / 9 and a.mean_acceptance_length == 1 + 4 / 3
