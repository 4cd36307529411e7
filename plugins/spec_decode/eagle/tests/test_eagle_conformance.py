"""The EAGLE and EAGLE-3 proposers against the core's proposer conformance kit, selected by
name, each bound to a tiny random target (heads with random values in the published layouts)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from eagle_helpers import tiny_target, write_random_head

from pagoda.config import SpeculativeConfig
from pagoda.testing import SpeculativeProposerConformance
from pagoda.testing.spec_decode import VOCAB

_DIR = Path(tempfile.mkdtemp(prefix="pagoda-eagle-conformance-"))
# std 0.5: a head whose drafts vary with the history (a near-zero one drafts one token always).
EAGLE = write_random_head(_DIR / "eagle", "eagle", 64, VOCAB, std=0.5)
EAGLE3 = write_random_head(_DIR / "eagle3", "eagle3", 64, VOCAB, draft_vocab=VOCAB // 2, std=0.5)


class TestEagleConformance(SpeculativeProposerConformance):
    proposer = "eagle"
    config = SpeculativeConfig(method="eagle", model=str(EAGLE), num_speculative_tokens=4)
    target = staticmethod(tiny_target)


class TestEagle3Conformance(SpeculativeProposerConformance):
    proposer = "eagle3"
    config = SpeculativeConfig(method="eagle3", model=str(EAGLE3), num_speculative_tokens=3)
    target = staticmethod(tiny_target)
