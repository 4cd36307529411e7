"""The speculative proposer conformance kit: the contract of ``pagoda.spec_decode`` checked on
synthetic batches, without a model. ``SpeculativeProposerConformance`` (in
``pagoda.testing.spec_decode_suite``) runs these checks as a pytest class.

What a proposer must do, whatever it proposes:

- return :class:`~pagoda.spec_decode.Drafts` with ``token_ids`` of shape [n, <= k] (k =
  ``num_speculative_tokens``), int64, each entry a token id or -1; ``probs``, if given, of shape
  [n, k', vocab] on the model's device, each row a distribution that gives its draft mass;
- propose for each request from that request alone: the same history gives the same drafts
  whatever else is in the batch and in whatever row (batch invariance, so a vectorised
  implementation cannot mix rows up);
- leave ``batch.token_ids`` unchanged, and take ``remove`` of ids it never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import Drafts, ProposalBatch, ProposerContext, SpeculativeProposer

VOCAB = 512
WIDTH = 300  # columns of the synthetic token array (max_model_len + 1)


@dataclass
class ProposerCase:
    """A batch of ``histories`` in rows ``rows`` of a fresh token array."""

    name: str
    histories: list[list[int]]
    rows: list[int]
    max_num_drafts: list[int] = field(default_factory=list)


def proposer_cases(seed: int = 0) -> list[ProposerCase]:
    """Histories that repeat themselves (something to find) and ones that do not, short and
    long, alone and in batches, in rows that are not in order."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, VOCAB, 12).tolist()
    repeating = phrase * 6 + phrase[:5]
    noise = rng.integers(0, VOCAB, 200).tolist()
    cyclic = [7, 8, 9] * 40
    short = [3, 4, 3]
    hist = [repeating, noise, cyclic, short, noise[:40] + phrase + noise[40:80] + phrase[:6]]
    return [
        ProposerCase("one_repeating_request", [repeating], [0]),
        ProposerCase("one_single_token", [[42]], [3]),
        ProposerCase("batch_in_scattered_rows", hist, [5, 0, 7, 2, 9]),
        ProposerCase("batch_with_draft_caps", hist, [1, 2, 3, 4, 6], [1, 4, 2, 4, 3]),
    ]


def make_context(
    config: SpeculativeConfig, device: str | torch.device = "cpu", max_num_reqs: int = 10
) -> ProposerContext:
    return ProposerContext(
        config=config,
        vocab_size=VOCAB,
        hidden_size=64,
        max_num_reqs=max_num_reqs,
        max_model_len=WIDTH - 1,
        device=torch.device(device),
        dtype=torch.float32,
    )


def make_batch(case: ProposerCase, ctx: ProposerContext) -> ProposalBatch:
    token_ids = np.full((ctx.max_num_reqs, WIDTH), -1, dtype=np.int64)
    for row, h in zip(case.rows, case.histories):
        token_ids[row, : len(h)] = h
    n = len(case.rows)
    k = ctx.num_speculative_tokens
    caps = case.max_num_drafts or [k] * n
    hidden = None
    if ctx.hidden_size:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(n, ctx.hidden_size, generator=gen).to(ctx.device, ctx.dtype)
    return ProposalBatch(
        req_ids=[f"req-{r}" for r in case.rows],
        rows=np.asarray(case.rows, dtype=np.int64),
        token_ids=token_ids,
        num_tokens=np.asarray([len(h) for h in case.histories], dtype=np.int64),
        num_prompt_tokens=np.asarray([max(len(h) // 2, 1) for h in case.histories], np.int64),
        max_num_drafts=np.asarray([min(c, k) for c in caps], dtype=np.int64),
        hidden_states=hidden,
    )


def _build(cls: type[SpeculativeProposer], ctx: ProposerContext) -> SpeculativeProposer:
    proposer = cls(ctx)
    if not isinstance(proposer, SpeculativeProposer):
        raise AssertionError(f"{cls!r} does not build a pagoda.spec_decode.SpeculativeProposer")
    return proposer


def check_drafts_well_formed(drafts: Any, batch: ProposalBatch, ctx: ProposerContext) -> None:
    if not isinstance(drafts, Drafts):
        raise AssertionError(f"propose returned {type(drafts).__name__}, not Drafts")
    ids = drafts.token_ids
    n, k = len(batch), ctx.num_speculative_tokens
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 2:
        raise AssertionError(f"Drafts.token_ids must be an int64 [n, k] array, got {ids!r}")
    if ids.shape[0] != n or ids.shape[1] > k:
        raise AssertionError(f"Drafts.token_ids has shape {ids.shape}; want [{n}, <= {k}]")
    if ((ids < -1) | (ids >= ctx.vocab_size)).any():
        raise AssertionError("Drafts.token_ids holds values that are neither ids nor -1")
    if drafts.probs is not None:
        p = drafts.probs
        if p.shape[:2] != ids.shape or p.shape[2] != ctx.vocab_size:
            raise AssertionError(f"Drafts.probs has shape {tuple(p.shape)}; want {ids.shape} + V")
        if p.device.type != ctx.device.type or p.dtype != torch.float32:
            raise AssertionError("Drafts.probs must be float32 on the model's device")
        counts = drafts.counts(ctx.vocab_size, batch.max_num_drafts)
        for i, c in enumerate(counts.tolist()):
            rows = p[i, :c].double().cpu()
            if c and not torch.allclose(rows.sum(dim=1), torch.ones(c, dtype=torch.float64)):
                raise AssertionError(f"Drafts.probs of request {i} do not sum to 1")
            got = rows[torch.arange(c), torch.as_tensor(ids[i, :c])]
            if c and (got <= 0).any():
                raise AssertionError(f"request {i}: a draft has zero probability in its q")


def check_proposer_case(
    cls: type[SpeculativeProposer], config: SpeculativeConfig, case: ProposerCase, device="cpu"
) -> Drafts:
    """Every check of the contract on one case; returns the batch's drafts."""
    ctx = make_context(config, device)
    proposer = _build(cls, ctx)
    batch = make_batch(case, ctx)
    before = batch.token_ids.copy()
    drafts = proposer.propose(batch)
    if not np.array_equal(before, batch.token_ids):
        raise AssertionError("propose wrote into batch.token_ids, the runner's own array")
    check_drafts_well_formed(drafts, batch, ctx)
    usable = drafts.counts(ctx.vocab_size, batch.max_num_drafts)
    for i in range(len(batch)):  # each request alone, in another row, with a fresh proposer
        alone = ProposerCase(case.name, [case.histories[i]], [(case.rows[i] + 1) % 10])
        solo_ctx = make_context(config, device)
        solo_batch = make_batch(alone, solo_ctx)
        solo_batch.max_num_drafts = batch.max_num_drafts[i : i + 1].copy()
        solo = _build(cls, solo_ctx).propose(solo_batch)
        check_drafts_well_formed(solo, solo_batch, solo_ctx)
        m = solo.counts(ctx.vocab_size, solo_batch.max_num_drafts)[0]
        if m != usable[i] or not np.array_equal(solo.token_ids[0, :m], drafts.token_ids[i, :m]):
            raise AssertionError(
                f"{case.name}: request {i} gets {drafts.token_ids[i, : usable[i]].tolist()} in"
                f" the batch but {solo.token_ids[0, :m].tolist()} alone; drafts must depend on"
                " the request's own history only"
            )
    proposer.remove(["never-seen", *batch.req_ids])
    return drafts
