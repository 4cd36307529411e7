"""Verifying drafts: score them with the target, keep what the rejection sampler accepts.

A request with ``k`` scheduled drafts contributes ``k + 1`` consecutive *scoring rows*: row ``j``
holds the target's logits after draft ``j - 1`` (row 0: after its last known token) and samples
position ``num_tokens + j``. Every sampling setting applies to each row as if the drafts before
it were output already (penalties count them, bad words and min_tokens see them, a seeded row
draws by its position), so verified output equals what plain decoding would give. In
batch-invariant mode (``model.batch_invariant``) every scoring row is computed exactly as a
one-token decode row (fixed-shape matmuls, attention from position 0 per query token, the same
log-softmax), so greedy tokens and logprobs are bit-identical to those of the same engine
without speculation.

NOTE (for logits processors and grammar masks): in ``Sampler.process_logits`` a verification
step's ``SamplingMetadata.req_ids`` repeats a request's id once per scoring row, in order.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.ops.batch_invariant import batch_invariant_enabled
from pagoda.ops.batch_invariant import log_softmax as invariant_log_softmax
from pagoda.sample.ops import gather_logprobs
from pagoda.sample.rejection import rejection_sample
from pagoda.sample.sampler import Sampler
from pagoda.sample.state import SamplingRows, seeded_uniform
from pagoda.spec_decode.proposer import VerifiedBatch
from pagoda.worker.speculation import Speculation
from pagoda.worker.step_buffers import StepBuffers
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
    spec: Speculation,
    hidden: torch.Tensor,
    out: StepOutput,
    rows: np.ndarray,
    sample_idx: np.ndarray,
    qsl: np.ndarray,
    drafts: dict[str, list[int]],
) -> None:
    """Score and verify the drafts of the sampling requests ``sample_idx`` of the step; fills
    ``out`` as ``ModelRunner._sample`` does, with [n, k + 1] tokens."""
    ib, buffers, model, sampler = spec.input_batch, spec.buffers, spec.model, spec.sampler
    n = len(sample_idx)
    sample_rows = rows[sample_idx]
    req_ids = out.req_ids
    sample_req_ids = [req_ids[i] for i in sample_idx.tolist()]
    nd = np.array([len(drafts.get(r, ())) for r in sample_req_ids], dtype=np.int64)
    k = int(nd.max())
    greedy_graphs = spec.greedy_graphs
    # NOTE: the greedy graphs read the verification graph's own rows: this step's (unpadded,
    # where every request verifies k drafts; else as ``run_verify_graph`` left them).
    graph_rows = hidden if spec.verify_rows is None else spec.verify_rows
    if greedy_graphs is not None and n == len(req_ids) and k < greedy_graphs.q:
        if _plain_greedy(spec, sample_rows, sample_req_ids):
            got = greedy_graphs.run(graph_rows, n, buffers.staged(nd))
            if got is not None:
                base = ib.num_tokens[sample_rows]
                tokens = got.tokens[:, : k + 1]  # (-1 past every request's drafts)
                _emit(spec, out, sample_idx, sample_rows, base, nd, tokens, got.last_token)
                out.verified = (tokens, got.num_emitted)
                _hand_over(spec, out, nd, got.last_hidden, tokens, got.num_emitted)
                return
    width = nd + 1
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(width[:-1], out=starts[1:])
    total = int(width.sum())
    offsets = buffers.arange[:total] - np.repeat(starts, width)
    hidden_idx = np.repeat(qsl[1:][sample_idx] - width, width) + offsets
    rows_exp = np.repeat(sample_rows, width)
    base = ib.num_tokens[sample_rows]
    cols = np.arange(k)
    at = np.minimum(base[:, None] + cols, ib.token_ids.shape[1] - 1)
    draft_ids = ib.token_ids[sample_rows[:, None], at]
    draft_ids = np.where(cols < nd[:, None], draft_ids, -1)

    # NOTE: one host-to-device copy for the step's index arrays.
    packed = buffers.as_device(np.concatenate([hidden_idx, draft_ids.ravel(), nd, starts]))
    hidden_idx_t, draft_t = packed[:total], packed[total : total + n * k].view(n, k)
    nd_t, starts_t = packed[total + n * k : total + n * k + n], packed[total + n * k + n :]
    # NOTE: where every token of the step is a scoring row (batch 1, say) the rows are in order.
    h = hidden[:total] if total == hidden.shape[0] else hidden[hidden_idx_t]
    logits = model.compute_logits(h)
    md = ib.sampling.metadata(rows_exp, ib.token_ids, ib.num_tokens, ib.num_prompt, offsets)
    grammar = spec.grammar
    constrained = bool(grammar.entries)
    row_req_ids = None
    if sampler.logits_processors or constrained:
        row_req_ids = [sample_req_ids[i] for i in np.repeat(buffers.arange[:n], width).tolist()]
    if sampler.logits_processors:
        md.req_ids = row_req_ids
    if constrained:
        # NOTE: constrained requests get no drafts (``Scheduler.set_drafts``): one row each.
        md.grammar = grammar.mask(
            row_req_ids,
            rows_exp,
            ib.token_ids,
            ib.num_tokens,
            ib.num_prompt,
            spec.in_flight.read_all,
            buffers.device,
        )
    if md.penalties is not None:
        _count_drafts_before(md.penalties.output_counts, draft_ids, nd, starts, buffers)
    raw_logprobs = None
    if md.max_num_logprobs is not None:
        # NOTE: in batch-invariant mode as the sampler computes a decode row's (exact mode).
        if batch_invariant_enabled():
            raw_logprobs = invariant_log_softmax(logits)
        else:
            raw_logprobs = logits.float().log_softmax(dim=-1)
    logits = sampler.process_logits(logits, md)
    argmax = logits.argmax(dim=-1)
    probs = greedy = u_accept = None
    if not md.all_greedy:
        probs = Sampler.probs(logits, md)
        if md.greedy_mask is not None:
            greedy = md.greedy_mask[starts_t]
        positions = ib.num_tokens[rows_exp] + offsets
        u_accept = buffers.as_device(accept_uniform(ib.sampling, rows_exp, positions))
    tokens, num_emitted = rejection_sample(
        argmax,
        probs,
        draft_t,
        nd_t,
        starts_t,
        greedy=greedy,
        draft_probs=_draft_probs(spec, sample_req_ids, draft_ids, nd, k),
        uniform_accept=u_accept,
        uniform_final=md.uniform,
    )
    ib.sampling.record_sampled(sample_rows, tokens)
    # Each row's token at its draft count: a plain row's sampled token, which the next step
    # takes as its input on the device (a row with drafts is read before its next step).
    last = tokens.gather(1, nd_t.unsqueeze(1)).squeeze(1).clamp_(min=0)
    _emit(spec, out, sample_idx, sample_rows, base, nd, tokens, last)
    out.verified = (tokens, num_emitted)
    if raw_logprobs is not None:
        req_of_row = buffers.as_device(np.repeat(np.arange(n), width))
        row_tokens = tokens[req_of_row, buffers.as_device(offsets)].clamp(min=0)
        out.logprobs = gather_logprobs(raw_logprobs, md.max_num_logprobs, row_tokens).to_host()
        out.logprobs_ks = ib.sampling.logprobs[sample_rows]
        out.logprobs_starts = starts
    if spec.drafts_after_verify:
        last_hidden = h[starts_t + num_emitted - 1] if spec.needs_hidden_states else None
        _hand_over(spec, out, nd, last_hidden, tokens, num_emitted)


def _plain_greedy(spec: Speculation, rows: np.ndarray, req_ids: list[str]) -> bool:
    """Whether the rows' verification is the argmax's alone: plain greedy rows
    (``SamplingRows.plain``: their metadata is ``SamplingMetadata.plain``), no logits processor,
    no grammar, no draft probabilities."""
    if not spec.input_batch.sampling.plain[rows].all() or spec.sampler.logits_processors:
        return False
    if spec.grammar.entries:
        return False
    kept = spec.draft_probs
    return not kept or not any(r in kept for r in req_ids)


def _emit(
    spec: Speculation,
    out: StepOutput,
    sample_idx: np.ndarray,
    sample_rows: np.ndarray,
    base: np.ndarray,
    nd: np.ndarray,
    tokens: torch.Tensor,
    last: torch.Tensor,
) -> None:
    """The step's sampling rows in ``out`` (the sampled ids in flight to the host) and in the
    record of where the next step finds them on the device (``last`` [n]: each row's token at
    its draft count)."""
    ib = spec.input_batch
    drafted = nd > 0
    sample_pos = base.copy()
    if not drafted.all():
        sample_pos[~drafted] = ib.append_placeholders(sample_rows[~drafted])
    out.sample_idx = sample_idx
    out.sample_rows = sample_rows
    out.sample_pos = sample_pos
    out.drafted = drafted
    out.num_drafts = nd
    spec.in_flight.drew(sample_rows, last)
    out.sampled = tokens.to("cpu", non_blocking=True)


def _hand_over(
    spec: Speculation,
    out: StepOutput,
    nd: np.ndarray,
    last_hidden: torch.Tensor | None,
    tokens: torch.Tensor,
    num_emitted: torch.Tensor,
) -> None:
    """A proposer that reads hidden states: each request's last emitted row for its next
    proposal, and the step's verified requests to draft for on the device right away. A
    history proposer that ``drafts_on_device``: the verified requests alone."""
    if spec.needs_hidden_states:
        out.proposer_hidden = last_hidden
        if spec.hidden_feed is not None and out.hidden_feed is not None:
            draft_after_verify(spec, out, nd, tokens, num_emitted)
    elif spec.proposer.drafts_on_device:
        draft_after_verify(spec, out, nd, tokens, num_emitted)


def draft_after_verify(
    spec: Speculation,
    out: StepOutput,
    nd: np.ndarray,
    tokens: torch.Tensor,
    num_emitted: torch.Tensor,
) -> None:
    """Hand the proposer the step's verified requests on the device
    (``SpeculativeProposer.draft_after_verify``): those that verified drafts, own their row,
    and have no hidden states waiting from earlier steps. Without a hidden-state feed (a
    history proposer that ``drafts_on_device``) the batch holds the token array instead."""
    feed = spec.hidden_feed
    ib = spec.input_batch
    req_ids = out.req_ids
    pending = () if feed is None else feed.pending  # (a property: deferred steps held once)
    pick = [
        j
        for j, (i, row) in enumerate(zip(out.sample_idx.tolist(), out.sample_rows.tolist()))
        if nd[j] and ib.row_of.get(req_ids[i]) == row and req_ids[i] not in pending
    ]
    if not pick:
        return
    sel = np.asarray(pick, dtype=np.int64)
    idx = out.sample_idx[sel]
    idx_l = idx.tolist()
    if feed is None:
        first = out.sample_pos[sel] - 1  # (the last known token: the step's first row)
        count, new_hidden, loc, token_ids = nd[sel] + 1, None, None, ib.token_ids
    else:
        rows_t, qsl, starts = out.hidden_feed
        first, token_ids = starts[idx], None
        # NOTE: plain Python over the picked requests (a few, mostly): their rows, and whether
        # they are one slice of the step's rows (every request of the step verified drafts).
        qsl_l = qsl.tolist()
        count_l = [qsl_l[i + 1] - qsl_l[i] for i in idx_l]
        run = all(qsl_l[a + 1] == qsl_l[b] for a, b in zip(idx_l, idx_l[1:]))
        count = np.asarray(count_l, dtype=np.int64)
        loc = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(count, out=loc[1:])
        if run:
            new_hidden = rows_t[qsl_l[idx_l[0]] : qsl_l[idx_l[0]] + int(loc[-1])]
        else:
            flat = np.repeat(qsl[idx] - loc[:-1], count) + np.arange(int(loc[-1]))
            new_hidden = rows_t[spec.buffers.as_device(flat)]
    everyone = len(sel) == len(nd)
    batch = VerifiedBatch(
        req_ids=[req_ids[i] for i in idx_l],
        rows=out.sample_rows[sel],
        first=first,
        num_rows=count,
        tokens=tokens if everyone else tokens[spec.buffers.as_device(sel)],
        num_emitted=num_emitted if everyone else num_emitted[spec.buffers.as_device(sel)],
        new_hidden_states=new_hidden,
        hidden_loc=loc,
        token_ids=token_ids,
    )
    spec.proposer.draft_after_verify(batch)


def _count_drafts_before(
    counts: torch.Tensor,
    draft_ids: np.ndarray,
    nd: np.ndarray,
    starts: np.ndarray,
    buffers: StepBuffers,
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
        counts.index_put_((buffers.as_device(vrow), buffers.as_device(tok)), ones, accumulate=True)


def _draft_probs(
    spec: Speculation, req_ids: list[str], draft_ids: np.ndarray, nd: np.ndarray, k: int
) -> torch.Tensor | None:
    """[n, k, vocab] q of each draft, when the proposer gave probabilities for some request;
    one-hot rows for the others."""
    kept = spec.draft_probs
    if not kept or not any(r in kept for r in req_ids):
        return None
    vocab = spec.vocab_size
    ids = spec.buffers.as_device(np.maximum(draft_ids, 0))
    q = torch.nn.functional.one_hot(ids, vocab).float()
    for i, req_id in enumerate(req_ids):
        p = kept.get(req_id)
        if p is not None and nd[i]:
            q[i, : nd[i]] = p[: nd[i]]
    return q


def run_verify_graph(
    spec: Speculation,
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
    graphs, r = spec.verify_graphs, spec.buffers
    q = graphs.query_len
    n = len(counts)
    bucket = graphs.bucket_for(n)
    if bucket is None or int(counts.max()) > q or int((starts + q).max()) > spec.max_model_len:
        return None
    total = len(input_ids)
    tok_req = np.repeat(r.arange[:n], counts)
    index = tok_req * q + (r.arange[:total] - qsl[tok_req])  # each token's padded place

    def spread(a: np.ndarray) -> np.ndarray:
        out = np.zeros(n * q, dtype=np.int64)
        out[index] = a
        return out

    seq_lens = starts + q
    qsl_pad = r.arange[: n + 1] * q
    max_blocks = -(-int(seq_lens.max()) // r.block_size)
    table = spec.input_batch.block_table[rows, :max_blocks]
    # (pads: slot 0 of block 0)
    r.copy_inputs(spread(input_ids), spread(positions), spread(slots), qsl_pad, seq_lens, table)
    if unknown is not None and len(unknown):  # ids the last step sampled, still on the device
        spec.in_flight.fill_from_device(r, index[unknown], unknown_rows)
    hidden = graphs.run(r.uniform_step(n, q, seq_lens), bucket)
    if total == n * q:  # every request has q tokens: no padding to drop
        return hidden[:total]
    spec.verify_rows = hidden  # (padded: what the greedy graphs verify)
    return hidden[r.as_device(index)]
