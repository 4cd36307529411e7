"""The random draw of a row from its logits at a temperature, in one Triton kernel.

The same inverse-CDF draw as :func:`pagoda.sample.ops.sample_from_probs` (running sums over
buckets of 128 tokens in float64, then within the chosen bucket), on ``exp((logit - max) / T)``
read straight from the model's logits: no float32 copy, temperature division, softmax, bucket
reduction, scans and searches as separate passes over the vocabulary. One program draws one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128  # tokens per bucket, as in pagoda.sample.ops
TILE = 2048  # tokens a loop iteration reads


@triton.jit
def _sample_rows_kernel(
    logits_ptr,
    stride_row,
    temp_ptr,
    u_ptr,
    sums_ptr,
    out_ptr,
    vocab,
    NUM_BUCKETS: tl.constexpr,
    BUCKETS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    sums = sums_ptr + row.to(tl.int64) * BUCKETS_PAD
    inv_t = 1.0 / tl.load(temp_ptr + row).to(tl.float32)
    offs = tl.arange(0, TILE)

    # The row's largest logit, so that no exp overflows.
    m = tl.full([TILE], float("-inf"), tl.float32)
    for start in range(0, vocab, TILE):
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf"))
        m = tl.maximum(m, x.to(tl.float32))
    row_max = tl.max(m, 0)

    # Each bucket's weight: the sum of its tokens' exp((logit - max) / T), in float32.
    per_tile: tl.constexpr = TILE // CHUNK
    for start in range(0, vocab, TILE):
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf"))
        p = tl.exp((x.to(tl.float32) - row_max) * inv_t)
        s = tl.sum(tl.reshape(p, [per_tile, CHUNK]), 1)
        b = start // CHUNK + tl.arange(0, per_tile)
        tl.store(sums + b, s, mask=b < NUM_BUCKETS)
    tl.debug_barrier()  # the stores above, visible to every thread of the program

    # The bucket: the first whose running sum exceeds u x total.
    bidx = tl.arange(0, BUCKETS_PAD)
    w = tl.load(sums + bidx, mask=bidx < NUM_BUCKETS, other=0.0)
    cdf = tl.cumsum(w.to(tl.float64), 0)
    total = tl.max(cdf, 0)
    target = tl.load(u_ptr + row) * total
    bucket = tl.sum((cdf <= target).to(tl.int32), 0)
    # NOTE: u x total may round up to the total; the last bucket of any weight then.
    bucket = tl.minimum(bucket, tl.max(tl.where(w > 0, bidx, 0), 0))
    before = tl.max(tl.where(bidx == bucket - 1, cdf, 0.0), 0)

    # The token within it, the same way.
    cidx = tl.arange(0, CHUNK)
    tok = bucket * CHUNK + cidx
    x = tl.load(base + tok, mask=tok < vocab, other=float("-inf"))
    p = tl.exp((x.to(tl.float32) - row_max) * inv_t)
    inner = tl.cumsum(p.to(tl.float64), 0)
    idx = tl.sum((inner <= target - before).to(tl.int32), 0)
    idx = tl.minimum(idx, tl.max(tl.where(p > 0, cidx, 0), 0))
    tl.store(out_ptr + row, (bucket * CHUNK + idx).to(tl.int64))


def sample_from_logits_triton(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """[n] int64: each row of ``logits`` [n, vocab] (unit stride in the vocabulary, any float
    dtype) drawn at its ``temperature`` [n] (> 0) with its ``uniform`` [n] float64 in [0, 1)."""
    n, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary must be contiguous"
    num_buckets = triton.cdiv(vocab, CHUNK)
    pad = triton.next_power_of_2(num_buckets)
    sums = torch.empty((n, pad), dtype=torch.float32, device=logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _sample_rows_kernel[(n,)](
            logits,
            logits.stride(0),
            temperature,
            uniform,
            sums,
            out,
            vocab,
            NUM_BUCKETS=num_buckets,
            BUCKETS_PAD=pad,
            CHUNK=CHUNK,
            TILE=TILE,
            num_warps=8,
        )
    return out
