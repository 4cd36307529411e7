"""FlashInfer's batch prefill and decode wrappers over Pagoda's paged cache (NHD layout).

Per step, ``build_metadata`` turns the block table into FlashInfer's page indices once; the first
layer plans the wrapper (FlashInfer needs the head counts and dtype, which the layers know) and
every other layer of the step reuses that plan. Steps where every request decodes one token use
the decode wrapper; any other step uses the prefill wrapper, which also handles the decodes in it.

Decode CUDA graphs: each captured batch size gets its own decode wrapper made with
``use_cuda_graph`` over fixed page-table buffers. The runner's warm-up pass before capture plans
it (so nothing is planned inside the graph); before each replay ``prepare_graph_replay`` plans it
again for the step, which rewrites those buffers and the plan the captured kernels read.
"""

from __future__ import annotations

import sys
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
_workspaces: dict[tuple[str, int | None], torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    """One float workspace per device, shared by every wrapper (one runs at a time)."""
    key = (device.type, device.index)
    if key not in _workspaces:
        _workspaces[key] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[key]


def _flashinfer() -> Any:
    """FlashInfer, with its module loads logged: a kernel compiled at first use (the engine
    waiting for it) shows in the log with its time."""
    import flashinfer

    from pagoda_attention_flashinfer.modules import log_engine_builds

    log_engine_builds()
    return flashinfer


def _wrappers_for(device: torch.device) -> dict[str, Any]:
    key = (device.type, device.index)
    if key not in _wrappers:
        flashinfer = _flashinfer()
        workspace = _workspace(device)
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
    # Graph metadata only: the batch size's own decode wrapper, and the layer-side plan inputs
    # that ``prepare_graph_replay`` plans it with again.
    wrapper: Any = None
    plan_args: tuple | None = None


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    requires = ("flashinfer",)
    priority = 100
    supports_cuda_graph = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and head_size in (64, 128, 256)
        )

    @classmethod
    def is_compiled(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        from pagoda_attention_flashinfer.warm import is_compiled

        return is_compiled(device, dtype, head_size)

    @classmethod
    def compile_command(
        cls, device: torch.device, dtype: torch.dtype, head_size: int
    ) -> list[str] | None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return [
            sys.executable,
            "-m",
            "pagoda_attention_flashinfer.warm",
            "--device",
            f"cuda:{index}",
            "--dtype",
            str(dtype).removeprefix("torch."),
            "--head-size",
            str(head_size),
        ]

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
        flat = _host(rows * width + cols).to(common.block_table.device, non_blocking=True)
        kv_indices = common.block_table.reshape(-1).index_select(0, flat)
        last = (seq_lens - (num_pages - 1) * page).astype(np.int32)
        return FlashInferMetadata(
            common=common,
            decode_only=common.max_query_len == 1,
            qo_indptr=_host(common.query_start_loc_cpu[: n + 1].astype(np.int32)),
            kv_indptr=_host(kv_indptr),
            kv_indices=kv_indices,
            kv_last_page_len=_host(last),
        )

    @classmethod
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> FlashInferMetadata:
        flashinfer = _flashinfer()
        b, width = common.num_reqs, common.block_table.shape[1]
        device = common.block_table.device
        md = cls.build_metadata(common)
        i32 = dict(dtype=torch.int32, device=device)
        if not md.decode_only:
            # NOTE: speculative verification graphs (k + 1 tokens a request) plan the prefill
            # form, which the decode wrapper does not take.
            md.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                _workspace(device),
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(b + 1, **i32),
                paged_kv_indptr_buf=torch.zeros(b + 1, **i32),
                paged_kv_indices_buf=torch.zeros(b * width, **i32),
                paged_kv_last_page_len_buf=torch.zeros(b, **i32),
            )
            return md
        md.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(device),
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(b + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(b * width, **i32),
            paged_kv_last_page_len_buffer=torch.zeros(b, **i32),
        )
        return md

    @classmethod
    def prepare_graph_replay(cls, metadata: Any, common: CommonAttentionMetadata) -> None:
        md: FlashInferMetadata = metadata
        if md.plan_args is None:
            raise RuntimeError("a FlashInfer decode graph is replayed before it was planned")
        step = cls.build_metadata(common)
        md.kv_indptr, md.kv_indices = step.kv_indptr, step.kv_indices
        md.kv_last_page_len, md.qo_indptr = step.kv_last_page_len, step.qo_indptr
        _plan(md.wrapper, md, *md.plan_args)


def _host(a: np.ndarray) -> torch.Tensor:
    """A host tensor FlashInfer may copy to the device without making the host wait."""
    t = torch.from_numpy(a)
    return t.pin_memory() if torch.cuda.is_available() else t


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
        if md.wrapper is not None:
            wrapper = md.wrapper
        else:
            wrapper = _wrappers_for(query.device)["decode" if md.decode_only else "prefill"]
        plan_key = (self.num_heads, self.num_kv_heads, self.head_size, query.dtype, self.scale)
        if md.planned_for != plan_key:  # NOTE: the first layer plans; the others reuse it.
            md.plan_args = (*plan_key, key_cache.shape[1])
            _plan(wrapper, md, *md.plan_args)
            md.planned_for = plan_key
        # NOTE: models may hand q over as a strided view of the qkv projection.
        out = wrapper.run(query[:n].contiguous(), (key_cache, value_cache))
        if n == query.shape[0]:
            return out
        full = torch.empty_like(query)
        full[:n] = out
        return full


def _plan(
    wrapper: Any,
    md: FlashInferMetadata,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    scale: float,
    page: int,
) -> None:
    common = dict(
        num_qo_heads=num_heads,
        num_kv_heads=num_kv_heads,
        page_size=page,
        q_data_type=dtype,
        kv_data_type=dtype,
        sm_scale=scale,
    )
    if md.decode_only:
        wrapper.plan(md.kv_indptr, md.kv_indices, md.kv_last_page_len, head_dim=head_size, **common)
    else:
        wrapper.plan(
            md.qo_indptr,
            md.kv_indptr,
            md.kv_indices,
            md.kv_last_page_len,
            head_dim_qk=head_size,
            causal=True,
            **common,
        )
