"""Paged attention from scratch: write the step's keys and values into the cache, gather each
request's context back from its blocks, and attend with torch's scaled_dot_product_attention,
one request at a time. Slow, but every rule of the contract is visible."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionBackend, AttentionImpl, CommonAttentionMetadata


@dataclass
class SdpaRequest:
    start: int  # its first query row in the flat batch
    end: int  # one past its last query row
    seq_len: int  # context length, this step's tokens included
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] block ids, on the device


@dataclass
class SdpaMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    requests: list[SdpaRequest]


class PagedSdpaBackend(AttentionBackend):
    name = "sdpa"  # the name it is registered under
    priority = -1  # below the reference backend: `auto` never picks it; select it by name

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        return dtype in (torch.float32, torch.float16, torch.bfloat16)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return PagedSdpaImpl

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> SdpaMetadata:
        # Once per step, before the first layer: plan from the host copies (no device sync).
        qsl, seq_lens, bs = common.query_start_loc_cpu, common.seq_lens_cpu, common.block_size
        requests = []
        for i in range(common.num_reqs):
            seq_len = int(seq_lens[i])
            num_blocks = -(-seq_len // bs)
            blocks = common.block_table[i, :num_blocks].long()
            requests.append(SdpaRequest(int(qsl[i]), int(qsl[i + 1]), seq_len, blocks))
        return SdpaMetadata(common.num_actual_tokens, common.slot_mapping, requests)


class PagedSdpaImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: SdpaMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        n = md.num_actual_tokens  # rows past n are padding: never written to the cache
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # 1. The backend writes the cache itself: token t goes to slot slot_mapping[t], that is
        #    block slot // block_size, offset slot % block_size. (write_kv_cache does the same.)
        key_cache.view(-1, self.num_kv_heads, self.head_size)[md.slot_mapping] = key[:n]
        value_cache.view(-1, self.num_kv_heads, self.head_size)[md.slot_mapping] = value[:n]

        out = torch.zeros_like(query)  # padding rows: any value will do; zeros here
        group = self.num_heads // self.num_kv_heads  # query head h reads KV head h // group
        for r in md.requests:
            # 2. The context, in position order: the request's blocks, flattened, cut to seq_len.
            k = key_cache[r.blocks].flatten(0, 1)[: r.seq_len]  # [seq_len, num_kv_heads, d]
            v = value_cache[r.blocks].flatten(0, 1)[: r.seq_len]
            k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, d]
            v = v.repeat_interleave(group, dim=1)
            # 3. Causal over positions: query row i sits at position seq_len - q_len + i.
            q_len = r.end - r.start
            q_pos = torch.arange(r.seq_len - q_len, r.seq_len, device=query.device)
            mask = torch.arange(r.seq_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                query[r.start : r.end].transpose(0, 1),  # [num_heads, q_len, d]
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
            )
            out[r.start : r.end] = o.transpose(0, 1)
        return out
