"""The reference attention backend: plain torch over the paged cache, on any device.

Decoding requests (one query token) are attended in one batched call over their gathered,
padded contexts; requests with several query tokens (prefill chunks) one call each. All
per-step planning happens in ``build_metadata``, once per step, not in the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    CommonAttentionMetadata,
    write_kv_cache,
)


@dataclass
class _Prefill:
    start: int  # first token in the flat batch
    end: int
    seq_len: int
    blocks: torch.Tensor  # [num_blocks] block ids covering the context
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when plain causal (no context)


@dataclass
class TorchNativeMetadata:
    common: CommonAttentionMetadata
    all_decode: bool
    decode_tokens: torch.Tensor | None  # flat-batch indices of decode tokens
    decode_blocks: torch.Tensor | None  # [num_decodes * max_blocks] block ids, row-major
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[_Prefill]
    # The decode mask as an additive float mask, made by the first layer that needs it.
    decode_bias: torch.Tensor | None = None

    def decode_bias_for(self, dtype: torch.dtype) -> torch.Tensor:
        if self.decode_bias is None or self.decode_bias.dtype != dtype:
            bias = torch.zeros(self.decode_mask.shape, dtype=dtype, device=self.decode_mask.device)
            self.decode_bias = bias.masked_fill_(~self.decode_mask, float("-inf"))
        return self.decode_bias


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    priority = 0

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        return dtype in (torch.float32, torch.float16, torch.bfloat16)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TorchNativeImpl

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchNativeMetadata:
        n = common.num_reqs
        qsl = common.query_start_loc_cpu[: n + 1]
        seq_lens = common.seq_lens_cpu[:n]
        q_lens = np.diff(qsl)
        bs = common.block_size
        device = common.block_table.device
        decode_rows = np.nonzero(q_lens == 1)[0]
        all_decode = len(decode_rows) == n
        decode_tokens = decode_blocks = decode_mask = None
        if len(decode_rows):
            lens = seq_lens[decode_rows]
            max_blocks = int(-(-int(lens.max()) // bs))
            rows_t = torch.from_numpy(decode_rows).to(device)
            decode_blocks = common.block_table[rows_t, :max_blocks].flatten().long()
            if not all_decode:
                decode_tokens = torch.from_numpy(qsl[decode_rows]).to(device)
            arange = torch.arange(max_blocks * bs, device=device)
            lens_t = torch.from_numpy(lens.astype(np.int64)).to(device)
            decode_mask = (arange[None, :] < lens_t[:, None])[:, None, None, :]
        prefills = []
        for i in np.nonzero(q_lens > 1)[0]:
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q_len = end - start
            blocks = common.block_table[int(i), : -(-seq_len // bs)]
            mask = None
            if seq_len > q_len:
                ctx = seq_len - q_len
                q_pos = torch.arange(q_len, device=device)[:, None] + ctx
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos
            prefills.append(_Prefill(start, end, seq_len, blocks, mask))
        return TorchNativeMetadata(
            common, all_decode, decode_tokens, decode_blocks, decode_mask, prefills
        )


class TorchNativeImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchNativeMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        num_tokens = md.common.num_actual_tokens
        key_cache, value_cache = write_kv_cache(
            key, value, kv_cache, md.common.slot_mapping, num_tokens
        )

        if md.all_decode:
            return self._decode(query[:num_tokens], key_cache, value_cache, md)
        out = torch.empty_like(query)
        if md.decode_blocks is not None:
            q = query.index_select(0, md.decode_tokens)
            out.index_copy_(0, md.decode_tokens, self._decode(q, key_cache, value_cache, md))
        h_kv, d = self.num_kv_heads, self.head_size
        group = self.num_heads // h_kv
        for p in md.prefills:
            if p.mask is None:  # no context: the keys are the step's own, no gather
                k, v = key[p.start : p.end], value[p.start : p.end]
            else:
                k = key_cache[p.blocks].flatten(0, 1)[: p.seq_len]
                v = value_cache[p.blocks].flatten(0, 1)[: p.seq_len]
            q_len, kv_len = p.end - p.start, k.shape[0]
            # NOTE: KV heads as the batch and the query heads sharing one as its heads, K and V
            # expanded (stride 0, no copy): torch's fused CPU kernel with no copy of K and V per
            # query head, the same bits as repeating them (enable_gqa takes a slower path).
            o = F.scaled_dot_product_attention(
                query[p.start : p.end].view(q_len, h_kv, group, d).permute(1, 2, 0, 3),
                k.permute(1, 0, 2).unsqueeze(1).expand(h_kv, group, kv_len, d),
                v.permute(1, 0, 2).unsqueeze(1).expand(h_kv, group, kv_len, d),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
            )
            out[p.start : p.end] = o.permute(2, 0, 1, 3).reshape(q_len, self.num_heads, d)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [num_decodes, num_heads, head_size]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: TorchNativeMetadata,
    ) -> torch.Tensor:
        b, h_kv, d = q.shape[0], self.num_kv_heads, self.head_size
        num_blocks = key_cache.shape[0]
        # One row gather per block (index_select beats advanced indexing on CPU), viewed as
        # [B, H_kv, L, D] without a copy.
        k = key_cache.view(num_blocks, -1).index_select(0, md.decode_blocks)
        v = value_cache.view(num_blocks, -1).index_select(0, md.decode_blocks)
        k = k.view(b, -1, h_kv, d).transpose(1, 2)
        v = v.view(b, -1, h_kv, d).transpose(1, 2)
        # NOTE: the query heads that share a KV head ride as that head's "query positions", so
        # grouped-query attention needs no copy of K and V per query head.
        o = F.scaled_dot_product_attention(
            q.view(b, h_kv, -1, d), k, v, attn_mask=md.decode_bias_for(q.dtype), scale=self.scale
        )
        return o.reshape(b, self.num_heads, d)
