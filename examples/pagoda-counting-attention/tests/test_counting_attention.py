"""The example plugin's own tests: Pagoda's conformance kit, run on the installed plugin."""

from __future__ import annotations

import torch

from pagoda.plugins import get_registry, plugin_records
from pagoda.testing import AttentionBackendConformance, attention_cases, check_attention_backend


class TestCountingConformance(AttentionBackendConformance):
    backend = "counting"  # selected by name, through the installed entry point


def test_counting_plugin_is_discovered_from_its_entry_point() -> None:
    rec = next(r for r in plugin_records() if r.name == "counting")
    assert (rec.distribution, rec.status) == ("pagoda-counting-attention", "loaded")
    assert rec.registers == {"attention_backends": ["counting"]}


def test_counting_backend_counts_steps_and_layer_calls() -> None:
    from pagoda_counting_attention.backend import COUNTS

    backend = get_registry("attention_backends").get("counting")
    case = attention_cases()[0]
    before = dict(COUNTS)
    check_attention_backend(backend, case, "cpu", torch.float32)
    assert COUNTS["steps"] - before["steps"] == len(case.steps)
    assert COUNTS["forward"] - before["forward"] == len(case.steps)
