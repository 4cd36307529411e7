"""The Triton kernel against a float64 reference over random paged layouts (the interpreter runs
it on the CPU; on a GPU it runs natively)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pagoda_attention_triton.kernels import paged_attention, write_kv_cache_fused  # noqa: E402

from pagoda.attention.backend import write_kv_cache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on CUDA where there is one, else on the CPU


def _reference(q, kc, vc, bt, seq_lens, q_lens, scale):
    out = torch.zeros_like(q, dtype=torch.float64)
    start = 0
    g = q.shape[1] // kc.shape[2]
    page = kc.shape[1]
    for i, (sl, ql) in enumerate(zip(seq_lens, q_lens)):
        nb = -(-sl // page)
        k = kc[bt[i, :nb].long()].flatten(0, 1)[:sl].double().repeat_interleave(g, 1)
        v = vc[bt[i, :nb].long()].flatten(0, 1)[:sl].double().repeat_interleave(g, 1)
        qq = q[start : start + ql].double()
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        qpos = torch.arange(sl - ql, sl)[:, None]
        s = s.masked_fill(torch.arange(sl)[None, :] > qpos, float("-inf"))
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += ql
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,page,q_lens,ctx,splits,dtype",
    [
        (4, 4, 64, 16, [1, 1, 1], [40, 7, 100], 1, torch.float32),  # decode
        (6, 2, 64, 16, [17, 1, 5], [0, 30, 64], 1, torch.float32),  # mixed, GQA 3
        (8, 2, 128, 32, [33], [20], 1, torch.float32),  # chunked prefill over cached context
        (4, 1, 64, 16, [1, 1], [300, 33], 4, torch.float32),  # split-KV decode
        # A long prefill chunk (the launch of 128 rows and 32-key tiles) beside a decode.
        (4, 2, 64, 16, [150, 1], [10, 40], 1, torch.float32),
        (4, 2, 64, 16, [9, 1], [5, 70], 1, torch.float16),
    ],
)
def test_paged_attention_matches_float64_reference(
    heads, kv_heads, head_dim, page, q_lens, ctx, splits, dtype
) -> None:
    if dtype != torch.float32 and DEVICE == "cpu":
        pytest.skip("half precision dot needs a GPU")
    gen = torch.Generator().manual_seed(0)
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    max_blocks = max(-(-s // page) for s in seq_lens)
    num_blocks = len(q_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 stays padding
    bt = perm[: len(q_lens) * max_blocks].view(len(q_lens), max_blocks).int()
    kc = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    want = _reference(q, kc, vc, bt, seq_lens, q_lens, scale)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = torch.empty_like(dev(q))
    paged_attention(
        dev(q),
        dev(kc),
        dev(vc),
        out,
        dev(bt),
        dev(torch.tensor(seq_lens, dtype=torch.int32)),
        dev(qsl),
        len(q_lens),
        sum(q_lens),
        max(q_lens),
        max(seq_lens),
        scale,
        splits,
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cache_write_stores_what_the_two_copies_store(dtype: torch.dtype) -> None:
    tokens, heads, kv_heads, dim, blocks, page = 9, 4, 2, 64, 6, 4
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(DEVICE)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k = k.view(tokens, kv_heads, dim)  # strided views of the projection, as the model has them
    v = v.view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * page, generator=gen)[: tokens + 2].to(DEVICE)
    cache = torch.randn(2, blocks, page, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    want = cache.clone()
    write_kv_cache(k, v, want, slots, tokens - 2)  # fewer tokens than the slots given
    kc, vc = write_kv_cache_fused(k, v, cache, slots, tokens - 2)
    assert torch.equal(cache, want)
    assert kc.data_ptr() == cache[0].data_ptr() and vc.data_ptr() == cache[1].data_ptr()
