"""Expert parallelism: each rank holds whole experts, and each token's routed pairs travel to
the ranks of their experts and back by all-to-all.

Every rank holds every token when the MoE block runs (attention's output is summed over the
ranks), so each rank dispatches only its share of the tokens (a contiguous chunk), and the
outputs are gathered at the end. Buffers have fixed sizes (a rank may send all its pairs to one
rank): nothing is read back to the host, so a CUDA graph can hold the exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagoda.distributed import get_tp_rank, get_tp_size
from pagoda.ops import fused_experts

_expert_parallel = False


def set_expert_parallel(enabled: bool) -> None:
    """Choose how the next models built split their experts over the ranks (``plugins.moe.
    expert_parallel``): whole experts per rank (True) or a slice of every expert (False)."""
    global _expert_parallel
    _expert_parallel = bool(enabled)


def expert_parallel_enabled() -> bool:
    return _expert_parallel


def _all_to_all(x: torch.Tensor) -> torch.Tensor:
    """``x`` [ranks, ...]: row r goes to rank r; returns the rows received, by source rank."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous())
    return out


def expert_parallel_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """:func:`pagoda.ops.fused_experts` over the ranks, each holding ``w13.shape[0]``
    consecutive experts (rank r: from ``r * local``); ``x`` and the routing are the same on
    every rank, and so is the result."""
    size, rank = get_tp_size(), get_tp_rank()
    n, k = topk_ids.shape
    hidden, local = x.shape[1], w13.shape[0]
    chunk = -(-n // size)
    cap = chunk * k  # the most pairs one rank can send to another
    start = min(rank * chunk, n)
    mine = min(chunk, n - start)
    ids = topk_ids.new_full((chunk, k), -1)
    ids[:mine] = topk_ids[start : start + mine]
    weights = topk_weights.new_zeros((chunk, k), dtype=torch.float32)
    weights[:mine] = topk_weights[start : start + mine]
    flat = ids.reshape(-1).long()
    valid = flat >= 0
    dest = torch.where(valid, flat // local, size)  # ``size``: no rank
    # Each pair's place in its destination's rows: how many earlier pairs go there.
    # NOTE: a comparison, not F.one_hot, which checks its input on the host (a sync).
    onehot = (dest.unsqueeze(1) == torch.arange(size + 1, device=x.device)).long()
    place = (onehot.cumsum(0) - onehot).gather(1, dest.unsqueeze(1)).squeeze(1)
    slot = torch.where(valid, dest * cap + place, size * cap)  # the extra row: a sink
    src_rows = torch.arange(chunk * k, device=x.device) // k
    send_x = x.new_zeros((size * cap + 1, hidden))
    send_x.index_copy_(0, slot, _rows(x, start, mine, chunk)[src_rows])
    send_id = ids.new_full((size * cap + 1,), -1)
    send_id.index_copy_(0, slot, torch.where(valid, flat - dest * local, -1).to(ids.dtype))
    send_w = weights.new_zeros(size * cap + 1)
    send_w.index_copy_(0, slot, weights.reshape(-1))
    # The sink row collected the pairs of no expert: it is not sent.
    recv_x = _all_to_all(send_x[:-1].view(size, cap, hidden))
    recv_id = _all_to_all(send_id[:-1].view(size, cap))
    recv_w = _all_to_all(send_w[:-1].view(size, cap))
    y = fused_experts(
        recv_x.view(-1, hidden), w13, w2, recv_w.view(-1, 1), recv_id.view(-1, 1)
    )  # one pair per row, its weight applied, nothing where the id is -1
    back = torch.cat([_all_to_all(y.view(size, cap, hidden)).view(-1, hidden),
                      y.new_zeros(1, hidden)])  # fmt: skip
    by_pair = back.index_select(0, slot).view(chunk, k, hidden).float()
    total = by_pair[:, 0]
    for j in range(1, k):  # slot order, as the fused operator sums
        total = total + by_pair[:, j]
    parts = [torch.empty((chunk, hidden), dtype=x.dtype, device=x.device) for _ in range(size)]
    dist.all_gather(parts, total.to(x.dtype))
    return torch.cat(parts)[:n]


def _rows(x: torch.Tensor, start: int, mine: int, chunk: int) -> torch.Tensor:
    """This rank's chunk of the tokens, padded with zero rows to ``chunk``."""
    if mine == chunk:
        return x[start : start + chunk]
    out = x.new_zeros((chunk, x.shape[1]))
    out[:mine] = x[start : start + mine]
    return out
