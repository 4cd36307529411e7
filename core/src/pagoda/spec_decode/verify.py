"""The model runner's side of speculative decoding: score drafts, verify them, ask for more.

A request with ``k`` scheduled drafts contributes ``k + 1`` consecutive *scoring rows*: row ``j``
holds the target's logits after draft ``j - 1`` (row 0: after its last known token) and samples
position ``num_tokens + j``. Every sampling setting applies to each row as if the drafts before
it were output already (penalties count them, bad words and min_tokens see them, a seeded row
draws by its position), so verified output equals what plain decoding would give.

NOTE (for logits processors and grammar masks): in ``Sampler.process_logits`` a verification
step's ``SamplingMetadata.req_ids`` repeats a request's id once per scoring row, in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.sample.ops import gather_logprobs
from pagoda.sample.sampler import Sampler
from pagoda.sample.state import SamplingRows, seeded_uniform
from pagoda.spec_decode.proposer import ProposalBatch, VerifiedBatch
from pagoda.spec_decode.rejection import rejection_sample

if TYPE_CHECKING:
    from pagoda.step import ModelRunnerOutput
    from pagoda.worker.model_runner import ModelRunner
    from pagoda.worker.step_output import StepOutput

# Seeded rows draw their acceptance tests from a stream apart from their sampling draws.
_ACCEPT_SEED_SALT = np.uint64(0x5EC0DEC0DE)


def accept_uniform(sampling: SamplingRows, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One acceptance draw per scoring row: seeded rows' from (seed, position), others' from
    torch's default generator (as unseeded sampling draws)."""
    u = torch.rand(len(rows), dtype=torch.float64).numpy()
    seeded = sampling.seeded[rows]
    if seeded.any():
        seeds = sampling.seed[rows[seeded]] ^ _ACCEPT_SEED_SALT
        u[seeded] = seeded_uniform(seeds, positions[seeded])
    return u


def verify_drafts(
    runner: ModelRunner,
    hidden: torch.Tensor,
    out: StepOutput,
    rows: np.ndarray,
    sample_idx: np.ndarray,
    qsl: np.ndarray,
    drafts: dict[str, list[int]],
) -> None:
    """Score and verify the drafts of the sampling requests ``sample_idx`` of the step; fills
    ``out`` as ``ModelRunner._sample`` does, with [n, k + 1] tokens."""
    ib = runner.input_batch
    n = len(sample_idx)
    sample_rows = rows[sample_idx]
    req_ids = out.req_ids
    sample_req_ids = [req_ids[i] for i in sample_idx.tolist()]
    nd = np.array([len(drafts.get(r, ())) for r in sample_req_ids], dtype=np.int64)
    k = int(nd.max())
    tail = runner.greedy_tail
    if tail is not None and n == len(req_ids) and k == tail.q - 1:
        if bool((nd == k).all()) and _plain_greedy(runner, sample_rows, sample_req_ids):
            got = tail.run(hidden, n)
            if got is not None:
                base = ib.num_tokens[sample_rows]
                _emit(runner, out, sample_idx, sample_rows, base, nd, got.tokens)
                runner._prev_sampled = got.last_token
                out.verified = (got.tokens, got.num_emitted)
                _hand_over(runner, out, nd, got.last_hidden, got.tokens, got.num_emitted)
                return
    width = nd + 1
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(width[:-1], out=starts[1:])
    total = int(width.sum())
    offsets = runner._arange[:total] - np.repeat(starts, width)
    hidden_idx = np.repeat(qsl[1:][sample_idx] - width, width) + offsets
    rows_exp = np.repeat(sample_rows, width)
    base = ib.num_tokens[sample_rows]
    cols = np.arange(k)
    at = np.minimum(base[:, None] + cols, ib.token_ids.shape[1] - 1)
    draft_ids = ib.token_ids[sample_rows[:, None], at]
    draft_ids = np.where(cols < nd[:, None], draft_ids, -1)

    # NOTE: one host-to-device copy for the step's index arrays.
    packed = runner._as_device(np.concatenate([hidden_idx, draft_ids.ravel(), nd, starts]))
    hidden_idx_t, draft_t = packed[:total], packed[total : total + n * k].view(n, k)
    nd_t, starts_t = packed[total + n * k : total + n * k + n], packed[total + n * k + n :]
    # NOTE: where every token of the step is a scoring row (batch 1, say) the rows are in order.
    h = hidden[:total] if total == hidden.shape[0] else hidden[hidden_idx_t]
    logits = runner.model.compute_logits(h)
    md = ib.sampling.metadata(rows_exp, ib.token_ids, ib.num_tokens, ib.num_prompt, offsets)
    grammar = getattr(runner, "grammar", None)
    constrained = grammar is not None and grammar.entries
    row_req_ids = None
    if runner.sampler.logits_processors or constrained:
        row_req_ids = [sample_req_ids[i] for i in np.repeat(runner._arange[:n], width).tolist()]
    if runner.sampler.logits_processors:
        md.req_ids = row_req_ids
    if constrained:
        # NOTE: constrained requests get no drafts (``Scheduler.set_drafts``): one row each.
        md.grammar = grammar.mask(
            row_req_ids,
            rows_exp,
            ib.token_ids,
            ib.num_tokens,
            ib.num_prompt,
            runner._read_unread,
            runner.device,
        )
    if md.penalties is not None:
        _count_drafts_before(md.penalties.output_counts, draft_ids, nd, starts, runner)
    raw_logprobs = None
    if md.max_num_logprobs is not None:
        raw_logprobs = logits.float().log_softmax(dim=-1)
    logits = runner.sampler.process_logits(logits, md)
    argmax = logits.argmax(dim=-1)
    probs = greedy = u_accept = None
    if not md.all_greedy:
        probs = Sampler.probs(logits, md)
        if md.greedy_mask is not None:
            greedy = md.greedy_mask[starts_t]
        positions = ib.num_tokens[rows_exp] + offsets
        u_accept = runner._as_device(accept_uniform(ib.sampling, rows_exp, positions))
    tokens, num_emitted = rejection_sample(
        argmax,
        probs,
        draft_t,
        nd_t,
        starts_t,
        greedy=greedy,
        draft_probs=_draft_probs(runner, sample_req_ids, draft_ids, nd, k),
        uniform_accept=u_accept,
        uniform_final=md.uniform,
    )
    ib.sampling.record_sampled(sample_rows, tokens)
    _emit(runner, out, sample_idx, sample_rows, base, nd, tokens)
    # Each row's token at its draft count: a plain row's sampled token, which the next step
    # takes as its input on the device (a row with drafts is read before its next step).
    runner._prev_sampled = tokens.gather(1, nd_t.unsqueeze(1)).squeeze(1).clamp_(min=0)
    out.verified = (tokens, num_emitted)
    if raw_logprobs is not None:
        req_of_row = runner._as_device(np.repeat(np.arange(n), width))
        row_tokens = tokens[req_of_row, runner._as_device(offsets)].clamp(min=0)
        out.logprobs = gather_logprobs(raw_logprobs, md.max_num_logprobs, row_tokens).to_host()
        out.logprobs_ks = ib.sampling.logprobs[sample_rows]
        out.logprobs_starts = starts
    if runner.proposer is not None and runner.proposer.needs_hidden_states:
        _hand_over(runner, out, nd, h[starts_t + num_emitted - 1], tokens, num_emitted)


def _plain_greedy(runner: ModelRunner, rows: np.ndarray, req_ids: list[str]) -> bool:
    """Whether the rows' verification is the argmax's alone: plain greedy rows (no setting
    acts on their logits, no logprobs), no logits processor, no grammar, no draft
    probabilities."""
    if not runner.input_batch.sampling.plain[rows].all() or runner.sampler.logits_processors:
        return False
    grammar = getattr(runner, "grammar", None)
    if grammar is not None and grammar.entries:
        return False
    kept = runner._draft_probs
    return not kept or not any(r in kept for r in req_ids)


def _emit(
    runner: ModelRunner,
    out: StepOutput,
    sample_idx: np.ndarray,
    sample_rows: np.ndarray,
    base: np.ndarray,
    nd: np.ndarray,
    tokens: torch.Tensor,
) -> None:
    """The step's sampling rows in ``out`` (the sampled ids in flight to the host) and in the
    runner's record of where the next step finds them on the device."""
    ib = runner.input_batch
    drafted = nd > 0
    sample_pos = base.copy()
    if not drafted.all():
        sample_pos[~drafted] = ib.append_placeholders(sample_rows[~drafted])
    out.sample_idx = sample_idx
    out.sample_rows = sample_rows
    out.sample_pos = sample_pos
    out.drafted = drafted
    out.num_drafts = nd
    runner._prev_index[:] = -1
    runner._prev_index[sample_rows] = np.arange(len(sample_rows))
    out.sampled = tokens.to("cpu", non_blocking=True)


def _hand_over(
    runner: ModelRunner,
    out: StepOutput,
    nd: np.ndarray,
    last_hidden: torch.Tensor,
    tokens: torch.Tensor,
    num_emitted: torch.Tensor,
) -> None:
    """A proposer that reads hidden states: each request's last emitted row for its next
    proposal, and the step's verified requests to draft for on the device right away."""
    if runner.proposer is None or not runner.proposer.needs_hidden_states:
        return
    out.proposer_hidden = last_hidden
    if runner.hidden_feed is not None and out.hidden_feed is not None:
        _draft_after_verify(runner, out, nd, tokens, num_emitted)


def _draft_after_verify(
    runner: ModelRunner,
    out: StepOutput,
    nd: np.ndarray,
    tokens: torch.Tensor,
    num_emitted: torch.Tensor,
) -> None:
    """Hand the proposer the step's verified requests on the device
    (``SpeculativeProposer.draft_after_verify``): those that verified drafts, own their row,
    and have no hidden states waiting from earlier steps."""
    feed = runner.hidden_feed
    rows_t, qsl, starts = out.hidden_feed
    ib = runner.input_batch
    req_ids = out.req_ids
    pending = feed.pending  # (a property: deferred steps are held once, here)
    pick = [
        j
        for j, (i, row) in enumerate(zip(out.sample_idx.tolist(), out.sample_rows.tolist()))
        if nd[j] and ib.row_of.get(req_ids[i]) == row and req_ids[i] not in pending
    ]
    if not pick:
        return
    sel = np.asarray(pick, dtype=np.int64)
    idx = out.sample_idx[sel]
    # NOTE: plain Python over the picked requests (a few, mostly): their rows, and whether
    # they are one slice of the step's rows (every request of the step verified drafts).
    qsl_l, idx_l = qsl.tolist(), idx.tolist()
    count_l = [qsl_l[i + 1] - qsl_l[i] for i in idx_l]
    run = all(qsl_l[a + 1] == qsl_l[b] for a, b in zip(idx_l, idx_l[1:]))
    count = np.asarray(count_l, dtype=np.int64)
    loc = np.zeros(len(sel) + 1, dtype=np.int64)
    np.cumsum(count, out=loc[1:])
    if run:
        new_hidden = rows_t[qsl_l[idx_l[0]] : qsl_l[idx_l[0]] + int(loc[-1])]
    else:
        flat = np.repeat(qsl[idx] - loc[:-1], count) + np.arange(int(loc[-1]))
        new_hidden = rows_t[runner._as_device(flat)]
    everyone = len(sel) == len(nd)
    batch = VerifiedBatch(
        req_ids=[req_ids[i] for i in idx_l],
        rows=out.sample_rows[sel],
        first=starts[idx],
        num_rows=count,
        tokens=tokens if everyone else tokens[runner._as_device(sel)],
        num_emitted=num_emitted if everyone else num_emitted[runner._as_device(sel)],
        new_hidden_states=new_hidden,
        hidden_loc=loc,
    )
    runner.proposer.draft_after_verify(batch)


def _count_drafts_before(
    counts: torch.Tensor,
    draft_ids: np.ndarray,
    nd: np.ndarray,
    starts: np.ndarray,
    runner: ModelRunner,
) -> None:
    """Penalties: scoring row ``j`` of a request counts its drafts ``0 .. j - 1`` as output.
    ``counts`` is the step's own [rows, vocab] copy."""
    k = draft_ids.shape[1]
    later, earlier = np.tril_indices(k + 1, -1)  # pairs (j, j') with j' < j
    keep = later[None, :] <= nd[:, None]
    vrow = (starts[:, None] + later[None, :])[keep]
    tok = np.broadcast_to(draft_ids[:, earlier], keep.shape)[keep]
    if len(vrow):
        ones = torch.ones(len(vrow), dtype=counts.dtype, device=counts.device)
        counts.index_put_((runner._as_device(vrow), runner._as_device(tok)), ones, accumulate=True)


def _draft_probs(
    runner: ModelRunner, req_ids: list[str], draft_ids: np.ndarray, nd: np.ndarray, k: int
) -> torch.Tensor | None:
    """[n, k, vocab] q of each draft, when the proposer gave probabilities for some request;
    one-hot rows for the others."""
    kept = runner._draft_probs
    if not kept or not any(r in kept for r in req_ids):
        return None
    vocab = runner.arch.vocab_size
    ids = runner._as_device(np.maximum(draft_ids, 0))
    q = torch.nn.functional.one_hot(ids, vocab).float()
    for i, req_id in enumerate(req_ids):
        p = kept.get(req_id)
        if p is not None and nd[i]:
            q[i, : nd[i]] = p[: nd[i]]
    return q


def propose_after(
    runner: ModelRunner, step: StepOutput, output: ModelRunnerOutput, draft: bool = True
) -> None:
    """Ask the proposer for drafts for the requests that sampled in ``step`` (still running
    in the same row), now that their tokens are on the host; they go out in ``output``.
    ``draft=False`` (drafting off): only keep their hidden states for a later draft."""
    runner._proposals = output.draft_token_ids  # NOTE: only the latest step's drafts are fresh
    propose(runner, step, output.draft_token_ids, draft=draft)


def propose(
    runner: ModelRunner,
    step: StepOutput,
    into: dict[str, list[int]],
    slots: dict[str, int] | None = None,
    draft: bool = True,
) -> None:
    """Drafts for the requests that sampled in ``step`` (read already), by request id into
    ``into``; with ``slots`` (request id -> draft slots of the next step) only for those, at
    most that many each. ``draft=False``: the proposer is not asked (drafting is off; its
    drafts would be scheduled nowhere), and the hidden states it reads wait in the feed, the
    most recent ``HiddenFeed.max_hold`` positions of each request."""
    proposer = runner.proposer
    ib = runner.input_batch
    if proposer is None or step.num_emitted is None or not len(step.sample_idx):
        return
    feed = runner.hidden_feed if step.hidden_feed is not None else None
    if not draft:
        if feed is not None:
            feed.defer(step)
        return
    # NOTE: plain Python over the step's sampling requests: this runs after every step, and
    # at a small batch a dozen numpy calls on arrays of one element cost more than the loop.
    req_ids = [step.req_ids[i] for i in step.sample_idx.tolist()]
    n_tok = (step.sample_pos + step.num_emitted).tolist()
    k = runner.config.speculative.num_speculative_tokens
    room, row_of = runner.max_model_len, ib.row_of
    most, ok_l = [], []
    for r, row, n in zip(req_ids, step.sample_rows.tolist(), n_tok):
        m = min(k, room - n) if slots is None else min(k, room - n, slots.get(r, 0))
        most.append(m)
        ok_l.append(m >= 1 and row_of.get(r, -1) == row)
    resume = getattr(proposer, "resume_at", None)
    if resume:  # requests that draft nothing yet are not asked; their hidden states wait
        waiting = [o and n < resume.get(r, 0) for o, r, n in zip(ok_l, req_ids, n_tok)]
        if any(waiting):
            ok_l = [o and not w for o, w in zip(ok_l, waiting)]
            if feed is not None:
                held = np.flatnonzero(waiting)
                feed.hold(step, held, np.asarray(n_tok)[held])
    if not any(ok_l):
        return
    keep = np.flatnonzero(ok_l)
    num_tokens = np.asarray(n_tok, dtype=np.int64)
    max_drafts = np.asarray(most, dtype=np.int64)
    rows = step.sample_rows[keep]
    hidden = step.proposer_hidden
    if hidden is not None and len(keep) < len(hidden):  # (all kept: the rows as they are)
        hidden = hidden[runner._as_device(keep)]
    new_hidden = loc = None
    if feed is not None:
        new_hidden, loc = feed.take(step, keep, num_tokens[keep])
    batch = ProposalBatch(
        req_ids=[req_ids[i] for i in keep.tolist()],
        rows=rows,
        token_ids=ib.token_ids,
        num_tokens=num_tokens[keep],
        num_prompt_tokens=ib.num_prompt[rows],
        max_num_drafts=max_drafts[keep],
        hidden_states=hidden,
        new_hidden_states=new_hidden,
        hidden_loc=loc,
    )
    drafts = proposer.propose(batch)
    counts = drafts.counts(runner.arch.vocab_size, batch.max_num_drafts)
    ids = drafts.token_ids
    for i in np.flatnonzero(counts).tolist():
        req_id = batch.req_ids[i]
        into[req_id] = ids[i, : counts[i]].tolist()
        if drafts.probs is not None:
            runner._draft_probs[req_id] = drafts.probs[i, : counts[i]]
        else:
            runner._draft_probs.pop(req_id, None)


def run_verify_graph(
    runner: ModelRunner,
    counts: np.ndarray,
    starts: np.ndarray,
    qsl: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    rows: np.ndarray,
    unknown: np.ndarray | None = None,
    unknown_rows: np.ndarray | None = None,
) -> torch.Tensor | None:
    """Replay a verification graph (q = k + 1 tokens a request) for a step of up to q tokens a
    request, padded to q: pad tokens write their keys and values into block 0 and come after the
    request's real tokens, which therefore never see them. Returns the real tokens' hidden
    states in the step's own (unpadded) order, or None when the step does not fit a graph (a
    longer chunk, too many requests, or a padded sequence past the context limit)."""
    graphs = runner.verify_graphs
    q = graphs.query_len
    n = len(counts)
    bucket = graphs.bucket_for(n)
    if bucket is None or int(counts.max()) > q or int((starts + q).max()) > runner.max_model_len:
        return None
    total = len(input_ids)
    tok_req = np.repeat(runner._arange[:n], counts)
    index = tok_req * q + (runner._arange[:total] - qsl[tok_req])  # each token's padded place

    def spread(a: np.ndarray) -> np.ndarray:
        out = np.zeros(n * q, dtype=np.int64)
        out[index] = a
        return out

    seq_lens = starts + q
    qsl_pad = runner._arange[: n + 1] * q
    bs = runner.block_size
    max_blocks = -(-int(seq_lens.max()) // bs)
    runner._to_device(runner.input_ids[: n * q], spread(input_ids))
    if unknown is not None and len(unknown):  # ids the last step sampled, still on the device
        runner._fill_from_device(index[unknown], unknown_rows)
    runner._to_device(runner.positions[: n * q], spread(positions))
    runner._to_device(runner.slot_mapping[: n * q], spread(slots))  # pads: slot 0 of block 0
    runner._to_device(runner.query_start_loc[: n + 1], qsl_pad.astype(np.int32))
    runner._to_device(runner.seq_lens[:n], seq_lens.astype(np.int32))
    table = runner.input_batch.block_table[rows, :max_blocks]
    runner._to_device(runner.block_table[:n, :max_blocks], table)
    hidden = graphs.run(graph_metadata(runner, n, q, seq_lens), bucket)
    if total == n * q:  # every request has q tokens: no padding to drop
        return hidden[:total]
    return hidden[runner._as_device(index)]


def graph_metadata(
    runner: ModelRunner, n: int, q: int, seq_lens: np.ndarray
) -> CommonAttentionMetadata:
    """A verification graph's step of ``n`` requests of ``q`` tokens, whose inputs are in the
    runner's buffers; ``seq_lens`` [n] on the host (an upper bound where no backend re-plans)."""
    return CommonAttentionMetadata(
        num_reqs=n,
        num_actual_tokens=n * q,
        max_query_len=q,
        max_seq_len=int(seq_lens.max()),
        query_start_loc=runner.query_start_loc[: n + 1],
        seq_lens=runner.seq_lens[:n],
        block_table=runner.block_table[:n],
        slot_mapping=runner.slot_mapping[: n * q],
        query_start_loc_cpu=runner._arange[: n + 1] * q,
        seq_lens_cpu=seq_lens,
        block_size=runner.block_size,
    )
