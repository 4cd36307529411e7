"""The batch-invariant attention kernel (Triton; under the interpreter on a CPU) and the CPU path
of the same backend: each matches a float64 reference, and a token's output is the same bits
alone, in a batch with other requests, and in any chunk of its prompt."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is first compiled

from pagoda.attention.backend import CommonAttentionMetadata  # noqa: E402
from pagoda.attention.batch_invariant import BatchInvariantBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on CUDA where there is one, else on the CPU
PAGE, HEADS, KV_HEADS, DIM = 16, 4, 2, 32


def _cache(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    shape = (2, num_blocks, PAGE, KV_HEADS, DIM)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def _common(reqs: list[tuple[int, int, list[int]]]) -> CommonAttentionMetadata:
    """``reqs``: (context before the step, query tokens, block ids) per request."""
    q_lens = np.array([q for _, q, _ in reqs])
    seq_lens = np.array([c + q for c, q, _ in reqs])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    width = max(len(b) for _, _, b in reqs)
    table = np.zeros((len(reqs), width), dtype=np.int32)
    for i, (_, _, blocks) in enumerate(reqs):
        table[i, : len(blocks)] = blocks
    slots = np.concatenate(
        [[blocks[p // PAGE] * PAGE + p % PAGE for p in range(c, c + q)] for c, q, blocks in reqs]
    ).astype(np.int64)
    dev = torch.device(DEVICE)
    return CommonAttentionMetadata(
        num_reqs=len(reqs),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_table=torch.tensor(table, device=dev),
        slot_mapping=torch.tensor(slots, device=dev),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=PAGE,
    )


def _attend(backend_cpu: bool, q, k, v, cache, common) -> torch.Tensor:  # noqa: ANN001
    impl = BatchInvariantBackend.get_impl_cls()(HEADS, DIM, DIM**-0.5, KV_HEADS)
    md = BatchInvariantBackend.build_metadata(common)
    if backend_cpu and md.on_cpu is False:
        pytest.skip("the CPU path runs on a CPU")
    return impl.forward(q, k, v, cache, md)


def _reference(q, cache, reqs) -> torch.Tensor:  # noqa: ANN001
    out = []
    t = 0
    for ctx, n, blocks in reqs:
        keys = cache[0][blocks].flatten(0, 1)[: ctx + n].double()
        vals = cache[1][blocks].flatten(0, 1)[: ctx + n].double()
        for i in range(n):
            p = ctx + i
            k = keys[: p + 1].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [p+1, H, D]
            v = vals[: p + 1].repeat_interleave(HEADS // KV_HEADS, dim=1)
            s = torch.einsum("hd,phd->hp", q[t].double(), k) * DIM**-0.5
            out.append(torch.einsum("hp,phd->hd", s.softmax(-1), v))
            t += 1
    return torch.stack(out)


# The request under test: 30 tokens of context, then 45 more (three key tiles of 64 on a CPU,
# two of the kernel's); others around it in a batch.
TARGET = (30, 45, [3, 4, 5, 6, 7])
OTHERS = [(0, 1, [8]), (100, 1, [9, 10, 11, 12, 13, 14, 15]), (5, 20, [16, 17])]


@pytest.mark.parametrize("path", ["kernel", "cpu"])
def test_output_matches_reference_and_is_the_same_bits_in_any_batch_or_chunk(path: str) -> None:
    if path == "kernel" and DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    cache = _cache(20, dtype)
    ctx, n, blocks = TARGET
    q = torch.randn(ctx + n, HEADS, DIM, generator=gen).to(dtype).to(DEVICE)
    k = cache[0][blocks].flatten(0, 1)[: ctx + n].clone()
    v = cache[1][blocks].flatten(0, 1)[: ctx + n].clone()

    def run(reqs, rows):  # noqa: ANN001, ANN202
        """Attend the target's query rows ``rows`` with the requests ``reqs`` (the target's
        entry among them); the target's output rows."""
        common = _common(reqs)
        qs, ks, vs, where = [], [], [], None
        gen2 = torch.Generator().manual_seed(2)
        for c, m, b in reqs:
            if b is blocks:
                where = sum(x.shape[0] for x in qs)
                qs.append(q[rows]), ks.append(k[rows]), vs.append(v[rows])
            else:
                qs.append(torch.randn(m, HEADS, DIM, generator=gen2).to(dtype).to(DEVICE))
                filler = cache[0][b].flatten(0, 1)[c : c + m].clone()
                ks.append(filler), vs.append(cache[1][b].flatten(0, 1)[c : c + m].clone())
        if path == "kernel" and DEVICE == "cpu":
            from pagoda.ops.triton_invariant_attention import invariant_attention

            qq = torch.cat(qs)
            out = torch.empty_like(qq)
            invariant_attention(
                qq, cache[0], cache[1], out, common.block_table, common.seq_lens,
                common.query_start_loc, common.num_reqs, common.num_actual_tokens, DIM**-0.5,
            )  # fmt: skip
        else:
            out = _attend(path == "cpu", torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, common)
        return out[where : where + len(range(*rows.indices(ctx + n)))]

    whole = run([(0, ctx + n, blocks)], slice(0, ctx + n))
    ref = _reference(q, cache, [(0, ctx + n, blocks)])
    torch.testing.assert_close(whole.double(), ref, rtol=2e-2, atol=2e-2)
    tail = whole[ctx:]
    # The last 45 tokens as one chunk after the context, alone and with others.
    assert torch.equal(run([(ctx, n, blocks)], slice(ctx, ctx + n)), tail)
    assert torch.equal(run([OTHERS[0], (ctx, n, blocks), *OTHERS[1:]], slice(ctx, ctx + n)), tail)
    # Decode-sized steps: the last token alone and among decodes and a prefill.
    last = whole[-1:]
    assert torch.equal(run([(ctx + n - 1, 1, blocks)], slice(ctx + n - 1, ctx + n)), last)
    mixed = [OTHERS[1], OTHERS[2], (ctx + n - 1, 1, blocks), OTHERS[0]]
    assert torch.equal(run(mixed, slice(ctx + n - 1, ctx + n)), last)
