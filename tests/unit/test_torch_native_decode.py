"""The reference backend's decode path: decodes of very different context lengths are attended in
groups of similar length, each padded only to its own longest, and still match float64 attention
when they share a step with prefill chunks."""

from __future__ import annotations

import numpy as np
import torch

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.testing import AttentionCase, check_attention_backend

PAGE = 16
LENS = (3, 20, 70, 150, 151, 300, 333, 600, 650, 41)


def test_decodes_of_many_lengths_beside_a_prefill_match_float64_attention() -> None:
    # Every request's context but its last token (request 9's in two chunks) is written first;
    # then the decodes run beside request 9's second chunk, then all of them decode once more.
    first = tuple((r, 0, n - 2) for r, n in enumerate(LENS[:-1])) + ((9, 0, 17),)
    mixed = tuple((r, n - 2, n - 1) for r, n in enumerate(LENS[:-1])) + ((9, 17, LENS[9] - 1),)
    last = tuple((r, n - 1, n) for r, n in enumerate(LENS))
    case = AttentionCase("long-decodes", 9, 3, 64, PAGE, LENS, (first, mixed, last))
    check_attention_backend(TorchNativeBackend, case)
    check_attention_backend(TorchNativeBackend, case, dtype=torch.bfloat16)


def test_decode_groups_pad_each_row_to_a_similar_length_only() -> None:
    rng = np.random.default_rng(0)
    lens = rng.integers(160, 641, 64)
    n = len(lens)
    width = -(-int(lens.max()) // PAGE)
    table = torch.arange(1, n * width + 1, dtype=torch.int32).view(n, width)
    common = CommonAttentionMetadata(
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=int(lens.max()),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.from_numpy(lens.astype(np.int32)),
        block_table=table,
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        query_start_loc_cpu=np.arange(n + 1),
        seq_lens_cpu=lens,
        block_size=PAGE,
    )
    dec = TorchNativeBackend.build_metadata(common).decodes
    real = int((-(-lens // PAGE)).sum())
    read = sum(rows * blocks for rows, blocks in dec.shapes)
    assert len(dec.shapes) > 1 and read <= 1.15 * real  # one batch padded to 640 reads 1.6x
    assert sorted(dec.tokens.tolist()) == list(range(n))
    row = block = 0
    for (rows, blocks), mask in zip(dec.shapes, dec.masks):
        tokens = dec.tokens[row : row + rows]
        assert blocks == -(-int(lens[tokens].max()) // PAGE)
        got = dec.blocks[block : block + rows * blocks].view(rows, blocks)
        assert torch.equal(got, table[tokens, :blocks].long())
        for t, m in zip(tokens.tolist(), mask[:, 0, 0]):
            assert int(m.sum()) == lens[t] and bool(m[: lens[t]].all())
        row, block = row + rows, block + rows * blocks
