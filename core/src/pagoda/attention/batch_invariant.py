"""The attention of batch-invariant mode: a query token's output depends on its own query and its
request's keys at positions ``0..p``, never on the batch or on how the prompt was chunked.

Every query token, decode or prefill alike, visits its keys in tiles of a fixed size from
position 0, with no split of the context. On CUDA a Triton kernel does it per (token, KV head)
(:mod:`pagoda.ops.triton_invariant_attention`). On a CPU torch code does it over chunks of a fixed
number of tokens: every call inside has one shape, so the library picks one kernel for it; the
softmax takes two passes (scores of all tiles, their exact maximum, then the sums in tile order),
so no rescaling factor is computed outside a full tile. Tiles past a token's last key are masked
whole and add exact zeros.

The model runner selects this backend itself when ``model.batch_invariant`` is on.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    CommonAttentionMetadata,
    write_kv_cache,
)
from pagoda.distributed import get_tp_size

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

logger = logging.getLogger(__name__)

_CPU_TILE = 64  # keys per tile on a CPU (a multiple of any vector width: no scalar remainder)
_CPU_TOKENS = 8  # query tokens per chunk on a CPU, at most
_GRAIN = 32768  # torch's one-thread limit in elements (at::internal::GRAIN_SIZE)


@dataclass
class InvariantCpuPlan:
    """Per step, shared by the layers: for each chunk of query tokens, the cache slots of every
    key tile its tokens read and the additive mask (0 for keys at or before the token, -inf
    after)."""

    tokens: int  # query tokens per chunk
    num_tokens: int
    slots: list[torch.Tensor]  # per chunk: [tiles, tokens * TILE] int64 flat cache slots
    bias: list[torch.Tensor]  # per chunk: [tiles, tokens, 1, 1, TILE] float32 (0 / -inf)


@dataclass
class InvariantMetadata:
    common: CommonAttentionMetadata
    on_cpu: bool
    # The CPU plan, made by the first layer (which knows the heads: they size the chunks).
    cpu: InvariantCpuPlan | None = None


class BatchInvariantBackend(AttentionBackend):
    name = "batch_invariant"
    priority = -100  # never chosen by `auto`: the runner selects it in batch-invariant mode
    # Launch parameters depend on the batch size only; lengths come from device buffers.
    supports_cuda_graph = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
        if device.type == "cuda":
            return importlib.util.find_spec("triton") is not None and 8 <= head_size <= 256
        return device.type == "cpu"

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return BatchInvariantImpl

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> InvariantMetadata:
        return InvariantMetadata(common, common.block_table.device.type != "cuda")


def _plan_cpu(common: CommonAttentionMetadata, num_heads: int) -> InvariantCpuPlan:
    n = common.num_reqs
    qsl = common.query_start_loc_cpu[: n + 1].astype(np.int64)
    seq_lens = common.seq_lens_cpu[:n].astype(np.int64)
    counts = np.diff(qsl)
    total = int(qsl[-1])
    req = np.repeat(np.arange(n), counts)
    # Position of each query token: its request's context before the step, then its offset.
    pos = np.repeat(seq_lens - counts - qsl[:-1], counts) + np.arange(total)
    # NOTE: a chunk's score tensor stays under the grain: one thread, one order, for any count.
    c = max(1, min(_CPU_TOKENS, (_GRAIN - 1) // (num_heads * _CPU_TILE)))
    padded = -(-max(total, 1) // c) * c
    # Padding tokens read one key, slot 0 of block 0 (never handed out, always finite).
    pos = np.concatenate([pos, np.zeros(padded - total, dtype=np.int64)])
    req = np.concatenate([req, np.zeros(padded - total, dtype=np.int64)])
    block_table = common.block_table[:n].cpu().numpy().astype(np.int64)
    bs = common.block_size
    slots, bias = [], []
    for start in range(0, padded, c):
        p = pos[start : start + c]
        r = req[start : start + c]
        real = np.arange(start, start + c) < total
        tiles = int(p.max()) // _CPU_TILE + 1
        key_pos = np.arange(tiles * _CPU_TILE)  # [L]
        visible = key_pos[None, :] <= p[:, None]  # [c, L]
        blocks = np.zeros((c, tiles * _CPU_TILE), dtype=np.int64)
        if real.any():
            rows = block_table[r[real]]
            idx = np.minimum(key_pos // bs, rows.shape[1] - 1)
            blocks[real] = rows[:, idx]
        slot = np.where(visible, blocks * bs + key_pos % bs, 0)
        # [tiles, c * TILE]: tile t's keys of token 0, then of token 1, ...
        slot = slot.reshape(c, tiles, _CPU_TILE).transpose(1, 0, 2).reshape(tiles, -1)
        mask = np.where(visible, 0.0, -np.inf).astype(np.float32)
        mask = mask.reshape(c, tiles, 1, 1, _CPU_TILE).transpose(1, 0, 2, 3, 4)
        slots.append(torch.from_numpy(np.ascontiguousarray(slot)))
        bias.append(torch.from_numpy(np.ascontiguousarray(mask)))
    return InvariantCpuPlan(c, total, slots, bias)


class BatchInvariantImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: InvariantMetadata,
    ) -> torch.Tensor:
        c = attn_metadata.common
        n = c.num_actual_tokens
        key_cache, value_cache = write_kv_cache(key, value, kv_cache, c.slot_mapping, n)
        if not attn_metadata.on_cpu:
            # NOTE: Triton compiles on import: only where the kernel path runs.
            from pagoda.ops.triton_invariant_attention import invariant_attention

            out = torch.empty_like(query)
            return invariant_attention(
                query,
                key_cache,
                value_cache,
                out,
                c.block_table,
                c.seq_lens,
                c.query_start_loc,
                c.num_reqs,
                n,
                self.scale,
            )
        if attn_metadata.cpu is None:
            attn_metadata.cpu = _plan_cpu(c, self.num_heads)
        return self._cpu(query, key_cache, value_cache, attn_metadata.cpu)

    def _cpu(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: InvariantCpuPlan,
    ) -> torch.Tensor:
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_size
        g = h // h_kv
        c, n = plan.tokens, plan.num_tokens
        keys = key_cache.reshape(-1, h_kv, d)
        values = value_cache.reshape(-1, h_kv, d)
        dtype = query.dtype
        q_all = query[:n].float() * self.scale
        out = torch.zeros(max(len(plan.slots) * c, query.shape[0]), h, d, dtype=dtype)
        for i, (slots, bias) in enumerate(zip(plan.slots, plan.bias, strict=True)):
            q = q_all.new_zeros(c, h, d)
            part = q_all[i * c : (i + 1) * c]
            q[: len(part)] = part
            q = q.view(c, h_kv, g, d)  # query heads grouped under their KV head
            tiles = slots.shape[0]
            scores = []
            for t in range(tiles):
                k = keys.index_select(0, slots[t]).float().view(c, _CPU_TILE, h_kv, d)
                # [c, h_kv, g, d] @ [c, h_kv, d, TILE]: one shape for every call
                s = torch.matmul(q, k.permute(0, 2, 3, 1)) + bias[t]
                scores.append(s)
            m = scores[0].amax(dim=-1, keepdim=True)
            for s in scores[1:]:
                m = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            denom = torch.zeros(c, h_kv, g, 1)
            acc = torch.zeros(c, h_kv, g, d)
            for t in range(tiles):
                p = torch.exp(scores[t] - m)
                denom = denom + p.sum(dim=-1, keepdim=True)
                v = values.index_select(0, slots[t]).float().view(c, _CPU_TILE, h_kv, d)
                acc = acc + torch.matmul(p, v.permute(0, 2, 1, 3))
            out[i * c : (i + 1) * c] = (acc / denom).view(c, h, d).to(dtype)
        return out[: query.shape[0]]


def invariant_attention_backend(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, head_size: int
) -> type[AttentionBackend]:
    """The attention of batch-invariant mode, after checking the engine can run in it."""
    if get_tp_size() > 1:
        raise ValueError(
            "model.batch_invariant does not support tensor parallelism (an all-reduce sums in an "
            "order that depends on the batch); set parallel.tensor_parallel_size to 1"
        )
    if not BatchInvariantBackend.supports(device, dtype, head_size):
        raise ValueError(
            f"model.batch_invariant needs Triton on CUDA and a head size of 8 to 256 (head size "
            f"{head_size}, {str(dtype).removeprefix('torch.')} on {device})"
        )
    if config.attention.backend not in ("auto", BatchInvariantBackend.name):
        logger.warning(
            "model.batch_invariant: attention.backend %r is not used; batch-invariant attention "
            "runs instead",
            config.attention.backend,
        )
    return BatchInvariantBackend
