"""Mixture of experts: routing, token-to-expert alignment and the experts' two GEMMs.

The operator every backend implements (:class:`FusedExperts`) takes the tokens ``x`` [n, H], the
stacked experts ``w13`` [E, 2 * I, H] (each expert's gate rows, then its up rows: transformers'
``gate_up_proj`` layout) and ``w2`` [E, H, I], and each token's ``k`` routed experts and their
weights, and returns ``sum_j weight_j * down_e(silu(gate_e(x)) * up_e(x))`` for ``e`` the j-th
expert, [n, H] in ``x``'s dtype. An expert id of ``-1`` (an expert held by another rank under
expert parallelism) contributes nothing.

Rounding, the same for every implementation: the gate and up products accumulate in float32;
``silu(gate) * up`` is computed in float32 and rounded to ``x``'s dtype (the down GEMM's input);
the down product accumulates in float32, is multiplied by the routing weight in float32 and
rounded to ``x``'s dtype; the ``k`` contributions are summed in float32 in slot order (a fixed
order: the result of a token does not depend on where its pairs were computed) and rounded.

The torch reference (:func:`fused_experts_reference`) runs on a CPU, and on CUDA without Triton;
on CUDA the grouped-GEMM Triton kernels of :mod:`pagoda.ops.triton_fused_moe` run, on the pairs
grouped by expert as :func:`align_tokens` specifies, with launch configs tuned per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pagoda.ops import batch_invariant

__all__ = [
    "Alignment",
    "FusedExperts",
    "align_tokens",
    "check_experts",
    "fused_experts_reference",
    "route",
]


class FusedExperts(Protocol):
    """The experts' computation, as a backend provides it (see the module's docstring)."""

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor: ...


def check_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    """One-line errors for shapes the operator cannot take."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused MoE: stacked experts must be 3-d, got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}")  # fmt: skip
    experts, two_inter, hidden = w13.shape
    if two_inter % 2 or w2.shape != (experts, hidden, two_inter // 2):
        raise ValueError(
            f"fused MoE: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
            "([E, 2*I, H] and [E, H, I])"
        )
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"fused MoE: x {tuple(x.shape)} is not [tokens, {hidden}]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused MoE: topk_ids {tuple(topk_ids.shape)} is not [{x.shape[0]}, k]")


def route(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts: (weights float32 [n, k], ids int32 [n, k]).

    Scores in float32: ``softmax`` over the experts (Mixtral, Qwen-MoE, OLMoE) or ``sigmoid``
    of each; the ``top_k`` highest (ties: the lower id, as ``torch.topk``); with ``renormalize``
    divided by their sum (Mixtral always; Qwen and OLMoE where ``norm_topk_prob`` says)."""
    experts = router_logits.shape[-1]
    if not 0 < top_k <= experts:
        raise ValueError(f"fused MoE: top_k={top_k} must be in 1..{experts} (the experts)")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"fused MoE: scoring {scoring!r} is not supported (softmax, sigmoid)")
    logits = router_logits.float()
    if batch_invariant._enabled and logits.shape[0]:
        # Chunks of a fixed number of rows: every call of one shape, whatever the batch.
        rows = batch_invariant.sampler_rows(logits.device)
        packed = batch_invariant.fixed_rows(
            lambda a: _route_packed(a, top_k, scoring, renormalize), rows, logits
        )
        return packed[:, :top_k], packed[:, top_k:].to(torch.int32)
    weights, ids = _route(logits, top_k, scoring, renormalize)
    return weights, ids.to(torch.int32)


def _route(
    logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _route_packed(
    logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
) -> torch.Tensor:
    """:func:`_route`'s weights and ids side by side in one float32 tensor (ids are exact)."""
    weights, ids = _route(logits, top_k, scoring, renormalize)
    return torch.cat([weights, ids.float()], dim=1)


def fused_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The operator in torch: one pair of GEMMs per expert that received a token (the host
    reads which experts did). Rounds as the module's docstring says."""
    check_experts(x, w13, w2, topk_ids)
    n, k = topk_ids.shape
    inter = w13.shape[1] // 2
    flat_ids = topk_ids.reshape(-1).long()
    if n == 0:
        return x.new_zeros(x.shape)
    pair_out = torch.zeros(n * k, x.shape[1], dtype=torch.float32, device=x.device)
    # Pairs sorted by expert (stable: a token's pairs keep their order).
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.clamp(min=0), minlength=w13.shape[0])
    invalid = int((flat_ids < 0).sum())
    start = invalid  # the -1 ids (experts of other ranks) sort first
    counts[0] -= invalid  # counted as expert 0 by the clamp
    mm = batch_invariant.linear if batch_invariant._enabled else F.linear
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        pairs = order[start : start + c]
        start += c
        rows = x.index_select(0, pairs // k)
        w = w13[e]
        gate = mm(rows.float(), w[:inter].float())
        up = mm(rows.float(), w[inter:].float())
        act = (F.silu(gate) * up).to(x.dtype)
        down = mm(act.float(), w2[e].float())
        pair_out[pairs] = down * topk_weights.reshape(-1)[pairs].float().unsqueeze(1)
    pair_out = pair_out.to(x.dtype).float().view(n, k, -1)
    total = pair_out[:, 0]
    for j in range(1, k):  # slot order: fixed
        total = total + pair_out[:, j]
    return total.to(x.dtype)


@dataclass(frozen=True, slots=True)
class Alignment:
    """The routed pairs sorted by expert, each expert's run padded to a multiple of
    ``block_m``: what one program of a grouped GEMM reads (``block_m`` rows of one expert).

    - ``sorted_pairs`` [capacity] int32: pair indices (``token * k + slot``), the padding and
      the unused tail holding ``n * k`` (no pair);
    - ``block_experts`` [capacity / block_m] int32: the expert of each block, -1 past the end;
    - ``num_padded`` [1] int32: the rows in use (a multiple of ``block_m``).

    ``capacity`` is fixed by the shapes alone (``n * k + E * (block_m - 1)``, rounded up to
    ``block_m``), so nothing is read back to the host and a CUDA graph can hold it.
    """

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the pairs of ``topk_ids`` [n, k] by expert (stable), padding each expert's run to
    ``block_m`` rows; ids of -1 (or ``num_experts`` and above) go to no expert."""
    device = topk_ids.device
    n, k = topk_ids.shape
    pairs = n * k
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    ids = torch.where(valid, ids, num_experts)  # a bin past the last expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    in_expert = sorted_ids < num_experts
    e = sorted_ids.clamp(max=num_experts - 1)
    rank = torch.arange(pairs, device=device) - run_start[e]
    dest = torch.where(in_expert, padded_start[e] + rank, 0)
    blocks = (pairs + num_experts * (block_m - 1) + block_m - 1) // block_m
    capacity = max(blocks, 1) * block_m
    sorted_pairs = torch.full((capacity + 1,), pairs, dtype=torch.int32, device=device)
    # Pairs of no expert are written to the extra last slot, then cut off.
    dest = torch.where(in_expert, dest, capacity)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    sorted_pairs = sorted_pairs[:capacity]
    block_rows = torch.arange(max(blocks, 1), device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_rows, right=True).to(torch.int32)
    total = padded_end[-1:] if num_experts else torch.zeros(1, dtype=torch.int64, device=device)
    block_experts = torch.where(block_rows < total, block_experts, -1).to(torch.int32)
    return Alignment(sorted_pairs, block_experts, total.to(torch.int32), block_m)
