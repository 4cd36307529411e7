"""Speculative decoding's counters are visible offline (``LLM.get_metrics``, ``pagoda generate
--stats``) under the names ``/metrics`` exposes (``_total`` suffixes, the ``model_name`` label
carrying the served name), and the guide names them as ``/metrics`` does."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import generate_latest

from pagoda.engine.metrics import EngineMetrics
from pagoda.entrypoints.cli import main
from pagoda.spec_decode.metrics import SpecDecodingStats

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _exposition(model_name: str) -> str:
    metrics = EngineMetrics(model_name, log_interval=0)
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(3, 0)
    metrics._record_spec(
        SimpleNamespace(
            spec_num_drafts=stats.num_drafts,
            spec_num_draft_tokens=stats.num_draft_tokens,
            spec_num_accepted_tokens=stats.num_accepted_tokens,
            spec_accepted_per_pos=stats.accepted_per_pos,
        )
    )
    return generate_latest(metrics.registry).decode()


def test_offline_names_are_the_names_metrics_exposes_with_the_served_name() -> None:
    text = _exposition("my-served-name")
    exposed = set(re.findall(r"^(pagoda:\w+)\{", text, re.M))
    assert set(SpecDecodingStats().as_metrics()) <= exposed
    assert 'pagoda:spec_decode_num_drafts_total{model_name="my-served-name"} 2.0' in text
    assert re.search(r'_per_pos_total\{model_name="my-served-name",position="0"\} 1\.0', text)


def test_the_guide_names_the_spec_decode_metrics_as_metrics_exposes_them() -> None:
    exposed = set(re.findall(r"^(pagoda:\w+)\{", _exposition("m"), re.M))
    named = set(re.findall(r"pagoda:spec_decode_\w+", GUIDE.read_text()))
    assert named and named <= exposed, named - exposed


def test_llm_get_metrics_reads_the_engines_totals() -> None:
    from pagoda import LLM

    stats = SpecDecodingStats()
    stats.observe(2, 1)
    llm = LLM.__new__(LLM)  # an engine's parts without its start
    llm.engine = SimpleNamespace(
        engine_core=SimpleNamespace(scheduler=SimpleNamespace(spec_stats_total=stats))
    )
    assert llm.get_metrics() == {
        "pagoda:spec_decode_num_drafts_total": 1,
        "pagoda:spec_decode_num_draft_tokens_total": 2,
        "pagoda:spec_decode_num_accepted_tokens_total": 1,
        "pagoda:spec_decode_num_accepted_tokens_per_pos_total": [1, 0],
    }


def test_generate_stats_prints_the_acceptance_offline(capsys) -> None:
    prompt = "Repeat after me: one two three one two three one two three one two three"
    argv = ["generate", "--no-chat", "--max-tokens", "16", "--stats", prompt]
    argv += ["--method", "ngram", "--num-speculative-tokens", "2", "--no-adaptive"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "SpecDecoding metrics: Mean acceptance length: " in err, err[-2000:]
