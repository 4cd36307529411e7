"""The n-gram proposer against the core's proposer conformance kit, selected by its name."""

from __future__ import annotations

from pagoda.config import SpeculativeConfig
from pagoda.testing import SpeculativeProposerConformance


class TestNgramConformance(SpeculativeProposerConformance):
    proposer = "ngram"
    config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4
    )


class TestNgramDefaultLookupConformance(SpeculativeProposerConformance):
    proposer = "ngram"
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)


class TestNgramAdaptiveConformance(SpeculativeProposerConformance):
    """Only the method: the proposer picks the window and each request's draft length."""

    proposer = "ngram"
    config = SpeculativeConfig(method="ngram")


def _with_plugins(config: SpeculativeConfig, values: dict) -> SpeculativeConfig:
    """``config`` with the ``plugins`` section's values, as loading a configuration hands
    them to each section."""
    config._plugin_values = values
    return config


class TestNgramDeviceDraftsConformance(SpeculativeProposerConformance):
    """``plugins.ngram.device_drafts``: drafts looked up on the device behind a verification."""

    proposer = "ngram"
    config = _with_plugins(
        SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        {"ngram": {"device_drafts": True}},
    )
