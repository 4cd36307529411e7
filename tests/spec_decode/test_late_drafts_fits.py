"""Which speculations take their drafts late (``pagoda.worker.late_drafts``): only a proposer
that says it proposes on the host alone (``SpeculativeProposer.proposes_on_host``), since the
device waits for the host while it proposes; and the kit's check of that promise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagoda_spec_eagle.proposer import Eagle3Proposer
from pagoda_spec_ngram.proposer import NgramProposer
from pagoda_spec_suffix.proposer import SuffixProposer

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import Drafts, SpeculativeProposer
from pagoda.testing import check_proposes_on_host
from pagoda.worker.late_drafts import LateDrafts

CUDA = torch.device("cuda")


class _DeviceProposer(SpeculativeProposer):
    """Says nothing about where it proposes (a draft model would launch and wait there)."""

    def propose(self, batch):
        return Drafts.empty(len(batch))


class _HostWithProbs(SpeculativeProposer):
    """Says it proposes on the host, yet returns probabilities."""

    proposes_on_host = True

    def propose(self, batch):
        n, k, v = len(batch), self.ctx.num_speculative_tokens, self.ctx.vocab_size
        ids = np.zeros((n, k), dtype=np.int64)
        probs = torch.zeros(n, k, v, dtype=torch.float32)
        probs[:, :, 0] = 1.0
        return Drafts(ids, probs)


def _fits(proposer, **kw) -> bool:
    args = {"asked_in_launch": True, "drafts_after_verify": False, "replans": False}
    return LateDrafts.fits(proposer, CUDA, **{**args, **kw})


@pytest.fixture
def device_waits(monkeypatch):
    monkeypatch.setattr(LateDrafts, "available", staticmethod(lambda device: True))


@pytest.mark.usefixtures("device_waits")
def test_only_proposers_on_the_host_take_drafts_late():
    assert NgramProposer.proposes_on_host and SuffixProposer.proposes_on_host
    assert _fits(NgramProposer) and _fits(SuffixProposer)
    assert not _fits(_DeviceProposer)  # the default: never late
    assert not _fits(Eagle3Proposer)


@pytest.mark.usefixtures("device_waits")
@pytest.mark.parametrize(
    "kw", [{"asked_in_launch": False}, {"drafts_after_verify": True}, {"replans": True}]
)
def test_the_runner_s_conditions_still_hold(kw):
    assert not _fits(NgramProposer, **kw)


def test_no_device_wait_no_late_drafts():
    assert not LateDrafts.fits(
        SuffixProposer,
        torch.device("cpu"),
        asked_in_launch=True,
        drafts_after_verify=False,
        replans=False,
    )


def test_the_kit_refuses_probs_from_a_proposer_on_the_host():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(AssertionError, match="returned Drafts.probs"):
        check_proposes_on_host(_HostWithProbs, config)
    check_proposes_on_host(NgramProposer, config)  # token ids only: passes
