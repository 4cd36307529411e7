"""A model's kernel may store a layer's keys and values in the cache itself, as it computes them
(``Attention.kv_store_target``; Qwen3's fused qkv projection on Hopper): the layer offers its
cache only where the backend accepts it and the cache is the default layout in the model's
dtype, and a forward told ``kv_stored`` leaves the cache to what the model stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.attention.backend import CommonAttentionMetadata, model_stored_kv, write_kv_cache
from pagoda.attention.layer import Attention, set_forward_context
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.ops.fp8 import FP8_DTYPE

PAGE, HEADS, KV_HEADS, DIM, TOKENS = 16, 4, 2, 32, 40


def _step() -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    blocks = [5, 2, 7]  # out of order
    slots = torch.tensor([blocks[p // PAGE] * PAGE + p % PAGE for p in range(TOKENS)])
    common = CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=TOKENS,
        max_query_len=TOKENS,
        max_seq_len=TOKENS,
        query_start_loc=torch.tensor([0, TOKENS], dtype=torch.int32),
        seq_lens=torch.tensor([TOKENS], dtype=torch.int32),
        block_table=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=slots,
        query_start_loc_cpu=np.array([0, TOKENS]),
        seq_lens_cpu=np.array([TOKENS]),
        block_size=PAGE,
    )
    q = torch.randn(TOKENS, HEADS * DIM, generator=gen)
    k = torch.randn(TOKENS, KV_HEADS * DIM, generator=gen)
    v = torch.randn(TOKENS, KV_HEADS * DIM, generator=gen)
    return common, q, k, v


def _layer(backend=TorchNativeBackend, dtype=torch.float32) -> Attention:
    layer = Attention(backend, HEADS, DIM, DIM**-0.5, KV_HEADS, 0)
    layer.kv_cache = torch.zeros(2, 10, PAGE, KV_HEADS, DIM, dtype=dtype)
    return layer


def test_a_forward_told_the_model_stored_them_does_not_write_them_again() -> None:
    common, q, k, v = _step()
    md = TorchNativeBackend.build_metadata(common)
    plain = _layer()
    with set_forward_context(md, common.slot_mapping):
        want = plain(q, k, v)
    assert plain.kv_cache.abs().sum() > 0  # the impl wrote the keys and values

    stored = _layer()
    with set_forward_context(md, common.slot_mapping):
        cache, slots = stored.kv_store_target(TOKENS, torch.float32)
        assert cache is stored.kv_cache and slots is common.slot_mapping
        # The model's kernel stores them (here: the core's write), then the layer runs.
        write_kv_cache(k.view(TOKENS, KV_HEADS, DIM), v.view(TOKENS, KV_HEADS, DIM), cache,
                       slots, TOKENS)  # fmt: skip
        before = cache.clone()
        cache.view(2, -1, KV_HEADS, DIM)[0, slots[0]] += 1.0  # a mark the impl must not undo
        marked = cache.clone()
        got = stored(q, k, v, kv_stored=True)
        assert not model_stored_kv()  # only inside the impl's forward
    assert torch.equal(stored.kv_cache, marked)  # untouched by the forward
    assert torch.equal(before, plain.kv_cache)
    assert torch.equal(got, want)  # (a step of new prompts attends over its own keys)


def test_the_cache_is_offered_only_where_the_model_may_store_into_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    common, *_ = _step()
    md = TorchNativeBackend.build_metadata(common)
    layer = _layer()
    assert layer.kv_store_target(TOKENS, torch.float32) is None  # no slots from the runner
    with set_forward_context(md, common.slot_mapping):
        assert layer.kv_store_target(TOKENS, torch.float32) is not None
        assert layer.kv_store_target(TOKENS - 1, torch.float32) is None  # rows without slots
        assert layer.kv_store_target(TOKENS, torch.bfloat16) is None  # another dtype
        assert _layer(dtype=FP8_DTYPE).kv_store_target(TOKENS, torch.float32) is None
        layer.calibrate_kv_scales = True
        assert layer.kv_store_target(TOKENS, torch.float32) is None
        layer.calibrate_kv_scales = False
        monkeypatch.setattr(TorchNativeBackend, "accepts_model_stored_kv", False)
        assert layer.kv_store_target(TOKENS, torch.float32) is None
