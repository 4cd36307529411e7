"""The LoRA kernels (SGMV over segments, BGMV over rows) under Triton's interpreter on tiny
shapes, against the torch reference: partial blocks, a segment and rows with no adapter, a
column slice of a wider output, the shrunk columns of a merged projection's second slice."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
pytest.importorskip("triton")

from pagoda.ops import lora as ref  # noqa: E402
from pagoda.ops import triton_lora  # noqa: E402

SLOTS, K, N = 3, 40, 24


def _case(rank: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, 2 * rank, K, generator=g)  # two slices' A, as q/k of one projection
    b = torch.randn(SLOTS, N, rank, generator=g)
    x = torch.randn(21, K, generator=g)
    # (start, end, slot): a long segment, a base-model one, a one-token one, another adapter
    segs = [(0, 17, 2), (17, 19, -1), (19, 20, 0), (20, 21, 1)]
    starts = torch.tensor([s for s, _, _ in segs] + [21], dtype=torch.int32)
    slots = torch.tensor([s for _, _, s in segs], dtype=torch.int32)
    rows = torch.cat([torch.full((e - s,), k, dtype=torch.int32) for s, e, k in segs])
    return a, b, x, segs, starts, slots, rows


@pytest.mark.parametrize("rank", [8, 16])
def test_sgmv_and_bgmv_match_the_torch_reference(rank: int) -> None:
    a, b, x, segs, starts, slots, rows = _case(rank)
    used = [s for s in segs if s[2] >= 0]
    want_y = ref.sgmv_shrink_reference(x, a, used)
    got_y = triton_lora.sgmv_shrink(x, a, starts, slots, 17)
    keep = rows >= 0
    torch.testing.assert_close(got_y[keep], want_y[keep], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ref.bgmv_shrink_reference(x, a, rows), want_y, atol=1e-4, rtol=0)
    torch.testing.assert_close(triton_lora.bgmv_shrink(x, a, rows)[keep], want_y[keep],
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    # Expand the second slice's ranks into columns 5..5+N of a wider output.
    base = torch.randn(21, N + 9)
    want = base.clone()
    ref.sgmv_expand_reference(want_y, b, used, want[:, 5 : 5 + N], rank)
    for run in (
        lambda out: triton_lora.sgmv_expand(got_y, b, starts, slots, 17, out[:, 5 : 5 + N], rank),
        lambda out: ref.bgmv_expand_reference(want_y, b, rows, out[:, 5 : 5 + N], rank),
    ):
        got = base.clone()
        run(got)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(want[17:19], base[17:19]) and torch.equal(want[:, :5], base[:, :5])


def test_bgmv_expands_three_slices_in_one_launch_like_the_reference() -> None:
    """q | k | v: one BGMV launch over the merged output, each slice its own ranks of y."""
    g = torch.Generator().manual_seed(3)
    r, sizes = 8, (20, 7, 7)
    b = torch.randn(SLOTS, sum(sizes), r, generator=g)
    y = torch.randn(6, 3 * r, generator=g)
    rows = torch.tensor([0, -1, 2, 1, 1, -1], dtype=torch.int32)
    bounds = (20, 27)
    want = torch.zeros(6, sum(sizes))
    batch = ref.LoRABatch(rows, torch.zeros(1), torch.zeros(1), 1, [], use_rows=True)
    ref.expand(y, b, batch, want, bounds)  # (the reference: slice by slice)
    got = torch.zeros(6, sum(sizes))
    triton_lora.bgmv_expand(y, b, rows, got, bounds)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    lo = y[3, 8:16] @ b[1, 20:27].T  # k of row 3 (slot 1) reads the second 8 ranks
    torch.testing.assert_close(got[3, 20:27], lo, atol=1e-4, rtol=1e-4)


def test_bgmv_expand_reads_each_rows_slot_columns_of_a_folded_shrink(monkeypatch) -> None:
    """The shrink folded into the base GEMM: one output row holds the base columns, then every
    slot's shrink; the expand adds each row's own slot's product into the base columns."""
    g = torch.Generator().manual_seed(4)
    r, sizes = 8, (12, 6, 6)
    n, rt = sum(sizes), 3 * r
    k = 16
    a = torch.randn(SLOTS, rt, k, generator=g)
    b = torch.randn(SLOTS, n, r, generator=g)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(5, k, generator=g)
    rows = torch.tensor([2, -1, 0, 1, 2], dtype=torch.int32)
    y = x @ torch.cat([w, a.reshape(-1, k)]).T  # [rows, n + SLOTS * rt]
    triton_lora.bgmv_expand(y[:, n:], b, rows, y[:, :n], (12, 18), slot_stride=rt)
    want = x @ w.T
    batch = ref.LoRABatch(rows, torch.zeros(1), torch.zeros(1), 1, [], use_rows=True)
    ref.expand(ref.bgmv_shrink_reference(x, a, rows), b, batch, want, (12, 18))
    torch.testing.assert_close(y[:, :n], want, atol=1e-4, rtol=1e-4)
    assert not torch.equal(want[0], x[0] @ w.T)  # (the adapter changed the row)
    # The engine's op: its torch reference (a CPU's path), and its dispatch to the kernel.
    graph_rows = torch.cat([rows, torch.tensor([-1, -1], dtype=torch.int32)])  # (padding)
    batch = ref.LoRABatch(graph_rows, torch.zeros(1), torch.zeros(1), 1, [], use_rows=True)
    for use_triton in (False, True):
        y = x @ torch.cat([w, a.reshape(-1, k)]).T
        before = y.clone()
        monkeypatch.setattr(ref, "_use_triton", lambda t, on=use_triton: on)
        ref.expand_folded(y, n, b, batch, (12, 18), rt)
        torch.testing.assert_close(y[:, :n], want, atol=1e-4, rtol=1e-4)
        assert torch.equal(y[1], before[1]) and torch.equal(y[:, n:], before[:, n:])


@pytest.mark.parametrize("kernel", ["bgmv-wide", "fused-rows", "fused-slots"])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_decode_kernel_variants_match_the_torch_reference(kernel: str, rank: int) -> None:
    """Each decode kernel of ``pagoda.ops.lora.DECODE_KERNELS`` on q | k | v: 17 rows of one
    slot (two blocks of 16 rows for fused-slots), rows of no adapter (untouched), partial
    blocks (slices of 37, 18 and 9 columns, in one block each or in blocks of 16). float32:
    the interpreter's bfloat16 ``tl.dot`` is wrong (SGMV's too); the GPU tests run bfloat16."""
    g = torch.Generator().manual_seed(5 + rank)
    sizes = (37, 18, 9)
    a = torch.randn(SLOTS, 3 * rank, K, generator=g)
    b = torch.randn(SLOTS, sum(sizes), rank, generator=g)
    x = torch.randn(24, K, generator=g)
    rows = torch.tensor([2] * 17 + [-1, 0, 1, -1, 0, 2, 1], dtype=torch.int32)
    bounds = (37, 55)
    base = torch.randn(24, sum(sizes), generator=g)
    want = base.clone()
    ref.expand(ref.bgmv_shrink_reference(x, a, rows), b, _rows_batch(rows), want, bounds)
    got = base.clone()
    if kernel == "bgmv-wide":
        y = triton_lora.bgmv_shrink(x, a, rows, wide=True)
        triton_lora.bgmv_expand(y, b, rows, got, bounds, wide=True)
    elif kernel == "fused-rows":
        triton_lora.fused_rows(x, a, b, rows, got, bounds)
    else:
        order, starts = ref.sort_rows(rows.numpy(), SLOTS)
        sorted_rows, slot_starts = torch.from_numpy(order), torch.from_numpy(starts)
        triton_lora.fused_slots(x, a, b, sorted_rows, slot_starts, got, bounds)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    none = rows < 0
    assert torch.equal(got[none], base[none])
    if kernel != "bgmv-wide":  # blocks of 16 columns: several a slice, the last one partial
        got = base.clone()
        if kernel == "fused-rows":
            triton_lora.fused_rows(x, a, b, rows, got, bounds, block_n=16)
        else:
            triton_lora.fused_slots(x, a, b, sorted_rows, slot_starts, got, bounds, block_n=16)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_sort_rows_groups_rows_by_slot_and_leaves_base_rows_out() -> None:
    order, starts = ref.sort_rows(torch.tensor([2, -1, 0, 2, 0, -1]).numpy(), 4)
    assert starts.tolist() == [0, 2, 2, 4, 4]
    assert order[:4].tolist() == [2, 4, 0, 3] and sorted(order[4:].tolist()) == [1, 5]


def _rows_batch(rows: torch.Tensor) -> ref.LoRABatch:
    return ref.LoRABatch(rows, torch.zeros(1), torch.zeros(1), 1, [], use_rows=True)
