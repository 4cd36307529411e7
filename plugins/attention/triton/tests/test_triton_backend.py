"""The Triton backend's planning for a layer's spec: the splits a window leaves worth making, and
(on a GPU) decode CUDA graphs of windowed, chunked and bidirectional layers, captured at the
model's limit as the runner captures them and replayed for shorter steps."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pagoda_attention_triton.backend import (  # noqa: E402
    TritonAttentionBackend,
    TritonAttentionImpl,
    _choose_splits,
    _layer_splits,
)

from pagoda.attention.backend import CommonAttentionMetadata  # noqa: E402
from pagoda.attention.spec import AttentionSpec  # noqa: E402
from pagoda.testing.attention import reference_attention  # noqa: E402

PLAIN = AttentionSpec(32, 8, 128, 128**-0.5)


def test_a_window_or_chunk_keeps_the_splits_that_leave_each_slice_enough_keys() -> None:
    """The step's splits were chosen for its longest context; a layer that sees fewer keys (a
    window, chunks) halves them until its slices hold 512. Without either they stand, however
    short the slices (the kernel cuts each program's own keys)."""
    assert _layer_splits(8, 8192, PLAIN) == 8
    assert _layer_splits(32, 2048, PLAIN) == 32  # 64 a slice at the captured length
    assert _layer_splits(8, 8192, replace(PLAIN, sliding_window=4096)) == 8  # 512 a slice
    assert _layer_splits(8, 8192, replace(PLAIN, sliding_window=1100)) == 2  # 550 a slice
    assert _layer_splits(8, 8192, replace(PLAIN, sliding_window=1000)) == 1  # 2 would hold 500
    assert _layer_splits(8, 8192, replace(PLAIN, sliding_window=4096, chunk_size=2048)) == 4
    assert _layer_splits(4, 2048, replace(PLAIN, sliding_window=100_000)) == 4  # past contexts
    assert _layer_splits(1, 8192, replace(PLAIN, chunk_size=64)) == 1


def test_a_small_batch_splits_a_graphs_context_into_slices_of_a_tile(monkeypatch) -> None:
    """A graph captured at 2,048 keys: at batch 1 and 4 its decode and verification steps take
    32 slices (64 keys a slice at that length; the kernel cuts shorter contexts evenly), at 16
    a verification (several queries a program) takes 8 and a decode 16. An eager step keeps 512
    keys a slice of its own longest context."""
    import pagoda_attention_triton.backend as backend

    monkeypatch.setattr(backend, "_num_sms", lambda index: 132)  # an H200's

    def splits(n: int, q: int, longest: int, graph: bool = True) -> int:
        common = CommonAttentionMetadata(
            num_reqs=n,
            num_actual_tokens=n * q,
            max_query_len=q,
            max_seq_len=longest,
            query_start_loc=torch.empty(0),
            seq_lens=torch.empty(0),
            # (only its device is read: a GPU's, where none is needed to plan)
            block_table=SimpleNamespace(device=torch.device("cuda", 0)),
            slot_mapping=torch.empty(0),
            query_start_loc_cpu=np.arange(n + 1) * q,
            seq_lens_cpu=np.full(n, longest),
            block_size=16,
        )
        if not graph:
            return _choose_splits(common)
        return TritonAttentionBackend.build_graph_metadata(common).num_splits

    monkeypatch.setattr(backend, "_ordered", lambda common: False)
    assert [splits(1, 1, 2048), splits(1, 9, 2048), splits(4, 9, 2048)] == [32, 32, 32]
    assert [splits(16, 9, 2048), splits(16, 1, 2048)] == [8, 16]
    assert [splits(1, 1, 300, graph=False), splits(1, 1, 2048, graph=False)] == [1, 4]
    assert [splits(128, 1, 2048), splits(256, 1, 2048)] == [2, 1]  # (256: programs enough)


def test_verification_steps_split_but_not_a_bidirectional_layer_of_several_queries() -> None:
    assert _layer_splits(8, 8192, PLAIN, max_query_len=5) == 8
    assert _layer_splits(8, 8192, replace(PLAIN, causal=False), max_query_len=1) == 8
    assert _layer_splits(8, 8192, replace(PLAIN, causal=False), max_query_len=5) == 1


# Graph-captured layers: a gpt-oss-like window with sinks, a Gemma-like soft-capped window, a
# Llama 4-like chunked layer, a bidirectional windowed layer (a decode step of it runs the
# causal kernels: its queries are their requests' last tokens).
GRAPH_SPECS = {
    "window_sinks": replace(PLAIN, sliding_window=1000, sinks=True),
    "window_softcap": replace(PLAIN, scale=4 * 128**-0.5, sliding_window=1500, logit_softcap=5.0),
    "chunks": replace(PLAIN, chunk_size=1024),
    "bidirectional_window": replace(PLAIN, causal=False, sliding_window=1000),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode graphs are planned for CUDA")
@pytest.mark.parametrize("spec_name", list(GRAPH_SPECS))
@pytest.mark.parametrize("num_reqs", [4, 32, 96])
def test_a_decode_graph_of_a_local_layer_replays_steps_shorter_than_its_capture(
    num_reqs: int, spec_name: str
) -> None:
    """Captured at the model's limit (8192), a decode graph plans its splits there, and from 16
    requests an order of them rewritten at each replay; a layer with a window or chunks splits
    the keys it can see, sized from that limit, so replays of contexts up to 3000 (several
    windows and chunks long) stay covered. On an H200 (132 multiprocessors): 4 requests split
    8-way for the step, fewer for the layer; 32 in order and split; 96 in order, unsplit
    (``_paged_decode``)."""
    spec = GRAPH_SPECS[spec_name]
    device, dtype = torch.device("cuda"), torch.bfloat16
    bs, limit = 16, 8192
    width = limit // bs
    gen = torch.Generator().manual_seed(num_reqs)
    seq_lens = torch.randint(1, 3001, (num_reqs,), generator=gen)
    seq_lens[0] = 3000  # one request reaches several windows and chunks back
    blocks = -(-seq_lens // bs)
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    perm = torch.randperm(int(blocks.sum()), generator=gen) + 1  # block 0 is the null block
    at = 0
    for i, b in enumerate(blocks.tolist()):
        table[i, :b] = perm[at : at + b]
        at += b
    kv_cache = torch.randn(2, at + 1, bs, spec.num_kv_heads, spec.head_size, generator=gen)
    kv_cache = kv_cache.to(dtype).to(device)
    sinks = (torch.randn(spec.num_heads, generator=gen) + 3).to(dtype)

    # The runner's persistent buffers, padded as for capture: every row one token, block 0.
    i32 = dict(dtype=torch.int32, device=device)
    qsl_buf = torch.arange(num_reqs + 1, **i32)
    seq_buf = torch.ones(num_reqs, **i32)
    table_buf = torch.zeros(num_reqs, width, **i32)
    slot_buf = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    q_buf = torch.zeros(num_reqs, spec.num_heads, spec.head_size, dtype=dtype, device=device)
    k_buf = torch.zeros(num_reqs, spec.num_kv_heads, spec.head_size, dtype=dtype, device=device)
    v_buf = torch.zeros_like(k_buf)

    def common(max_seq_len: int, seq_lens_cpu: np.ndarray) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_reqs,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=qsl_buf,
            seq_lens=seq_buf,
            block_table=table_buf,
            slot_mapping=slot_buf,
            query_start_loc_cpu=np.arange(num_reqs + 1),
            seq_lens_cpu=seq_lens_cpu,
            block_size=bs,
        )

    md = TritonAttentionBackend.build_graph_metadata(common(limit, np.full(num_reqs, limit)))
    impl = TritonAttentionImpl(spec.num_heads, spec.head_size, spec.scale, spec.num_kv_heads)
    impl.spec = spec  # as the layer does
    impl.sinks = sinks.to(device) if spec.sinks else None
    with torch.inference_mode():
        impl.forward(q_buf, k_buf, v_buf, kv_cache, md)  # warm-up: compile before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = impl.forward(q_buf, k_buf, v_buf, kv_cache, md)

        # A step: each request's next token at position seq_len - 1, written by the graph.
        q = torch.randn(num_reqs, spec.num_heads, spec.head_size, generator=gen).to(dtype)
        k = torch.randn(num_reqs, spec.num_kv_heads, spec.head_size, generator=gen).to(dtype)
        v = torch.randn(num_reqs, spec.num_kv_heads, spec.head_size, generator=gen).to(dtype)
        pos = seq_lens - 1
        slots = table[torch.arange(num_reqs), pos // bs].long() * bs + pos % bs
        for buf, src in ((q_buf, q), (k_buf, k), (v_buf, v), (seq_buf, seq_lens)):
            buf.copy_(src)
        table_buf.copy_(table)
        slot_buf.copy_(slots)
        TritonAttentionBackend.prepare_graph_replay(
            md, common(int(seq_lens.max()), seq_lens.numpy())
        )
        graph.replay()
        torch.cuda.synchronize()

    kc, vc = kv_cache[0].cpu(), kv_cache[1].cpu()
    rules = {
        "causal": spec.causal,
        "sliding_window": spec.sliding_window,
        "logit_softcap": spec.logit_softcap,
        "sinks": sinks.double() if spec.sinks else None,
        "chunk_size": spec.chunk_size,
    }
    want = torch.cat(
        [
            reference_attention(
                q[i : i + 1],
                kc[table[i, : blocks[i]].long()].flatten(0, 1)[:n],
                vc[table[i, : blocks[i]].long()].flatten(0, 1)[:n],
                n - 1,
                spec.scale,
                **rules,
            )
            for i, n in enumerate(seq_lens.tolist())
        ]
    )
    torch.testing.assert_close(out.cpu().double(), want, atol=3e-2, rtol=3e-2)
