"""FlashInfer's batch prefill and decode wrappers over Pagoda's paged cache (NHD layout).

Per step, ``build_metadata`` turns the block table into FlashInfer's page indices once. A plan
fixes more than the step's batch: the heads, the dtype (which only the layers know), the window,
the soft-cap and the kernel variant; a model's layers may differ in those (Gemma 2 and 3 and
gpt-oss alternate windowed and full layers). Layers are therefore grouped by :class:`PlanGroup`,
the part of their :class:`~pagoda.attention.spec.AttentionSpec` a plan fixes: each group of a
step has its own wrapper in the step's metadata, planned by the group's first layer of the step
and reused by its others. A model whose layers share one group (every plain model) plans once a
step, as before. Steps where every request decodes one token use the decode wrapper; any other
step uses the prefill wrapper, which also handles the decodes in it.

What the kernels compute besides plain causal attention: sliding windows (FlashInfer's
``window_left``, inclusive: ``w - 1``), logit soft-caps and bidirectional layers are plan
parameters of both wrappers. Sinks are not: FlashInfer's FA2 and FA3 kernels ignore the ``sinks``
argument of ``run`` (only its Blackwell kernels read it), so a sink group plans
``BatchAttentionWithAttentionSinkWrapper`` (FlashInfer 0.4 on), a prefill wrapper over a
just-in-time variant that adds ``exp(sink)`` to each softmax denominator, for every kind of step:
FA2 for decodes (it splits long contexts, and counts the sink in the first split only), the
device's best for the rest. That variant has no soft-cap.

Steps of new prompts only (no cached context: every request's context is its own query tokens)
attend over the step's own keys and values, as the Triton backend's ragged kernel does:
``plugins.flashinfer.ragged_prefill`` (on by default) plans them on
``BatchPrefillWithRaggedKVCacheWrapper`` (FA3 on Hopper), which reads the step's keys and values
where the layer has them rather than through the page table. On an H200, 64 prompts of 512 tokens
(16 query and 8 KV heads of 128, causal, bf16) took 201 us there against 303 for the paged
prefill; an embedding call of 256 such prompts on Qwen3-0.6B took 260 ms against 274 (medians
of seven, interleaved in one process). Groups with sinks keep their own wrapper. The cache is
still written where later steps read these prompts from it (a step whose keys and values none
reads skips the write: ``attends_from_inputs``). A ragged wrapper is planned again only when a
step's layout of queries (or the group) differs from its last plan's.

An FP8 KV cache (``cache.kv_cache_dtype: fp8``) is not read here (``supports_kv_cache_dtype``
stays false, so ``auto`` takes Triton for one): FlashInfer 0.6's FP8 decode kernels, with a
bfloat16 query, read such a cache more slowly than its bfloat16 kernels read theirs and than the
Triton kernel reads it (220 us against 168 and 107 on an H200, Llama-3.1-8B's heads, batch 256:
``benchmarks/decode_attention_fp8.py``), and its ``run`` takes ``k_scale`` as a host float, which
a captured graph would freeze before the first prompt calibrates it.

Decode CUDA graphs: each captured batch size gets fixed page-table buffers, and each group its own
wrapper made with ``use_cuda_graph`` over them (the groups' plans write the same page table). The
runner's warm-up pass before capture makes and plans them (so nothing is planned inside the
graph); before each replay ``prepare_graph_replay`` plans every group again for the step, which
rewrites those buffers and the plans the captured kernels read.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from pagoda.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    CommonAttentionMetadata,
    write_kv_cache,
)
from pagoda.attention.spec import AttentionSpec

_WORKSPACE_BYTES = 256 << 20
# Eager (not graphed) steps' wrappers, by device and _wrapper_key: the n-th group of a step that
# needs a wrapper of a key takes the n-th, so a model needs as many as its groups, not a test
# process as many as the groups it ever saw.
_wrappers: dict[tuple, list[Any]] = {}
# Each ragged wrapper's last plan: a step whose queries' layout and group match it runs on that
# plan. A ragged plan reads only the host's indptr and the group (the run takes the step's
# tensors); planning costs the host some 1.5 ms in a step's first layer, while the device,
# started on the layer's first kernels, waits.
_ragged_plans: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
_workspaces: dict[tuple[str, int | None], torch.Tensor] = {}

# The spec's features the kernels compute; the others (chunks, a value head size of its own) they
# do not.
_FEATURES = frozenset({"causal", "sliding_window", "logit_softcap", "sinks"})


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


class PlanGroup(NamedTuple):
    """The part of a layer's spec that a FlashInfer plan fixes: the layers of a step that share
    one share its plan. (A tuple: every layer looks its group up every step.)"""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    causal: bool = True
    #: FlashInfer's: a query sees keys at most this many positions before it; -1: all.
    window_left: int = -1
    logits_soft_cap: float | None = None
    #: The sink variant, a wrapper of its own; the sink logits themselves are run arguments, so
    #: layers with different sinks share a plan.
    sinks: bool = False

    @classmethod
    def of(cls, spec: AttentionSpec) -> PlanGroup:
        window = -1 if spec.sliding_window is None else spec.sliding_window - 1
        return cls(
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_size,
            spec.scale,
            spec.causal,
            window,
            spec.logit_softcap,
            spec.sinks,
        )


@dataclass
class _GraphBuffers:
    """A captured batch size's page table, at fixed addresses: every group's wrapper of that
    graph plans into these (the same values for each) and its captured kernels read them."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


@dataclass
class _Plan:
    """One group's wrapper in one step's metadata, as planned."""

    wrapper: Any
    dtype: torch.dtype
    prefill_form: bool  # planned with the queries' indptr (prefill and sink wrappers)
    key: tuple  # the eager pool's key of the wrapper (_wrapper_key)

    @property
    def ragged(self) -> bool:
        """Planned on the ragged wrapper: run over the step's keys and values, not the cache."""
        return self.key == _RAGGED


@dataclass
class FlashInferMetadata:
    common: CommonAttentionMetadata
    decode_only: bool
    qo_indptr: torch.Tensor  # host int32
    kv_indptr: torch.Tensor  # host int32
    kv_indices: torch.Tensor  # device int32
    kv_last_page_len: torch.Tensor  # host int32
    # Each group's plan for this step, made by the group's first layer of the step.
    plans: dict[PlanGroup, _Plan] = field(default_factory=dict)
    # Graph metadata only: the batch size's fixed page-table buffers.
    graph: _GraphBuffers | None = None
    # Every request is a new prompt and the ragged path is on (``plugins.flashinfer``).
    fresh: bool = False


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    requires = ("flashinfer",)
    accepts_model_stored_kv = True  # (its forward writes through write_kv_cache alone)
    priority = 100
    supports_cuda_graph = True
    # Steps of new prompts only attend over their own keys (`plugins.flashinfer.ragged_prefill`).
    ragged_prefill = True

    @classmethod
    def configure(cls, config: Any) -> None:
        cls.ragged_prefill = config.plugin_settings("flashinfer").ragged_prefill

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and head_size in (64, 128, 256)
        )

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        features = spec.features()
        for feature in features:
            if feature not in _FEATURES:
                return feature
        if spec.sinks and spec.logit_softcap is not None:
            return "sinks"  # NOTE: the sink variant has no soft-cap
        if not spec.causal and spec.sliding_window is not None:
            # NOTE: FlashInfer's window bounds the keys on a query's left only; a bidirectional
            # layer's spans both sides.
            return "sliding_window"
        return None

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
        qsl = common.query_start_loc_cpu[: n + 1]
        return FlashInferMetadata(
            common=common,
            decode_only=common.max_query_len == 1,
            qo_indptr=_host(qsl.astype(np.int32)),
            kv_indptr=_host(kv_indptr),
            kv_indices=kv_indices,
            kv_last_page_len=_host(last),
            # (from the host copies: no device sync)
            fresh=cls.ragged_prefill
            and common.max_query_len > 1
            and n > 0
            and bool(np.array_equal(np.diff(qsl), seq_lens)),
        )

    @classmethod
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> FlashInferMetadata:
        b, width = common.num_reqs, common.block_table.shape[1]
        i32 = dict(dtype=torch.int32, device=common.block_table.device)
        md = cls.build_metadata(common)
        # NOTE: the wrappers come with the warm-up forward, where each group's first layer
        # knows the dtype (the sink variant is built for one); they plan into these buffers.
        # Speculative verification graphs (k + 1 tokens a request) plan the prefill form, which
        # reads the queries' indptr; decode graphs too for a sink group.
        md.graph = _GraphBuffers(
            qo_indptr=torch.zeros(b + 1, **i32),
            kv_indptr=torch.zeros(b + 1, **i32),
            kv_indices=torch.zeros(b * width, **i32),
            kv_last_page_len=torch.zeros(b, **i32),
        )
        return md

    @classmethod
    def prepare_graph_replay(cls, metadata: Any, common: CommonAttentionMetadata) -> None:
        md: FlashInferMetadata = metadata
        if not md.plans:
            raise RuntimeError("a FlashInfer decode graph is replayed before it was planned")
        step = cls.build_metadata(common)
        md.kv_indptr, md.kv_indices = step.kv_indptr, step.kv_indices
        md.kv_last_page_len, md.qo_indptr = step.kv_last_page_len, step.qo_indptr
        for group, plan in md.plans.items():  # every group the captured layers run
            _plan(plan, md, group)


def _host(a: np.ndarray) -> torch.Tensor:
    """A host tensor FlashInfer may copy to the device without making the host wait."""
    t = torch.from_numpy(a)
    return t.pin_memory() if torch.cuda.is_available() else t


class FlashInferImpl(AttentionImpl):
    @property
    def spec(self) -> AttentionSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: AttentionSpec) -> None:
        # NOTE: the kernels would not refuse a field they ignore; they would compute something
        # else. The layer checks too; this catches an impl given a spec directly.
        missing = FlashInferBackend.unsupported(spec)
        if missing is not None:
            raise ValueError(f"the flashinfer attention backend does not support {missing}")
        self._spec = spec
        self._group = PlanGroup.of(spec)

    def attends_from_inputs(self, kv_cache: torch.Tensor, attn_metadata: Any) -> bool:
        # The ragged wrapper's steps (``_wrapper_key``): over the keys and values as given.
        return attn_metadata.fresh and not self._group.sinks

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
        plan = md.plans.get(self._group)
        if plan is None or plan.dtype != query.dtype:
            # NOTE: the group's first layer of the step plans; its others reuse the plan.
            plan = _plan_group(md, self._group, query.dtype, query.device)
        # NOTE: the kernels write into ``out`` (its first n rows; the rest are padding): left
        # to allocate it, the paged prefill wrapper zero-fills a tensor of its own (4.5 ms of an
        # H200's embedding call of 256 x 512 tokens) that a copy then pads.
        out = torch.empty_like(query)
        if plan.ragged:
            # The step's own queries, keys and values (each request's rows), as the layer has
            # them: the kernels take their token and head strides (views of the qkv projection
            # are fine: a copy of the queries would read and write them again every layer).
            plan.wrapper.run(query[:n], key[:n], value[:n], out=out[:n])
            return out
        # NOTE: models may hand q over as a strided view of the qkv projection.
        q = query[:n].contiguous()
        if self._group.sinks:
            if self.sinks is None:
                raise ValueError("an attention spec with sinks needs impl.sinks, [num_heads]")
            # NOTE: the variant reads fp32 sink logits, and takes its scale here, not from the
            # plan. Cast every step (a [num_heads] kernel, captured in graphs): a cached copy
            # would miss weights reloaded in place.
            sinks = self.sinks.float()
            plan.wrapper.run(q, (key_cache, value_cache), sinks, self.scale, out=out[:n])
        else:
            plan.wrapper.run(q, (key_cache, value_cache), out=out[:n])
        return out


_RAGGED = ("ragged",)


def _wrapper_key(
    group: PlanGroup, dtype: torch.dtype, decode_only: bool, fresh: bool = False
) -> tuple:
    """What a wrapper is made for; a wrapper plans any group of its key. The plain wrappers
    take everything at plan time; the sink variant is compiled for a dtype, head size and
    whether there is a window. A step of new prompts (``fresh``) takes the ragged wrapper,
    unless the group has sinks."""
    if fresh and not group.sinks:
        return _RAGGED
    if group.sinks:
        return ("sinks", decode_only, dtype, group.head_size, group.window_left >= 0)
    return ("decode",) if decode_only else ("prefill",)


def _new_wrapper(key: tuple, device: torch.device, graph: _GraphBuffers | None) -> Any:
    flashinfer = _flashinfer()
    workspace = _workspace(device)
    prefill_bufs: dict[str, Any] = {}
    if graph is not None:
        prefill_bufs = dict(
            use_cuda_graph=True,
            qo_indptr_buf=graph.qo_indptr,
            paged_kv_indptr_buf=graph.kv_indptr,
            paged_kv_indices_buf=graph.kv_indices,
            paged_kv_last_page_len_buf=graph.kv_last_page_len,
        )
    if key[0] == "sinks":
        _, decode_only, dtype, head_size, windowed = key
        sink_wrapper = getattr(flashinfer, "BatchAttentionWithAttentionSinkWrapper", None)
        if sink_wrapper is None:
            raise RuntimeError("attention sinks need FlashInfer 0.4 or later")
        return sink_wrapper(
            workspace,
            "NHD",
            # NOTE: FA3 (the device's best on Hopper) does not split a context over several
            # programs; a decode step's few queries over long contexts need that.
            backend="fa2" if decode_only else "auto",
            q_data_type=dtype,
            kv_data_type=dtype,
            head_dim_qk=head_size,
            head_dim_vo=head_size,
            # NOTE: only whether there is one is compiled in; its size is the plan's.
            window_left=0 if windowed else -1,
            **prefill_bufs,
        )
    if key == _RAGGED:  # (never graphed: graphs hold decode and verification steps)
        return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    if key[0] == "decode":
        decode_bufs: dict[str, Any] = {}
        if graph is not None:
            decode_bufs = dict(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=graph.kv_indptr,
                paged_kv_indices_buffer=graph.kv_indices,
                paged_kv_last_page_len_buffer=graph.kv_last_page_len,
            )
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=True, **decode_bufs
        )
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", **prefill_bufs)


def _plan_group(
    md: FlashInferMetadata, group: PlanGroup, dtype: torch.dtype, device: torch.device
) -> _Plan:
    """Give ``group`` a wrapper in ``md`` and plan it for the step."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "FlashInfer plans outside CUDA graphs: run a forward over the graph's metadata "
            "before capturing it"
        )
    md.plans.pop(group, None)
    key = _wrapper_key(group, dtype, md.decode_only, md.fresh and md.graph is None)
    if md.graph is not None:  # NOTE: a graph's wrappers are its own: its kernels read them.
        wrapper = _new_wrapper(key, device, md.graph)
    else:
        pool = _wrappers.setdefault((device.type, device.index, *key), [])
        taken = sum(p.key == key for p in md.plans.values())
        if taken == len(pool):
            pool.append(_new_wrapper(key, device, None))
        wrapper = pool[taken]
    plan = _Plan(wrapper, dtype, prefill_form=group.sinks or not md.decode_only, key=key)
    _plan(plan, md, group)
    md.plans[group] = plan
    return plan


def _plan(plan: _Plan, md: FlashInferMetadata, group: PlanGroup) -> None:
    common = dict(
        num_qo_heads=group.num_heads,
        num_kv_heads=group.num_kv_heads,
        page_size=md.common.block_size,
        q_data_type=plan.dtype,
        kv_data_type=plan.dtype,
        sm_scale=group.scale,
        window_left=group.window_left,
        logits_soft_cap=group.logits_soft_cap,
    )
    if plan.ragged:
        del common["page_size"]
        c = md.common
        planned = (
            c.query_start_loc_cpu[: c.num_reqs + 1].tobytes(),
            group.head_size,
            group.causal,
            *sorted(common.items()),
        )
        if _ragged_plans.get(plan.wrapper) == planned:
            return
        _ragged_plans.pop(plan.wrapper, None)  # (a plan that fails leaves none behind)
        plan.wrapper.plan(
            md.qo_indptr,
            md.qo_indptr,  # each request's keys are its own queries' rows
            head_dim_qk=group.head_size,
            causal=group.causal,
            **common,
        )
        _ragged_plans[plan.wrapper] = planned
    elif plan.prefill_form:
        plan.wrapper.plan(
            md.qo_indptr,
            md.kv_indptr,
            md.kv_indices,
            md.kv_last_page_len,
            head_dim_qk=group.head_size,
            causal=group.causal,
            **common,
        )
    else:
        plan.wrapper.plan(
            md.kv_indptr, md.kv_indices, md.kv_last_page_len, head_dim=group.head_size, **common
        )
