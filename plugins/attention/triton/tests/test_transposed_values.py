"""FP8 caches with their value pages stored transposed (``plugins.triton.fp8_transposed_values``):
the cache write puts each value where ``transposed_values`` reads it, and every paged launch
(mixed, split decode, ordered decode) gives over such a cache what it gives over the same
values stored a token a row. The interpreter runs it on the CPU (float32 queries: its dots take
no half precision), a GPU natively (also bfloat16, whose dots then run in float16)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pagoda_attention_triton.kernels import (  # noqa: E402
    longest_first,
    paged_attention,
    transposed_values,
)

from pagoda.ops.triton_kv_write import write_kv_triton  # noqa: E402
from pagoda.testing.attention import reference_paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.gpu  # on CUDA where there is one, else on the CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 16])
def test_the_write_puts_each_value_where_the_transposed_view_reads_it(dtype, dim) -> None:
    tokens, kv_heads, blocks, page = 9, 2, 6, 16
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(blocks * page, generator=gen)[:tokens].to(DEVICE)
    cache = torch.zeros(2, blocks, page, kv_heads, dim, dtype=dtype, device=DEVICE)
    rows = cache.clone()
    write_kv_triton(k, v, rows, slots, tokens)
    write_kv_triton(k, v, cache, slots, tokens, values_transposed=True)
    vc = transposed_values(cache)
    assert torch.equal(cache[0], rows[0])  # keys as before
    assert not torch.equal(cache[1], rows[1])  # values elsewhere in the page
    blk, pos = slots // page, slots % page
    assert torch.equal(vc[blk, pos], v)
    assert vc.stride(1) == 1 and vc.stride(3) == page  # a page's keys are contiguous


def _fp8_case(q_lens, ctx, heads, kv_heads, dim, page, dtype, seed=0):
    """Random queries and an FP8 cache (quantized by torch: exact), the same values in two
    caches, a token a row and with transposed value pages; float32 scales."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    max_blocks = max(-(-s // page) for s in seq_lens)
    num_blocks = len(q_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 stays padding
    bt = perm[: len(q_lens) * max_blocks].view(len(q_lens), max_blocks).int()
    rows = (torch.randn(2, num_blocks, page, kv_heads, dim, generator=gen) * 40).to(FP8)
    rows[:, 0] = 0  # the null block, as the engine's zeroed cache keeps it
    flipped = torch.empty_like(rows)
    flipped[0] = rows[0]
    flipped[1].view(num_blocks, kv_heads, dim, page).copy_(rows[1].permute(0, 2, 3, 1))
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, rows, flipped, bt, seq_lens, qsl


DECODE_6 = ([1] * 6, [40, 7, 300, 0, 129, 65])


@pytest.mark.parametrize(
    "q_lens,ctx,splits,ordered,page,tile_n",
    [
        ([17, 1, 5], [0, 30, 64], 1, False, 16, None),  # mixed: prompt, decode, chunk
        (*DECODE_6, 1, True, 16, None),  # ordered decode (`_paged_decode`)
        (*DECODE_6, 4, True, 16, None),  # ordered, split
        ([1, 1], [300, 33], 4, False, 16, None),  # split decode
        (*DECODE_6, 1, True, 32, 16),  # pages longer than the tile
        (*DECODE_6, 1, True, 16, 64),  # tiles of four pages
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 2, 16), (9, 3, 64)])
def test_attention_over_transposed_value_pages_matches_token_rows(
    q_lens, ctx, splits, ordered, page, tile_n, dtype, heads, kv_heads, dim
) -> None:
    if dtype != torch.float32 and DEVICE == "cpu":
        pytest.skip("half precision dot needs a GPU")
    q, rows, flipped, bt, seq_lens, qsl = _fp8_case(q_lens, ctx, heads, kv_heads, dim, page, dtype)
    k_scale = torch.tensor([0.02], device=DEVICE)
    v_scale = torch.tensor([0.03], device=DEVICE)
    scale = dim**-0.5
    want = reference_paged_attention(
        q, rows[0].double() * 0.02, rows[1].double() * 0.03, bt, seq_lens, q_lens, scale
    )
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    order = dev(torch.from_numpy(longest_first(np.array(seq_lens)))) if ordered else None
    outs = []
    for cache, values in ((rows, dev(rows)[1]), (flipped, transposed_values(dev(flipped)))):
        out = torch.full_like(dev(q), float("nan"))  # a row no program writes fails
        paged_attention(
            dev(q), dev(cache)[0], values, out, dev(bt),
            dev(torch.tensor(seq_lens, dtype=torch.int32)), dev(qsl), len(q_lens), sum(q_lens),
            max(q_lens), max(seq_lens), scale, splits, order=order, tile_n=tile_n,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        outs.append(out.cpu().double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[0], want, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[1], want, atol=tol, rtol=tol)


@pytest.mark.parametrize("built_with", [False, True])
def test_a_layer_keeps_the_value_layout_it_was_built_with(built_with, monkeypatch) -> None:
    """A second engine in the process that configures the backend the other way does not change
    how an existing engine's layers write their FP8 cache: its captured graphs read the layout
    they were captured with (two engines in one process once wrote transposed pages that the
    first engine's decode graphs read a token a row)."""
    from pagoda_attention_triton.backend import TritonAttentionBackend, TritonAttentionImpl

    from pagoda.attention.backend import CommonAttentionMetadata
    from pagoda.config import EngineConfig

    def configure(on: bool) -> None:
        monkeypatch.setenv("PAGODA_PLUGINS__TRITON__FP8_TRANSPOSED_VALUES", str(on).lower())
        TritonAttentionBackend.configure(EngineConfig.load(None).attention)

    for name in ("fp8_transposed_values", "ragged_prefill"):  # restored after the test
        monkeypatch.setattr(TritonAttentionBackend, name, getattr(TritonAttentionBackend, name))
    monkeypatch.setenv("PAGODA_TRITON_ON_CPU", "1")
    configure(built_with)
    impl = TritonAttentionImpl(4, 64, 0.125, 2)
    impl.sinks = None
    impl.k_scale = torch.tensor([0.02], device=DEVICE)
    impl.v_scale = torch.tensor([0.03], device=DEVICE)
    configure(not built_with)  # another engine, built later
    n, page, blocks = 5, 16, 3
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, 64, generator=gen).to(DEVICE) for h in (4, 2, 2))
    slots = torch.arange(page, page + n, device=DEVICE)  # block 1
    i32 = dict(dtype=torch.int32, device=DEVICE)
    common = CommonAttentionMetadata(
        num_reqs=1, num_actual_tokens=n, max_query_len=n, max_seq_len=n,
        query_start_loc=torch.tensor([0, n], **i32), seq_lens=torch.tensor([n], **i32),
        block_table=torch.tensor([[1, 0]], **i32), slot_mapping=slots,
        query_start_loc_cpu=np.array([0, n]), seq_lens_cpu=np.array([n]), block_size=page,
    )  # fmt: skip
    cache = torch.zeros(2, blocks, page, 2, 64, device=DEVICE).to(FP8)
    with torch.inference_mode():
        impl.forward(q, k, v, cache, TritonAttentionBackend.build_metadata(common))
    want = torch.zeros_like(cache)
    write_kv_triton(k, v, want, slots, n, impl.k_scale, impl.v_scale, values_transposed=built_with)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
