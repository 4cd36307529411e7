"""FlashInfer's plan groups: a model whose layers differ in what a plan fixes (a window, a soft-cap,
sinks) plans each group once a step, eagerly and in decode CUDA graphs, and each layer attends
with its own group's plan.

A model-like mix (Gemma's windowed and soft-capped layers between full ones; gpt-oss's windowed
and full layers, all with sinks) runs eager steps (prefill, mixed, decode) and graph steps (decode
and speculative verification: ``build_graph_metadata``, a warm-up forward, capture, then
``prepare_graph_replay`` and a replay per step), every layer's output against the float64
reference. On a GPU it runs FlashInfer itself (the ``cuda`` cases, the GPU tier). Everywhere it
also runs against a stand-in for FlashInfer's three wrappers that computes what FlashInfer
documents (``window_left`` inclusive, ``c * tanh(x / c)``, fp32 sinks read only by the sink
wrapper, whose scale is a run argument), in float32: that checks the backend's side (page tables,
groups, plan and run arguments, graph buffers), the conformance kit's cases included; whether
FlashInfer's kernels do as documented is the GPU's to say.
"""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from pagoda_attention_flashinfer import backend
from pagoda_attention_flashinfer.backend import FlashInferBackend, FlashInferImpl, PlanGroup

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.spec import AttentionSpec
from pagoda.testing import attention_cases, check_attention_backend, reference_attention
from pagoda.testing.attention import DEFAULT_TOLERANCES

# ---- a stand-in for FlashInfer's wrappers -------------------------------------------------------


class _Wrapper:
    """What FlashInfer's paged wrappers keep between ``plan`` and ``run``, with their checks: in
    graph mode the page table is copied into the buffers given at construction (a fixed batch
    size, indices no longer than the buffer) and ``run`` reads it back from them."""

    made: list[_Wrapper] = []

    def _init(self, workspace: torch.Tensor, kv_layout: str, graph: bool, bufs: tuple) -> None:
        assert kv_layout == "NHD"
        assert workspace.dtype == torch.uint8
        self.graph, self.bufs = graph, bufs
        if graph:
            assert all(isinstance(t, torch.Tensor) for t in bufs[1:]), bufs
            self.batch = len(bufs[3])
        self.plans: list[dict[str, Any]] = []
        _Wrapper.made.append(self)

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last, **p: Any) -> None:
        tables = [qo_indptr, kv_indptr, kv_indices, last]
        if self.graph:
            assert len(kv_indptr) - 1 == self.batch, "the batch size of a graph is fixed"
            assert len(kv_indices) <= len(self.bufs[2]), "indices past the buffer"
            for buf, t in zip(self.bufs, tables):
                if buf is not None and t is not None:
                    buf[: len(t)].copy_(t)
        self.tables = tables
        self.plans.append(p)

    def _tables(self) -> tuple[list[int], list[int], torch.Tensor, list[int]]:
        qo, kv_indptr, kv_indices, last = self.tables
        if self.graph:  # what the captured kernels read
            qo = self.bufs[0] if self.bufs[0] is not None else qo
            kv_indptr, kv_indices, last = self.bufs[1], self.bufs[2], self.bufs[3]
        n = len(last)
        qo = list(range(n + 1)) if qo is None else qo.tolist()[: n + 1]
        return qo, kv_indptr.tolist(), kv_indices, last.tolist()

    def _attend(self, q: torch.Tensor, kv: tuple, scale: float, sinks=None) -> torch.Tensor:
        p = self.plans[-1]
        k_cache, v_cache = kv
        assert q.dtype == p["q_data_type"] and k_cache.dtype == p["kv_data_type"]
        h, h_kv, d = p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]
        assert q.shape[1:] == (h, d) and k_cache.shape[1:] == (p["page_size"], h_kv, d)
        qo, kv_indptr, kv_indices, last = self._tables()
        assert q.shape[0] == qo[-1], (q.shape, qo)
        out = torch.empty_like(q)
        for i in range(len(last)):
            pages = kv_indices[kv_indptr[i] : kv_indptr[i + 1]].long()
            kv_len = (len(pages) - 1) * p["page_size"] + last[i]
            k = k_cache[pages].flatten(0, 1)[:kv_len]
            v = v_cache[pages].flatten(0, 1)[:kv_len]
            out[qo[i] : qo[i + 1]] = _attend_rows(q[qo[i] : qo[i + 1]], k, v, scale, p, sinks)
        return out


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """As FlashInfer's ``run``: the result written into ``out`` where one is given (its shape,
    dtype and device checked), which is returned; else a tensor of its own."""
    if out is None:
        return result
    assert out.shape == result.shape and out.dtype == result.dtype and out.device == result.device
    assert out.is_contiguous(), "FlashInfer writes its output rows contiguously"
    return out.copy_(result)


def _attend_rows(q, k, v, scale: float, p: dict[str, Any], sinks=None) -> torch.Tensor:
    """One request's attention, its query rows ``q`` over its keys ``k`` and values ``v``, as
    the plan ``p`` asks (:func:`_probs`), in float32, returned in ``q``'s dtype."""
    group = p["num_qo_heads"] // p["num_kv_heads"]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    probs = _probs(torch.einsum("qhd,khd->hqk", q.float(), k) * scale, p, sinks)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _probs(logits: torch.Tensor, p: dict[str, Any], sinks=None) -> torch.Tensor:
    """Attention probabilities from scaled ``logits`` [heads, rows, keys] as the plan ``p``
    asks (soft-cap, causal, inclusive left window; a query's row is its place among the last
    rows of the keys), with ``sinks`` in each denominator when given."""
    cap, window = p["logits_soft_cap"], p["window_left"]
    rows, keys = logits.shape[1], logits.shape[2]
    if cap:
        logits = cap * torch.tanh(logits / cap)
    pos = torch.arange(keys - rows, keys, device=logits.device)[:, None]
    j = torch.arange(keys, device=logits.device)[None, :]
    seen = j <= pos if p["causal"] else torch.ones_like(pos - j, dtype=torch.bool)
    if window >= 0:
        seen &= pos - j <= window
    logits = logits.masked_fill(~seen, float("-inf"))
    if sinks is None:
        return logits.softmax(-1)
    sink = sinks[:, None, None].expand(-1, rows, 1)
    return torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]


class FakePrefill(_Wrapper):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
    ) -> None:
        bufs = (
            qo_indptr_buf,
            paged_kv_indptr_buf,
            paged_kv_indices_buf,
            paged_kv_last_page_len_buf,
        )
        self._init(float_workspace_buffer, kv_layout, use_cuda_graph, bufs)
        if use_cuda_graph:
            assert isinstance(qo_indptr_buf, torch.Tensor)
        self.backend = backend

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        sm_scale=None,
        window_left=-1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
    ) -> None:
        self._plan(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim_qk,
            page_size=page_size,
            causal=causal,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
        )

    def run(self, q, paged_kv_cache, *args, sinks=None, out=None, **kwargs) -> torch.Tensor:
        # NOTE: as FlashInfer's FA2 and FA3 kernels do: ``sinks`` is not read.
        assert not args, "the plain kernels take no extra arguments"
        return _into(out, self._attend(q, paged_kv_cache, self.plans[-1]["sm_scale"]))


class FakeSinkPrefill(FakePrefill):
    """``BatchAttentionWithAttentionSinkWrapper``: compiled for a dtype, head size and whether
    there is a window; ``run(q, kv, sinks, sm_scale)``; no soft-cap."""

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        head_dim_qk=128,
        head_dim_vo=128,
        window_left=-1,
    ) -> None:
        assert backend in ("fa2", "fa3", "auto")
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            qo_indptr_buf,
            paged_kv_indptr_buf,
            paged_kv_indices_buf,
            paged_kv_last_page_len_buf,
            backend=backend,
        )
        self.compiled = (q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left >= 0)

    def plan(self, *args, **kwargs) -> None:
        super().plan(*args, **kwargs)
        p = self.plans[-1]
        dtype, kv_dtype, d, dv, windowed = self.compiled
        assert (p["q_data_type"], p["kv_data_type"], p["head_dim"]) == (dtype, kv_dtype, d)
        assert dv == d and windowed == (p["window_left"] >= 0), "planned past what was compiled"
        assert not p["logits_soft_cap"], "the sink variant has no soft-cap"

    def run(self, q, paged_kv_cache, *args, out=None, **kwargs) -> torch.Tensor:
        sinks, scale = args  # the variant's tensor and scalar, in that order
        assert sinks.dtype == torch.float32 and sinks.shape == (self.plans[-1]["num_qo_heads"],)
        return _into(out, self._attend(q, paged_kv_cache, scale, sinks))


class FakeDecode(_Wrapper):
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
        jit_args=None,
    ) -> None:
        bufs = (
            None,
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )
        self._init(float_workspace_buffer, kv_layout, use_cuda_graph, bufs)
        self.backend = backend

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        non_blocking=True,
    ) -> None:
        self._plan(
            None,
            indptr,
            indices,
            last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            causal=False,  # one query a request: it sees every key
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
        )

    def run(self, q, paged_kv_cache, *args, sinks=None, out=None, **kwargs) -> torch.Tensor:
        assert not args, "the plain kernels take no extra arguments"
        return _into(out, self._attend(q, paged_kv_cache, self.plans[-1]["sm_scale"]))


class FakeRagged(_Wrapper):
    """``BatchPrefillWithRaggedKVCacheWrapper``: each request's keys and values are rows of the
    ``k`` and ``v`` given to ``run`` (``kv_indptr``), not pages of a cache."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **kw):
        assert not use_cuda_graph, "the backend never graphs the ragged wrapper"
        self._init(float_workspace_buffer, kv_layout, False, ())

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        window_left=-1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
    ) -> None:
        self._plan(
            qo_indptr,
            kv_indptr,
            None,  # (no pages)
            None,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim_qk,
            causal=causal,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type or q_data_type,
        )

    def run(self, q, k, v, *args, out=None, **kwargs) -> torch.Tensor:
        assert not args, "the plain kernels take no extra arguments"
        p = self.plans[-1]
        assert q.dtype == p["q_data_type"] and k.dtype == v.dtype == p["kv_data_type"]
        qo, kv = (t.tolist() for t in self.tables[:2])
        assert q.shape[0] == qo[-1] and k.shape[0] == v.shape[0] == kv[-1]
        rows = torch.empty_like(q)
        for i in range(len(qo) - 1):
            keys, vals = k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]]
            rows[qo[i] : qo[i + 1]] = _attend_rows(
                q[qo[i] : qo[i + 1]], keys, vals, p["sm_scale"], p
            )
        return _into(out, rows)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[_Wrapper]:
    """The stand-in as ``flashinfer``, the backend's wrappers and workspaces reset around it;
    returns the list of every wrapper it makes, in order."""
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    fi.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    fi.BatchAttentionWithAttentionSinkWrapper = FakeSinkPrefill
    fi.BatchPrefillWithRaggedKVCacheWrapper = FakeRagged
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setattr(backend, "_wrappers", {})
    monkeypatch.setattr(backend, "_workspaces", {})
    monkeypatch.setattr(backend, "_WORKSPACE_BYTES", 1024)
    made: list[_Wrapper] = []
    monkeypatch.setattr(_Wrapper, "made", made)
    return made


# ---- what the backend takes ---------------------------------------------------------------------

PLAIN = AttentionSpec(8, 2, 64, 64**-0.5)


@pytest.mark.parametrize(
    ("fields", "missing"),
    [
        ({}, None),
        ({"sliding_window": 7}, None),
        ({"logit_softcap": 30.0}, None),
        ({"sinks": True}, None),
        ({"causal": False}, None),
        ({"sliding_window": 7, "logit_softcap": 30.0}, None),
        ({"sliding_window": 128, "sinks": True}, None),
        ({"sinks": True, "logit_softcap": 30.0}, "sinks"),  # the sink variant has no soft-cap
        ({"causal": False, "sliding_window": 7}, "sliding_window"),  # left-only windows
        ({"chunk_size": 12}, "chunk_size"),
        ({"value_head_size": 32}, "value_head_size"),
    ],
)
def test_unsupported_names_what_the_kernels_do_not_compute(fields, missing) -> None:
    spec = replace(PLAIN, **fields)
    assert FlashInferBackend.unsupported(spec) == missing
    impl = FlashInferImpl(8, 64, PLAIN.scale, 2)
    if missing is None:
        impl.spec = spec
        assert impl.spec is spec
    else:  # an impl handed a spec directly refuses it too, rather than computing something else
        with pytest.raises(ValueError, match=missing):
            impl.spec = spec


def test_a_plan_group_is_what_a_plan_fixes() -> None:
    spec = replace(PLAIN, sliding_window=7, logit_softcap=2.0)
    assert PlanGroup.of(PLAIN) == PlanGroup(8, 2, 64, PLAIN.scale)
    assert PlanGroup.of(spec).window_left == 6  # FlashInfer's window is inclusive
    assert PlanGroup.of(spec).logits_soft_cap == 2.0
    # Sink layers plan the sink variant: a group of their own, whose sink logits are run
    # arguments (every sink layer of a model shares the plan).
    assert PlanGroup.of(replace(PLAIN, sinks=True)) != PlanGroup.of(PLAIN)


@pytest.mark.parametrize(
    "case",
    [c for c in attention_cases() if FlashInferBackend.unsupported(c.spec) is None],
    ids=lambda c: c.name,
)
def test_conformance_cases_against_the_stand_in(stand_in, case) -> None:
    check_attention_backend(FlashInferBackend, case, "cpu", torch.float32)


# ---- a model-like mix ---------------------------------------------------------------------------

BS, WIDTH = 16, 4  # block size; blocks a request in the graph steps (contexts up to 64 tokens)
# Logits of 0.5 * q . k over 64 dimensions run far past a soft-cap of 2, and windows of 7 are
# shorter than every context and not block-aligned: a layer planned as another fails.
SCALE = 0.5
GEMMA_WINDOW = AttentionSpec(8, 2, 64, SCALE, sliding_window=7, logit_softcap=2.0)
GEMMA_FULL = AttentionSpec(8, 2, 64, SCALE)
OSS_WINDOW = AttentionSpec(8, 2, 64, 64**-0.5, sliding_window=7, sinks=True)
OSS_FULL = AttentionSpec(8, 2, 64, 64**-0.5, sinks=True)
MIXES = {
    # alternating as the models do, two layers of each: a later layer of a group reuses the plan
    "gemma": [GEMMA_WINDOW, GEMMA_FULL, GEMMA_WINDOW, GEMMA_FULL],
    "gpt-oss": [OSS_WINDOW, OSS_FULL, OSS_WINDOW, OSS_FULL],
}


@pytest.fixture(
    params=[
        "stand-in",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ]
)
def where(request: pytest.FixtureRequest) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) to run on: the stand-in on the CPU in float32, or FlashInfer on CUDA in
    bfloat16 (the engine's dtype on a GPU)."""
    if request.param == "stand-in":
        request.getfixturevalue("stand_in")
        return torch.device("cpu"), torch.float32
    pytest.importorskip("flashinfer")
    return torch.device("cuda"), torch.bfloat16


class Model:
    """Layers of ``specs`` over one paged layout: each layer its impl, its cache (random where
    nothing was written, as a reused cache is), its sink logits, and random queries, keys and
    values for every position of every request (exactly representable in ``dtype``)."""

    def __init__(
        self,
        specs: list[AttentionSpec],
        max_lens: list[int],
        device: torch.device,
        dtype: torch.dtype,
        width: int,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.specs, self.device, self.dtype, self.width = specs, device, dtype, width

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).double()

        own = [-(-n // BS) for n in max_lens]
        assert max(own) <= width
        num_blocks = 1 + sum(own) + 2  # block 0 is the null block
        ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
        self.tables = [ids[sum(own[:r]) : sum(own[: r + 1])] for r in range(len(own))]
        self.impls, self.caches, self.sinks, self.qkv = [], [], [], []
        for spec in specs:
            impl = FlashInferImpl(spec.num_heads, spec.head_size, spec.scale, spec.num_kv_heads)
            impl.spec = spec  # as the layer does
            sinks = (rand(spec.num_heads) + 3).to(dtype).double() if spec.sinks else None
            if sinks is not None:
                impl.sinks = sinks.to(dtype).to(device)
            shape = FlashInferBackend.get_kv_cache_shape(
                num_blocks, BS, spec.num_kv_heads, spec.head_size
            )
            self.impls.append(impl)
            self.caches.append(torch.randn(shape, generator=gen).to(dtype).to(device))
            self.sinks.append(sinks)
            self.qkv.append(
                [
                    (
                        rand(n, spec.num_heads, spec.head_size),
                        rand(n, spec.num_kv_heads, spec.head_size),
                        rand(n, spec.num_kv_heads, spec.head_size),
                    )
                    for n in max_lens
                ]
            )

    def inputs(self, layer: int, step: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """The layer's q, k, v for ``step`` ((request, first, end) each), flat, on the device."""
        return [
            torch.cat([self.qkv[layer][r][i][s:e] for r, s, e in step])
            .to(self.dtype)
            .to(self.device)
            for i in range(3)
        ]

    def reference(self, layer: int, step: list[tuple[int, int, int]]) -> torch.Tensor:
        spec, qkv = self.specs[layer], self.qkv[layer]
        return torch.cat(
            [
                reference_attention(
                    qkv[r][0][s:e],
                    qkv[r][1][:e],
                    qkv[r][2][:e],
                    s,
                    spec.scale,
                    causal=spec.causal,
                    sliding_window=spec.sliding_window,
                    logit_softcap=spec.logit_softcap,
                    sinks=self.sinks[layer],
                )
                for r, s, e in step
            ]
        )

    def write_context(self, r: int, end: int) -> None:
        """Put request ``r``'s keys and values before ``end`` in every layer's cache, as earlier
        steps would have."""
        pos = np.arange(end)
        slots = torch.tensor(np.array(self.tables[r])[pos // BS] * BS + pos % BS)
        for layer, cache in enumerate(self.caches):
            _, k, v = self.qkv[layer][r]
            for i, x in ((0, k), (1, v)):
                rows = cache[i].view(-1, *cache.shape[-2:])
                rows[slots.to(self.device)] = x[:end].to(self.dtype).to(self.device)

    def common(self, step: list[tuple[int, int, int]]) -> CommonAttentionMetadata:
        q_lens = np.array([e - s for _, s, e in step])
        seq_lens = np.array([e for _, _, e in step])
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        table = np.zeros((len(step), self.width), dtype=np.int32)
        for i, (r, _, _) in enumerate(step):
            table[i, : len(self.tables[r])] = self.tables[r]
        pos = np.concatenate([np.arange(s, e) for _, s, e in step])
        rows = np.repeat(np.arange(len(step)), q_lens)
        slots = table[rows, pos // BS].astype(np.int64) * BS + pos % BS

        def dev(a: np.ndarray, dt: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a).to(device=self.device, dtype=dt)

        return CommonAttentionMetadata(
            num_reqs=len(step),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            block_table=dev(table, torch.int32),
            slot_mapping=dev(slots, torch.int64),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_size=BS,
        )


def _groups(specs: list[AttentionSpec]) -> set[PlanGroup]:
    return {PlanGroup.of(s) for s in specs}


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = DEFAULT_TOLERANCES[dtype]
    torch.testing.assert_close(
        out.double().cpu(), ref, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


# A prefill step (prompts shorter and longer than a block), a mixed step (a decode, a chunked
# prefill that continues, a new prompt), a decode step (the decode wrapper's).
EAGER_STEPS = [
    [(0, 0, 5), (1, 0, 17), (2, 0, 40)],
    [(0, 5, 6), (1, 17, 30), (3, 0, 9)],
    [(0, 6, 7), (1, 30, 31), (2, 40, 41), (3, 9, 10)],
]


def _run_layers(model: Model, step: list, md: Any, dtype: torch.dtype, what: str) -> None:
    """Every layer of ``model`` over ``step`` (its metadata ``md``), each checked against the
    reference."""
    with torch.inference_mode():
        for layer, (impl, cache) in enumerate(zip(model.impls, model.caches)):
            out = impl.forward(*model.inputs(layer, step), cache, md)
            _check(out, model.reference(layer, step), dtype, f"{what} layer {layer}")


@pytest.mark.parametrize("mix", list(MIXES))
def test_a_mix_of_layers_plans_each_group_once_a_step(where, mix: str) -> None:
    device, dtype = where
    specs = MIXES[mix]
    model = Model(specs, [7, 31, 41, 10], device, dtype, width=8)
    for i, step in enumerate(EAGER_STEPS):
        md = FlashInferBackend.build_metadata(model.common(step))
        _run_layers(model, step, md, dtype, f"{mix} step {i}")
        assert set(md.plans) == _groups(specs)


@pytest.mark.parametrize("mix", [*MIXES, "plain"])
def test_steps_of_new_prompts_take_the_ragged_wrapper_when_asked(
    where, mix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``plugins.flashinfer.ragged_prefill``: a step of new prompts only attends over the step's
    # own keys (every plain group; sink groups keep their wrapper); a step with cached context
    # does not; every layer's output stays the reference's, and the cache is still written.
    device, dtype = where
    monkeypatch.setattr(FlashInferBackend, "ragged_prefill", True)
    specs = MIXES.get(mix, [PLAIN, PLAIN])
    model = Model(specs, [7, 31, 41, 10], device, dtype, width=8)
    kinds = []
    for i, step in enumerate(EAGER_STEPS[:2]):
        md = FlashInferBackend.build_metadata(model.common(step))
        assert md.fresh == (i == 0)
        _run_layers(model, step, md, dtype, f"{mix} step {i}")
        kinds.append({g.sinks: p.ragged for g, p in md.plans.items()})
    # The first step's plain groups ragged, sink groups not; the second step's none.
    assert kinds[0] == {s.sinks: not s.sinks for s in specs}
    assert not any(kinds[1].values())
    # The second step (a decode and a chunk after cached context, and a new prompt) read the
    # first step's keys from the cache: a ragged step that skipped the write fails above.


def test_a_ragged_wrapper_plans_again_only_for_another_layout(
    stand_in, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step of new prompts laid out as the wrapper's last plan runs on it (planning costs the
    # host's time while the device waits); another layout, or another group, plans again, and
    # every output stays the reference's.
    monkeypatch.setattr(FlashInferBackend, "ragged_prefill", True)
    specs = [PLAIN, AttentionSpec(8, 2, 64, 0.5 * 64**-0.5)]  # two groups: two wrappers
    model = Model(specs, [7, 31, 41, 10], torch.device("cpu"), torch.float32, width=8)
    same = [(0, 0, 5), (1, 0, 17)]
    steps = [same, same, [(2, 0, 17), (3, 0, 5)], same]
    plans_made = []
    for i, step in enumerate(steps):
        md = FlashInferBackend.build_metadata(model.common(step))
        _run_layers(model, step, md, torch.float32, f"step {i}")
        plans_made.append([len(w.plans) for w in stand_in])
    assert all(type(w) is FakeRagged for w in stand_in) and len(stand_in) == 2
    # (a plan per wrapper and group: the second step none, the third and fourth one each)
    assert plans_made == [[1, 1], [1, 1], [2, 2], [3, 3]]


@pytest.mark.parametrize("setting", [None, "false"], ids=["default", "off"])
def test_the_ragged_path_is_on_unless_the_setting_turns_it_off(
    stand_in, setting: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plugins.flashinfer.ragged_prefill``, as an engine's configuration gives it: on by
    default (a step of new prompts plans the ragged wrapper), off keeps it on the paged one."""
    from pagoda.config import EngineConfig

    monkeypatch.setattr(FlashInferBackend, "ragged_prefill", setting is not None)
    if setting is not None:
        monkeypatch.setenv("PAGODA_PLUGINS__FLASHINFER__RAGGED_PREFILL", setting)
    FlashInferBackend.configure(EngineConfig.load(None).attention)
    assert FlashInferBackend.ragged_prefill is (setting is None)
    model = Model([PLAIN], [7, 31, 41, 10], torch.device("cpu"), torch.float32, width=8)
    md = FlashInferBackend.build_metadata(model.common(EAGER_STEPS[0]))
    assert md.fresh is (setting is None)
    impl, cache = model.impls[0], model.caches[0]
    impl.forward(*model.inputs(0, EAGER_STEPS[0]), cache, md)
    assert [type(w) for w in stand_in] == [FakeRagged if setting is None else FakePrefill]


@pytest.mark.parametrize("ragged", [False, True], ids=["paged", "ragged"])
def test_the_kernels_write_into_the_layer_output(
    stand_in, ragged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every wrapper's run gets the layer's output rows (``out=``), which the layer returns:
    FlashInfer's paged prefill, given none, zero-fills a tensor of its own every layer."""
    monkeypatch.setattr(FlashInferBackend, "ragged_prefill", ragged)
    given: list[int] = []
    for cls in (FakePrefill, FakeSinkPrefill, FakeDecode, FakeRagged):

        def run(self, *args, _run=cls.run, out=None, **kwargs):
            assert out is not None, f"{type(self).__name__}.run without out="
            given.append(out.data_ptr())
            return _run(self, *args, out=out, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    specs = [*MIXES["gpt-oss"][:2], PLAIN]  # sink layers, and plain ones (prefill, decode)
    model = Model(specs, [7, 31, 41, 10], torch.device("cpu"), torch.float32, width=8)
    for step in EAGER_STEPS:
        md = FlashInferBackend.build_metadata(model.common(step))
        with torch.inference_mode():
            for layer, (impl, cache) in enumerate(zip(model.impls, model.caches)):
                out = impl.forward(*model.inputs(layer, step), cache, md)
                assert out.data_ptr() == given[-1]
    assert {type(w) for w in stand_in} >= {FakePrefill, FakeSinkPrefill, FakeDecode}
    assert (FakeRagged in {type(w) for w in stand_in}) == ragged


@pytest.mark.parametrize("query_len", [1, 3], ids=["decode", "verification"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_a_mix_of_layers_in_a_cuda_graph_replans_each_group_before_a_replay(
    where, mix: str, query_len: int
) -> None:
    device, dtype = where
    specs, q, b = MIXES[mix], query_len, 4  # a bucket of 4 rows
    first = [BS + q, 2 * BS + 1, 3 * BS]  # the 3 requests' lengths after the first replay
    model = Model(specs, [n + q for n in first], device, dtype, width=WIDTH, seed=1)
    # Replay 1: 3 requests and a padding row; replay 2: the next tokens of 2 of them, 2 padding
    # rows (a request dropped from the batch: other rows, other lengths).
    replays = [[(r, n - q, n) for r, n in enumerate(first)], [(0, first[0], first[0] + q)]]
    replays[1].append((2, first[2], first[2] + q))
    for r, n in enumerate(first):
        model.write_context(r, n - q)

    # The runner's persistent buffers, and the inputs the graph reads.
    i32 = dict(dtype=torch.int32, device=device)
    qsl = torch.arange(b + 1, **i32) * q
    seq_lens = torch.full((b,), q, **i32)
    table = torch.zeros(b, WIDTH, **i32)
    slots = torch.zeros(b * q, dtype=torch.int64, device=device)
    inputs = [
        [torch.zeros(b * q, s.num_kv_heads if i else s.num_heads, s.head_size) for i in range(3)]
        for s in specs
    ]
    inputs = [[t.to(dtype).to(device) for t in layer] for layer in inputs]

    def common(seq_lens_cpu: np.ndarray, max_seq_len: int) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=b,
            num_actual_tokens=b * q,
            max_query_len=q,
            max_seq_len=max_seq_len,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=slots,
            query_start_loc_cpu=np.arange(b + 1) * q,
            seq_lens_cpu=seq_lens_cpu,
            block_size=BS,
        )

    def forward(md: Any) -> list[torch.Tensor]:
        return [
            impl.forward(*inputs[layer], cache, md)
            for layer, (impl, cache) in enumerate(zip(model.impls, model.caches))
        ]

    graphed = device.type == "cuda"
    with torch.inference_mode():
        # Capture as the runner does: worst-case lengths, a warm-up forward that plans, then the
        # graph (where nothing may plan).
        md = FlashInferBackend.build_graph_metadata(common(np.full(b, WIDTH * BS), WIDTH * BS))
        forward(md)
        assert set(md.plans) == _groups(specs)
        wrappers = {g: p.wrapper for g, p in md.plans.items()}
        if graphed:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = forward(md)
        for i, step in enumerate(replays):
            n = len(step)
            real = model.common(step)
            seq_lens.fill_(q)
            seq_lens[:n] = real.seq_lens
            table.zero_()
            table[:n] = real.block_table
            slots.zero_()
            slots[: n * q] = real.slot_mapping
            pad = np.full(b - n, q)
            padded = common(np.concatenate([real.seq_lens_cpu, pad]), real.max_seq_len)
            FlashInferBackend.prepare_graph_replay(md, padded)
            for layer, bufs in enumerate(inputs):
                for buf, x in zip(bufs, model.inputs(layer, step)):
                    buf.normal_()  # padding rows: whatever the runner's buffers held
                    buf[: n * q] = x
            if graphed:
                graph.replay()
            else:
                outs = forward(md)
            for layer, out in enumerate(outs):
                what = f"{mix} q={q} replay {i} layer {layer}"
                _check(out[: n * q], model.reference(layer, step), dtype, what)
        # The graph's wrappers stayed the ones its kernels were captured with.
        assert {g: p.wrapper for g, p in md.plans.items()} == wrappers


def test_a_plain_model_plans_once_a_step_and_a_mix_once_a_group(
    stand_in, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the paged wrappers' plans: the ragged path, for steps of new prompts, is off here)
    monkeypatch.setattr(FlashInferBackend, "ragged_prefill", False)

    def run(specs: list[AttentionSpec], steps: list) -> list[Any]:
        model = Model(specs, [7, 31, 41, 10], torch.device("cpu"), torch.float32, width=8)
        mds = []
        for step in steps:
            md = FlashInferBackend.build_metadata(model.common(step))
            for layer, (impl, cache) in enumerate(zip(model.impls, model.caches)):
                impl.forward(*model.inputs(layer, step), cache, md)
            mds.append(md)
        return mds

    run([PLAIN] * 4, EAGER_STEPS)
    # One prefill and one decode wrapper, as before groups: one plan a step.
    assert [type(w) for w in stand_in] == [FakePrefill, FakeDecode]
    assert [len(w.plans) for w in stand_in] == [2, 1]
    p = stand_in[0].plans[0]
    assert (p["window_left"], p["logits_soft_cap"], p["causal"]) == (-1, None, True)

    plain = list(stand_in)
    stand_in.clear()
    mds = run(MIXES["gemma"], EAGER_STEPS)
    # Each group planned once a step, with its window and cap. The pool holds as many wrappers
    # of a kind as a step has groups: the plain model's serve the mix's first group.
    assert all(set(md.plans) == _groups(MIXES["gemma"]) for md in mds)
    assert [type(w) for w in stand_in] == [FakePrefill, FakeDecode]
    window = [md.plans[PlanGroup.of(GEMMA_WINDOW)].wrapper for md in mds]
    full = [md.plans[PlanGroup.of(GEMMA_FULL)].wrapper for md in mds]
    assert window == [plain[0], plain[0], plain[1]] and full == [*stand_in[:1] * 2, stand_in[1]]
    assert [len(w.plans) for w in plain + stand_in] == [4, 2, 2, 1]
    p = plain[0].plans[-1]
    assert (p["window_left"], p["logits_soft_cap"], p["causal"]) == (6, 2.0, True)
    p = stand_in[0].plans[-1]
    assert (p["window_left"], p["logits_soft_cap"], p["causal"]) == (-1, None, True)

    stand_in.clear()
    mds = run(MIXES["gpt-oss"], EAGER_STEPS)
    assert all(type(w) is FakeSinkPrefill for w in stand_in)
    # FA2 for decode steps, the device's best for the others; a wrapper compiled with a window
    # and one without, per kind.
    assert sorted((w.backend, w.compiled[-1]) for w in stand_in) == [
        ("auto", False),
        ("auto", True),
        ("fa2", False),
        ("fa2", True),
    ]
    assert all(len(w.plans) == 2 for w in stand_in if w.backend == "auto")  # 2 steps each


def test_graph_wrappers_share_the_page_table_buffers_and_replan_every_group(stand_in) -> None:
    specs = MIXES["gpt-oss"][:2] + MIXES["gemma"][:2]
    model = Model(specs, [20, 20], torch.device("cpu"), torch.float32, width=WIDTH)
    step = [(0, 19, 20), (1, 19, 20)]
    md = FlashInferBackend.build_graph_metadata(model.common(step))
    for layer, (impl, cache) in enumerate(zip(model.impls, model.caches)):
        impl.forward(*model.inputs(layer, step), cache, md)
    assert len(md.plans) == 4 and len(stand_in) == 4
    assert all(w.graph for w in stand_in)
    for w in stand_in:  # one page table for the graph, at the buffers' addresses
        assert all(a is b for a, b in zip(w.bufs[1:], stand_in[0].bufs[1:]))
    FlashInferBackend.prepare_graph_replay(md, model.common(step))
    assert [len(w.plans) for w in stand_in] == [2, 2, 2, 2]
    with pytest.raises(RuntimeError, match="before it was planned"):
        FlashInferBackend.prepare_graph_replay(
            FlashInferBackend.build_graph_metadata(model.common(step)), model.common(step)
        )


def test_sinks_reach_the_variant_in_fp32_with_the_layer_scale(stand_in) -> None:
    # bfloat16 sink logits (the model's dtype), a scale other than the default.
    spec = replace(OSS_WINDOW, scale=0.2)
    model = Model([spec], [7, 31, 41, 10], torch.device("cpu"), torch.bfloat16, width=8)
    for step in EAGER_STEPS:
        md = FlashInferBackend.build_metadata(model.common(step))
        out = model.impls[0].forward(*model.inputs(0, step), model.caches[0], md)
        _check(out, model.reference(0, step), torch.bfloat16, f"step {step}")
    assert all(type(w) is FakeSinkPrefill for w in stand_in)
