"""The reference backend's prefill path (K and V expanded over the query heads that share them,
the step's own keys when there is no context) gives the same bits as SDPA over K and V repeated per
query head and gathered from the cache, with and without context."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.torch_native import TorchNativeBackend

PAGE, HEADS, KV_HEADS, DIM = 16, 9, 3, 64


@pytest.mark.parametrize("context", [0, 37])
def test_prefill_equals_sdpa_over_repeated_keys_bit_for_bit(context: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q_len = 150
    seq = context + q_len
    blocks = list(range(3, 3 + -(-seq // PAGE)))
    cache = torch.randn(2, 20, PAGE, KV_HEADS, DIM, generator=gen)
    flat_k = cache[0].view(-1, KV_HEADS, DIM)
    flat_v = cache[1].view(-1, KV_HEADS, DIM)
    slots = torch.tensor([blocks[p // PAGE] * PAGE + p % PAGE for p in range(context, seq)])
    # The step's keys and values as strided views of one projection, as the model gives them.
    qkv = torch.randn(q_len, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    q = qkv[:, : HEADS * DIM].view(q_len, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(q_len, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(q_len, KV_HEADS, DIM)
    common = CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=q_len,
        max_query_len=q_len,
        max_seq_len=seq,
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq], dtype=torch.int32),
        block_table=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=slots,
        query_start_loc_cpu=np.array([0, q_len]),
        seq_lens_cpu=np.array([seq]),
        block_size=PAGE,
    )
    impl = TorchNativeBackend.get_impl_cls()(HEADS, DIM, DIM**-0.5, KV_HEADS)
    out = impl.forward(q, k, v, cache, TorchNativeBackend.build_metadata(common))

    all_slots = torch.tensor([blocks[p // PAGE] * PAGE + p % PAGE for p in range(seq)])
    keys = flat_k[all_slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
    vals = flat_v[all_slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
    mask = None
    if context:
        mask = torch.arange(seq)[None, :] <= torch.arange(q_len)[:, None] + context
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        vals.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=DIM**-0.5,
    )[0].transpose(0, 1)
    assert torch.equal(out, ref)
