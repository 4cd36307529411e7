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
- leave ``batch.token_ids`` unchanged, and take ``remove`` of ids it never saw;
- where it promises drafts ahead (``drafts_ahead``, after ``draft_after_verify``), return
  exactly those from its next ``propose``, whatever the verification accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagoda.config import SpeculativeConfig
from pagoda.spec_decode import (
    Drafts,
    ProposalBatch,
    ProposerContext,
    SpeculativeProposer,
    TargetModel,
    VerifiedBatch,
)

VOCAB = 512
WIDTH = 300  # columns of the synthetic token array (max_model_len + 1)


@dataclass
class ProposerCase:
    """A batch of ``histories`` in rows ``rows`` of a fresh token array."""

    name: str
    histories: list[list[int]]
    rows: list[int]
    max_num_drafts: list[int] = field(default_factory=list)
    slot_cost: float | None = None  # ``ProposalBatch.slot_cost``


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
        ProposerCase("batch_with_a_measured_slot_cost", hist, [5, 0, 7, 2, 9], slot_cost=0.6),
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


def _history_rows(history: list[int], rows: int, width: int) -> torch.Tensor:
    """Synthetic hidden states that depend on the history alone (batch invariance holds)."""
    gen = torch.Generator().manual_seed(hash(tuple(history)) & 0x7FFFFFFF)
    return torch.randn(rows, width, generator=gen)


def make_batch(
    case: ProposerCase, ctx: ProposerContext, hidden_layers: tuple[int, ...] = ()
) -> ProposalBatch:
    token_ids = np.full((ctx.max_num_reqs, WIDTH), -1, dtype=np.int64)
    for row, h in zip(case.rows, case.histories):
        token_ids[row, : len(h)] = h
    n = len(case.rows)
    k = ctx.num_speculative_tokens
    caps = case.max_num_drafts or [k] * n
    hidden = new_hidden = loc = None
    if ctx.hidden_size:
        # As after a prefill of the whole history: every position but the last computed.
        width = ctx.hidden_size * max(1, len(hidden_layers))
        parts = [_history_rows(h, len(h), width) for h in case.histories]
        last = [p[-1:, : ctx.hidden_size] for p in parts]
        hidden = torch.cat(last).to(ctx.device, ctx.dtype)
        new_hidden = torch.cat([p[: len(p) - 1] for p in parts]).to(ctx.device, ctx.dtype)
        loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(h) - 1 for h in case.histories], out=loc[1:])
    return ProposalBatch(
        req_ids=[f"req-{r}" for r in case.rows],
        rows=np.asarray(case.rows, dtype=np.int64),
        token_ids=token_ids,
        num_tokens=np.asarray([len(h) for h in case.histories], dtype=np.int64),
        num_prompt_tokens=np.asarray([max(len(h) // 2, 1) for h in case.histories], np.int64),
        max_num_drafts=np.asarray([min(c, k) for c in caps], dtype=np.int64),
        hidden_states=hidden,
        new_hidden_states=new_hidden,
        hidden_loc=loc,
        slot_cost=case.slot_cost,
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


def check_proposes_on_host(
    cls: type[SpeculativeProposer],
    config: SpeculativeConfig,
    device="cpu",
    target: Callable[[ProposerContext], TargetModel] | None = None,
) -> None:
    """For a proposer with ``proposes_on_host``: it takes no hidden states (they live on the
    device) and, over every case of :func:`proposer_cases`, returns no ``probs`` (a late
    verification takes token ids from the host, nothing else)."""
    if cls.needs_hidden_states:
        raise AssertionError(
            "proposes_on_host and needs_hidden_states: hidden states are on the device"
        )
    for case in proposer_cases():
        ctx = make_context(config, device)
        proposer = _build(cls, ctx)
        if target is not None:
            proposer.bind_target(target(ctx))
        drafts = proposer.propose(make_batch(case, ctx, proposer.hidden_state_layers))
        if drafts.probs is not None:
            raise AssertionError(
                f"{case.name}: a proposer that proposes on the host returned Drafts.probs; a "
                "verification that takes its drafts late reads token ids only"
            )


def check_proposer_case(
    cls: type[SpeculativeProposer],
    config: SpeculativeConfig,
    case: ProposerCase,
    device="cpu",
    target: Callable[[ProposerContext], TargetModel] | None = None,
) -> Drafts:
    """Every check of the contract on one case; returns the batch's drafts. ``target``, for a
    proposer that runs a draft model: builds the :class:`TargetModel` it is bound to (a model
    of ``ctx.hidden_size`` and ``ctx.vocab_size``, block tables for ``ctx.max_num_reqs`` rows of
    ``ctx.max_model_len`` tokens)."""

    def build(ctx: ProposerContext) -> SpeculativeProposer:
        proposer = _build(cls, ctx)
        if target is not None:
            proposer.bind_target(target(ctx))
        return proposer

    ctx = make_context(config, device)
    proposer = build(ctx)
    batch = make_batch(case, ctx, proposer.hidden_state_layers)
    before = batch.token_ids.copy()
    drafts = proposer.propose(batch)
    if not np.array_equal(before, batch.token_ids):
        raise AssertionError("propose wrote into batch.token_ids, the runner's own array")
    check_drafts_well_formed(drafts, batch, ctx)
    usable = drafts.counts(ctx.vocab_size, batch.max_num_drafts)
    for i in range(len(batch)):  # each request alone, in another row, with a fresh proposer
        alone = ProposerCase(case.name, [case.histories[i]], [(case.rows[i] + 1) % 10])
        solo_ctx = make_context(config, device)
        solo_proposer = build(solo_ctx)
        solo_batch = make_batch(alone, solo_ctx, solo_proposer.hidden_state_layers)
        solo_batch.max_num_drafts = batch.max_num_drafts[i : i + 1].copy()
        solo = solo_proposer.propose(solo_batch)
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


def check_settle(
    cls: type[SpeculativeProposer],
    config: SpeculativeConfig,
    device="cpu",
    target: Callable[[ProposerContext], TargetModel] | None = None,
    steps: int = 6,
) -> None:
    """Drafts must not depend on whether ``settle`` is called between calls: two proposers,
    one settled after each ``propose`` (twice, as the runner may), the other never, propose
    for the same requests over ``steps`` calls whose histories grow by some of the drafts and
    a token after; their drafts agree at every call, and their ``resume_at`` once both are
    settled."""
    ctxs = [make_context(config, device) for _ in range(2)]
    props = [_build(cls, ctx) for ctx in ctxs]
    if target is not None:
        for p, ctx in zip(props, ctxs):
            p.bind_target(target(ctx))
    case = proposer_cases()[2]
    histories = [list(h) for h in case.histories]
    k = ctxs[0].num_speculative_tokens
    for step in range(steps):
        got = []
        for settled, (p, ctx) in enumerate(zip(props, ctxs)):
            batch = make_batch(ProposerCase(case.name, histories, case.rows), ctx,
                               p.hidden_state_layers)  # fmt: skip
            drafts = p.propose(batch)
            if settled == 0:
                p.settle()
                p.settle()
            n = drafts.counts(ctx.vocab_size, batch.max_num_drafts, k)
            got.append([drafts.token_ids[i, : n[i]].tolist() for i in range(len(n))])
        if got[0] != got[1]:
            raise AssertionError(
                f"call {step}: drafts {got[0]} with settle() after each call, {got[1]} without:"
                " a proposer must settle what it deferred at the start of its next propose"
            )
        for i, d in enumerate(got[0]):  # half of the drafts accepted, then a token of its own
            histories[i] += d[: (len(d) + 1) // 2] + [(step * 7 + i) % VOCAB]
    props[1].settle()
    if props[0].resume_at != props[1].resume_at:
        raise AssertionError(
            f"resume_at {props[0].resume_at} settled after each call, {props[1].resume_at} not"
        )


def check_drafts_ahead(
    cls: type[SpeculativeProposer],
    config: SpeculativeConfig,
    device="cpu",
    target: Callable[[ProposerContext], TargetModel] | None = None,
) -> int | None:
    """For a proposer that overrides ``drafts_ahead``: propose for a batch, verify the drafts
    (request i accepts ``i % (k + 1)`` of them, a made-up token after), hand the outcome to
    ``draft_after_verify``, take the promise, then propose from the verified histories: the
    drafts must be the promised ones, on the host and on the device (a history proposer that
    ``drafts_on_device`` reads the token array instead of hidden states, and its promise is what
    the runner verifies: k valid ids a request). Returns the requests whose drafts were
    promised (0: no promise made, or the method is not overridden; None: the proposer, in
    these settings, does not draft behind a verification)."""
    if cls.drafts_ahead is SpeculativeProposer.drafts_ahead:
        return 0
    ctx = make_context(config, device)
    proposer = _build(cls, ctx)
    if target is not None:
        proposer.bind_target(target(ctx))
    history_only = proposer.drafts_on_device and not proposer.needs_hidden_states
    if not (proposer.needs_hidden_states or history_only):
        return None  # (drafting behind a verification is off in these settings)
    case = proposer_cases()[2]
    batch = make_batch(case, ctx, proposer.hidden_state_layers)
    k, vocab = ctx.num_speculative_tokens, ctx.vocab_size
    drafts = proposer.propose(batch)
    nd = drafts.counts(vocab, batch.max_num_drafts)
    keep = np.flatnonzero(nd)
    if not len(keep):
        return 0
    n = len(keep)
    tokens = np.full((n, k + 1), -1, dtype=np.int64)
    emitted = np.zeros(n, dtype=np.int64)
    histories = []
    for j, i in enumerate(keep.tolist()):
        a = min(j % (k + 1), int(nd[i]))
        # NOTE: the token after the accepted drafts differs from the draft it rejects.
        bonus = (int(drafts.token_ids[i, a]) + 1) % vocab if a < nd[i] else 5
        out = drafts.token_ids[i, :a].tolist() + [bonus]
        tokens[j, : len(out)] = out
        emitted[j] = len(out)
        histories.append(case.histories[i] + out)
    width = batch.new_hidden_states.shape[1] if batch.new_hidden_states is not None else 0
    num_rows = 1 + nd[keep]
    loc = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_rows, out=loc[1:])
    verified_rows = [
        _history_rows(case.histories[i] + drafts.token_ids[i, : nd[i]].tolist(), int(m), width)
        for i, m in zip(keep.tolist(), num_rows.tolist())
    ]
    hidden = torch.cat(verified_rows).to(ctx.device, ctx.dtype)
    req_ids = [batch.req_ids[i] for i in keep.tolist()]
    rows = batch.rows[keep]
    proposer.draft_after_verify(
        VerifiedBatch(
            req_ids=req_ids,
            rows=rows,
            first=batch.num_tokens[keep] - 1,
            num_rows=num_rows,
            tokens=torch.as_tensor(tokens, device=ctx.device),
            num_emitted=torch.as_tensor(emitted, device=ctx.device),
            # A history proposer drafting on the device reads the token array, no hidden states.
            new_hidden_states=None if history_only else hidden,
            hidden_loc=None if history_only else loc,
            token_ids=batch.token_ids if history_only else None,
        )
    )
    promise = proposer.drafts_ahead(req_ids, batch.num_tokens[keep] + 1)
    if promise is None:
        return 0
    on_device, on_host = promise
    if tuple(on_device.shape) != (n, k) or tuple(on_host.shape) != (n, k):
        raise AssertionError(f"drafts_ahead returned shapes {on_device.shape}, {on_host.shape}")
    if on_device.device.type != ctx.device.type or on_host.device.type != "cpu":
        raise AssertionError("drafts_ahead returns (on the model's device, on the host)")
    promised_dev = on_device.cpu().numpy().copy()  # read before the proposer runs again
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    promised = on_host.numpy().copy()
    if not np.array_equal(promised, promised_dev):
        raise AssertionError("drafts_ahead: the host copy differs from the device's drafts")
    if history_only:
        # The verification launched ahead verifies these drafts, whatever ``propose`` says
        # once the step is read: k valid token ids a request.
        if not ((promised >= 0) & (promised < vocab)).all():
            raise AssertionError(f"drafts_ahead promised ids outside [0, {vocab}): {promised}")
        return n
    token_ids = batch.token_ids.copy()
    for row, h in zip(rows.tolist(), histories):
        token_ids[row, : len(h)] = h
    new_rows = torch.cat([hidden[loc[j] : loc[j] + emitted[j]] for j in range(n)])
    new_loc = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(emitted, out=new_loc[1:])
    last_rows = new_rows[new_loc[1:] - 1]
    after = ProposalBatch(
        req_ids=req_ids,
        rows=rows,
        token_ids=token_ids,
        num_tokens=batch.num_tokens[keep] + emitted,
        num_prompt_tokens=batch.num_prompt_tokens[keep],
        max_num_drafts=np.full(n, k, dtype=np.int64),
        hidden_states=None if batch.hidden_states is None else last_rows[:, : ctx.hidden_size],
        new_hidden_states=new_rows,
        hidden_loc=new_loc,
    )
    got = proposer.propose(after)
    check_drafts_well_formed(got, after, ctx)
    if got.token_ids.shape[1] != k or not np.array_equal(got.token_ids, promised):
        raise AssertionError(
            f"drafts_ahead promised {promised.tolist()} but propose returned "
            f"{got.token_ids.tolist()} (accepted counts {(emitted - 1).tolist()})"
        )
    return n
