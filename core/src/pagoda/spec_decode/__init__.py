"""Speculative decoding's contract: what a proposer receives and returns, and the counters of
drafts and accepted tokens.

Proposers are plugins (``register_spec_proposers``), selected with ``speculative.method``; the
core verifies their drafts (the rejection sampler, ``pagoda.sample.rejection``, re-exported
here) so that output stays lossless. Floor: a contract, beside attention and the models; the
scheduler's and the runner's sides of speculation live in ``pagoda.scheduler`` and
``pagoda.worker``.
"""

from __future__ import annotations

from pagoda.sample.rejection import rejection_sample
from pagoda.spec_decode.cost import DraftCost
from pagoda.spec_decode.metrics import SpecDecodingStats
from pagoda.spec_decode.pause import DraftPause
from pagoda.spec_decode.proposer import (
    Drafts,
    ProposalBatch,
    ProposerContext,
    SpeculativeProposer,
    TargetModel,
    VerifiedBatch,
    build_proposer,
)

__all__ = [
    "DraftCost",
    "DraftPause",
    "Drafts",
    "ProposalBatch",
    "ProposerContext",
    "SpecDecodingStats",
    "SpeculativeProposer",
    "TargetModel",
    "VerifiedBatch",
    "build_proposer",
    "rejection_sample",
]
