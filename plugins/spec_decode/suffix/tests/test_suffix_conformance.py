"""The suffix proposer against the core's proposer conformance kit, selected by its name."""

from __future__ import annotations

from pagoda.config import SpeculativeConfig
from pagoda.testing import SpeculativeProposerConformance


class TestSuffixConformance(SpeculativeProposerConformance):
    proposer = "suffix"
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4)


class TestSuffixDefaultLengthConformance(SpeculativeProposerConformance):
    proposer = "suffix"
    config = SpeculativeConfig(method="suffix")
