"""The sampler's steps as functions over a batch of logits rows, each with vLLM's meaning.

Functions named ``apply_*`` may work in place on ``logits`` and return the result.
"""

from __future__ import annotations

import torch

from pagoda.ops.batch_invariant import batch_invariant_enabled
from pagoda.ops.draw import sample_from_probs as sample_from_probs  # re-exported
from pagoda.sample.metadata import LogprobsTensors, Penalties

_NEG_INF = float("-inf")
_TOP_P_CANDIDATES = 256  # the largest logits top-p looks at before sorting a whole row


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition penalty as in transformers (a seen token's logit is divided by the penalty if
    positive, multiplied if not), then OpenAI's frequency and presence penalties."""
    in_output = p.output_counts > 0
    rep = p.repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(p.prompt_mask | in_output, penalised, logits)
    logits -= p.frequency.unsqueeze(1) * p.output_counts
    logits -= p.presence.unsqueeze(1) * in_output
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely one's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then the smallest set of those whose probability
    reaches ``top_p`` (the most likely token always stays). Rows without a limit hold top_k =
    vocab size and top_p = 1.

    Top-p looks at the ``_TOP_P_CANDIDATES`` largest logits and sorts a whole row only where they
    do not reach ``top_p`` (sorting the vocabulary would dominate a CPU step).
    """
    if top_k is not None:
        logits = _apply_top_k(logits, top_k, max_top_k)
    if top_p is None:
        return logits
    values = logits.topk(min(logits.shape[-1], _TOP_P_CANDIDATES), dim=-1).values
    weights = (values - values[:, :1]).exp_()
    total = (logits - values[:, :1]).exp_().sum(dim=-1, keepdim=True)
    before = (weights.cumsum(dim=-1) - weights).div_(total)  # mass of the more likely tokens
    # NOTE: at least one: a top_p that rounds to 0 in float32 (5e-324) keeps the likeliest.
    num_kept = (before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = values.gather(1, num_kept - 1)
    no_top_p = (top_p >= 1.0).unsqueeze(1)
    threshold.masked_fill_(no_top_p, _NEG_INF)
    # NOTE: when the candidates hold top_p of the mass, the first token after them is dropped.
    decided = no_top_p | (weights.sum(dim=-1, keepdim=True) >= top_p.unsqueeze(1) * total)
    logits.masked_fill_(decided & (logits < threshold), _NEG_INF)
    if batch_invariant_enabled():  # one shape, whichever rows need the sort
        if not bool(decided.all()):
            logits = torch.where(decided, logits, _sort_top_p(logits.clone(), top_p))
    elif not bool(decided.all()):
        rest = (~decided).nonzero()[:, 0]
        logits[rest] = _sort_top_p(logits[rest], top_p[rest])
    return logits


def _sort_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p by sorting the whole vocabulary."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k needs no sort: the k-th largest of a row is among the ``max_top_k`` largest."""
    no_limit = top_k >= logits.shape[-1]
    values = logits.topk(max_top_k, dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth.masked_fill_(no_limit.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """The logprob and rank of each row's ``token_ids`` entry, then the row's top
    ``num_logprobs`` tokens. Rank counts the tokens at least as likely (vLLM's convention)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    ids, lps = token_ids.unsqueeze(1), chosen
    if num_logprobs > 0:
        top = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat([ids, top.indices], dim=1)
        lps = torch.cat([lps, top.values], dim=1)
    return LogprobsTensors(ids, lps, ranks)
