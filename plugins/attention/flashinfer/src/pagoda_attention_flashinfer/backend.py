"""FlashInfer's batch prefill and decode wrappers over Pagoda's paged cache (NHD layout).

Per step, ``build_metadata`` turns the block table into FlashInfer's page indices once; the first
layer plans the wrapper (FlashInfer needs the head counts and dtype, which the layers know) and
every other layer of the step reuses that plan. Steps where every request decodes one token use
the decode wrapper; any other step uses the prefill wrapper, which also handles the decodes in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagoda.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    CommonAttentionMetadata,
    write_kv_cache,
)

_WORKSPACE_BYTES = 256 << 20
_wrappers: dict[tuple[str, int | None], dict[str, Any]] = {}


def _wrappers_for(device: torch.device) -> dict[str, Any]:
    key = (device.type, device.index)
    if key not in _wrappers:
        import flashinfer

        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _wrappers[key] = {
            "prefill": flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"),
            "decode": flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=True
            ),
        }
    return _wrappers[key]


@dataclass
class FlashInferMetadata:
    common: CommonAttentionMetadata
    decode_only: bool
    qo_indptr: torch.Tensor  # host int32
    kv_indptr: torch.Tensor  # host int32
    kv_indices: torch.Tensor  # device int32
    kv_last_page_len: torch.Tensor  # host int32
    planned_for: tuple | None = field(default=None)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    priority = 100

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and head_size in (64, 128, 256)
        )

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return FlashInferImpl

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> FlashInferMetadata:
        n = common.num_reqs
        page = common.block_size
        seq_lens = common.seq_lens_cpu[:n].astype(np.int64)
        num_pages = -(-seq_lens // page)
        kv_indptr = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(num_pages, out=kv_indptr[1:])
        # Flat positions of each request's pages in the (padded) block table, gathered on the
        # device without a host round trip.
        width = common.block_table.shape[1]
        rows = np.repeat(np.arange(n), num_pages)
        cols = np.arange(int(kv_indptr[-1])) - np.repeat(kv_indptr[:-1], num_pages)
        flat = torch.from_numpy(rows * width + cols).to(
            common.block_table.device, non_blocking=True
        )
        kv_indices = common.block_table.reshape(-1).index_select(0, flat)
        last = (seq_lens - (num_pages - 1) * page).astype(np.int32)
        return FlashInferMetadata(
            common=common,
            decode_only=common.max_query_len == 1,
            qo_indptr=torch.from_numpy(common.query_start_loc_cpu[: n + 1].astype(np.int32)),
            kv_indptr=torch.from_numpy(kv_indptr),
            kv_indices=kv_indices,
            kv_last_page_len=torch.from_numpy(last),
        )


class FlashInferImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        c = md.common
        n = c.num_actual_tokens
        key_cache, value_cache = write_kv_cache(key, value, kv_cache, c.slot_mapping, n)
        wrappers = _wrappers_for(query.device)
        wrapper = wrappers["decode" if md.decode_only else "prefill"]
        plan_key = (self.num_heads, self.num_kv_heads, self.head_size, query.dtype, self.scale)
        if md.planned_for != plan_key:  # NOTE: the first layer plans; the others reuse it.
            self._plan(wrapper, md, query.dtype, key_cache.shape[1])
            md.planned_for = plan_key
        out = wrapper.run(query[:n], (key_cache, value_cache))
        if n == query.shape[0]:
            return out
        full = torch.empty_like(query)
        full[:n] = out
        return full

    def _plan(self, wrapper: Any, md: FlashInferMetadata, dtype: torch.dtype, page: int) -> None:
        common = dict(
            num_qo_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            page_size=page,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=self.scale,
        )
        if md.decode_only:
            wrapper.plan(
                md.kv_indptr,
                md.kv_indices,
                md.kv_last_page_len,
                head_dim=self.head_size,
                **common,
            )
        else:
            wrapper.plan(
                md.qo_indptr,
                md.kv_indptr,
                md.kv_indices,
                md.kv_last_page_len,
                head_dim_qk=self.head_size,
                causal=True,
                **common,
            )
