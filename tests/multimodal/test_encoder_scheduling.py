"""The scheduler's encoder budget and encoder cache (no torch): a prompt chunk stops before an
image the encoder cannot compute this step, an image's output is held until its last placeholder
is computed and then kept for reuse until its room is needed, an image larger than a step's
encoder budget is refused by name, and the image hash is part of the prefix cache's keys."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache.hashing import update_block_hashes
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.multimodal_inputs import MultiModalFeature, MultiModalInputs
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.encoder_cache import EncoderCacheManager
from pagoda.scheduler.scheduler import Scheduler

BLOCK = 4


def _request(rid: str, images: list[tuple[str, int, int]], length: int = 40) -> Request:
    """A prompt of ``length`` tokens with images (hash, offset, tokens)."""
    feats = [MultiModalFeature("image", h, off, n) for h, off, n in images]
    return Request(rid, list(range(1, length + 1)), SamplingParams(max_tokens=2),
                   mm_inputs=MultiModalInputs(feats, np.zeros((3, length), np.int64)))  # fmt: skip


def _scheduler(budget: int, encoder_budget: int, cache_size: int) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget,
                          max_num_encoder_input_tokens=encoder_budget)  # fmt: skip
    kv = KVCacheManager(64, BLOCK, True, 128)
    return Scheduler(cfg, CacheConfig(block_size=BLOCK), kv, 128,
                     encoder_cache=EncoderCacheManager(cache_size))  # fmt: skip


def test_a_chunk_stops_before_an_image_the_encoder_budget_cannot_take():
    s = _scheduler(budget=64, encoder_budget=16, cache_size=64)
    s.add_request(_request("a", [("x", 4, 12), ("y", 20, 12)]))
    out = s.schedule()
    # The budget takes image x (12 tokens) only: the chunk ends where image y starts.
    assert out.num_scheduled_tokens == {"a": 20}
    assert out.scheduled_encoder_inputs == {"a": [0]}
    out = s.schedule()  # the next step: y is encoded, the rest of the prompt computed
    assert out.scheduled_encoder_inputs == {"a": [1]}
    assert out.num_scheduled_tokens == {"a": 20}


def test_an_image_split_over_chunks_is_encoded_once_and_held_until_its_end():
    s = _scheduler(budget=8, encoder_budget=32, cache_size=32)
    s.add_request(_request("a", [("x", 2, 20)]))
    cache = s.encoder_cache
    encoded = []
    for _ in range(3):  # tokens 0-8, 8-16, 16-24: the image's 20 placeholders end at 22
        encoded.append(s.schedule().scheduled_encoder_inputs)
        assert "a" in cache.refs.get("x", set()) or s.requests["a"].num_computed_tokens >= 22
    assert encoded == [{"a": [0]}, {}, {}]
    assert "x" in cache.idle  # unreferenced now, kept for the next request with it


def test_a_second_request_with_the_same_image_hits_the_encoder_cache():
    s = _scheduler(budget=64, encoder_budget=16, cache_size=32)
    s.add_request(_request("a", [("x", 4, 12)]))
    s.add_request(_request("b", [("x", 6, 12)], length=30))
    out = s.schedule()
    assert out.scheduled_encoder_inputs == {"a": [0]}  # b takes a's output: no second encode
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert (s.encoder_cache.queries, s.encoder_cache.hits) == (2, 1)


def test_idle_outputs_are_evicted_for_room_and_the_runner_told():
    s = _scheduler(budget=64, encoder_budget=16, cache_size=16)
    s.add_request(_request("a", [("x", 4, 12)], length=20))
    s.schedule()
    s.add_request(_request("b", [("y", 4, 12)], length=20))
    out = s.schedule()
    assert out.scheduled_encoder_inputs == {"b": [0]}
    assert out.free_encoder_ids == ["x"]


def test_an_image_larger_than_the_encoder_budget_is_refused_by_name():
    s = _scheduler(budget=64, encoder_budget=8, cache_size=64)
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        s.add_request(_request("a", [("x", 4, 12)]))


def test_block_hashes_differ_by_image_with_the_same_tokens():
    a, b = _request("a", [("x", 4, 12)]), _request("b", [("y", 4, 12)])
    ha, hb = update_block_hashes(a, BLOCK), update_block_hashes(b, BLOCK)
    assert ha[0] == hb[0]  # the first block holds no image
    assert all(x != y for x, y in zip(ha[1:], hb[1:]))  # from the image's first block on
