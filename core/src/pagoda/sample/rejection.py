"""The rejection sampler: which drafts the target model accepts, and the token after them.

For each request with ``k`` drafts the target scored ``k + 1`` positions in one forward (row ``j``
is the distribution p_j of the token after draft ``j - 1``; row 0 follows the last known token).
Walking left to right, draft ``d_j`` drawn from the proposer's q_j is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token comes from
``max(0, p_j - q_j)`` normalised, and if every draft is accepted a bonus token comes from p_k.
Each emitted token then has exactly the target's distribution (Leviathan et al., 2023; Chen et
al., 2023). A proposer without probabilities (n-gram) gives a one-hot q: accept with p_j(d_j),
resample from p_j without d_j. Greedy rows accept a draft iff it is the target's argmax and end
with the argmax, so greedy output is token for token what it is without speculation.

Everything is batched on the device, with no Python loop over requests or positions, and with no
host synchronisation; where every row is greedy, on CUDA, one Triton kernel does it all
(:mod:`pagoda.sample.greedy_verify_kernel`).
"""

from __future__ import annotations

import torch

from pagoda.sample.ops import sample_from_probs


def rejection_sample(
    target_argmax: torch.Tensor,
    target_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    starts: torch.Tensor,
    greedy: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    uniform_accept: torch.Tensor | None = None,
    uniform_final: torch.Tensor | None = None,
    kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``n`` requests' drafts against the target.

    :param target_argmax: [T] int64, the argmax of each scored row (T = sum of ``num_drafts + 1``).
    :param target_probs: [T, vocab] float32, the target's sampling distribution of each row
        (after penalties, temperature, top-k/top-p); None when every row is greedy.
    :param draft_ids: [n, k] int64, request ``i``'s drafts first, anything past ``num_drafts[i]``.
    :param num_drafts: [n] int64, ``0 <= num_drafts <= k``.
    :param starts: [n] int64, the first of request ``i``'s ``num_drafts[i] + 1`` rows.
    :param greedy: [n] bool, which requests are greedy; None means all of them are random when
        ``target_probs`` is given, all greedy otherwise.
    :param draft_probs: [n, k, vocab] float32, q of each draft position; None: one-hot q.
    :param uniform_accept: [T] float64 in [0, 1), each row's acceptance draw (random rows).
    :param uniform_final: [T] float64 in [0, 1), each row's draw of a token of its own, used at
        the row after the accepted drafts (random rows).
    :param kernel: False: torch operations only, on any device (the reference the greedy
        kernel must equal).
    :returns: ``(tokens, num_emitted)``: [n, k + 1] int64 with -1 past each request's
        ``num_emitted`` (>= 1) tokens: the accepted drafts, then one token of the target.
    """
    if kernel and target_probs is None and draft_ids.is_cuda:
        # NOTE: imported here, not at the top: it imports Triton, a heavy optional dependency
        # that only CUDA steps with drafts need.
        from pagoda.sample import greedy_verify_kernel

        if greedy_verify_kernel.available(draft_ids.device):
            return greedy_verify_kernel.greedy_verify(target_argmax, draft_ids, num_drafts, starts)
    n, k = draft_ids.shape
    dev = draft_ids.device
    cols = torch.arange(k, device=dev)
    valid = cols.unsqueeze(0) < num_drafts.unsqueeze(1)
    rows = (starts.unsqueeze(1) + cols).clamp_(max=target_argmax.shape[0] - 1)
    drafts = draft_ids.clamp(min=0)
    accept = target_argmax[rows] == drafts
    if target_probs is not None:
        p_d = target_probs[rows, drafts]
        u = uniform_accept[rows]
        if draft_probs is None:
            random_accept = u < p_d
        else:
            q_d = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
            random_accept = u * q_d < p_d
        accept = (
            random_accept
            if greedy is None
            else torch.where(greedy.unsqueeze(1), accept, random_accept)
        )
    accept &= valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    final_rows = starts + num_accepted
    final = target_argmax[final_rows]
    if target_probs is not None:
        final_random = _final_random(
            target_probs[final_rows],
            drafts,
            num_accepted,
            num_drafts,
            draft_probs,
            uniform_final[final_rows],
        )
        final = final_random if greedy is None else torch.where(greedy, final, final_random)

    tokens = torch.where(cols.unsqueeze(0) < num_accepted.unsqueeze(1), drafts, -1)
    tokens = torch.cat([tokens, torch.full((n, 1), -1, dtype=tokens.dtype, device=dev)], dim=1)
    tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return tokens, num_accepted + 1


def _final_random(
    p: torch.Tensor,
    drafts: torch.Tensor,
    num_accepted: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """The token at the first rejected position, from ``max(0, p - q)``, or the bonus token from
    ``p`` where every draft was accepted. ``p``: [n, vocab], the target row at that position."""
    n, k = drafts.shape
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=max(k - 1, 0)).unsqueeze(1)
    if k == 0:
        return sample_from_probs(p, uniform)
    if draft_probs is None:
        residual = p.clone()
        d = drafts.gather(1, at)
        residual.scatter_(1, d, torch.where(rejected.unsqueeze(1), 0.0, p.gather(1, d)))
    else:
        q = draft_probs.gather(1, at.unsqueeze(2).expand(n, 1, draft_probs.shape[2])).squeeze(1)
        residual = torch.where(rejected.unsqueeze(1), (p - q).clamp_(min=0.0), p)
    # NOTE: a rejection leaves mass (it needs p(d) < q(d)); rounding could still empty a row.
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return sample_from_probs(residual, uniform)
