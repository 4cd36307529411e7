"""Speculative decoding: the proposer contract, the rejection sampler and its counters.

Proposers are plugins (``register_spec_proposers``), selected with ``speculative.method``; the
core verifies their drafts (``pagoda.spec_decode.rejection``) so that output stays lossless.
"""

from __future__ import annotations

from pagoda.spec_decode.metrics import SpecDecodingStats
from pagoda.spec_decode.proposer import (
    Drafts,
    ProposalBatch,
    ProposerContext,
    SpeculativeProposer,
    TargetModel,
    VerifiedBatch,
    build_proposer,
)
from pagoda.spec_decode.rejection import rejection_sample

__all__ = [
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
