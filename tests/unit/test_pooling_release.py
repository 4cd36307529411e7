"""A pooling request whose prompt a step completes returns its KV blocks once the step is
launched (``Scheduler.after_launch``), not when its output is read: an embedding batch's last
step then reads its outputs without releasing thousands of blocks after the device's last
kernel. The blocks stay cached for prefix hits; a request that goes on (a prompt chunk, a
generation) keeps its blocks; where another reader may still want them behind the step
(pipeline stages' batches in flight), they go back with the output as before."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.pooling_params import PoolingParams
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import ModelRunnerOutput

BS = 4


def _scheduler(batch_queue: bool = False) -> Scheduler:
    manager = KVCacheManager(32, BS, True, 64)
    config = SchedulerConfig(max_num_batched_tokens=12, enable_chunked_prefill=True)
    return Scheduler(
        config,
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        manager,
        64,
        batch_queue=batch_queue,
    )


def _pooling(rid: str, n: int, first: int = 100) -> Request:
    return Request(
        rid,
        list(range(first, first + n)),
        SamplingParams(max_tokens=1),
        pooling_params=PoolingParams(task="embed", pooling_type="LAST"),
    )


def _output(so, pooled: dict[str, np.ndarray]) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[] for _ in ids], pooler_output=pooled)


def test_blocks_return_at_the_launch_of_the_step_that_ends_the_prompt() -> None:
    sched = _scheduler()
    kv = sched.kv_cache_manager
    free = kv.block_pool.get_num_free_blocks()
    sched.add_request(_pooling("whole", 8))  # 2 blocks, this step
    sched.add_request(Request("gen", [7, 8, 9], SamplingParams(max_tokens=3)))  # 1 block
    sched.add_request(_pooling("chunked", 9, first=300))  # 1 token now, 8 in the next step
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"whole": 8, "gen": 3, "chunked": 1}
    assert kv.block_pool.get_num_free_blocks() == free - 4
    assert not so.kv_unread  # (the others' keys are read by their next steps)
    sched.after_launch(so)
    # The ending prompt's blocks are back (not cached: the first sighting of its first block,
    # the only one hashed); the others keep theirs.
    assert kv.num_held_blocks("whole") == 0
    assert kv.num_held_blocks("gen") == 1 and kv.num_held_blocks("chunked") == 1
    assert kv.block_pool.get_num_free_blocks() == free - 2
    whole = sched.requests["whole"]
    assert not whole.caches_prefix and len(whole.block_hashes) == 1
    assert kv.block_pool.get_cached_block(whole.block_hashes[0]) is None
    # Its output is read after: it ends with it, no block freed twice.
    outs = sched.update_from_output(so, _output(so, {"whole": np.ones(4, np.float32)}))
    (whole,) = [o for o in outs if o.request_id == "whole"]
    assert whole.finished and whole.pooling_output is not None
    assert "whole" not in sched.requests
    assert kv.block_pool.get_num_free_blocks() == free - 2
    # The chunked prompt's last chunk: its blocks go back at that step's launch.
    so = sched.schedule()
    assert so.num_scheduled_tokens["chunked"] == 8
    held = kv.num_held_blocks("chunked")
    assert held == 3
    sched.after_launch(so)
    assert kv.num_held_blocks("chunked") == 0 and kv.num_held_blocks("gen") == 1
    outs = sched.update_from_output(so, _output(so, {"chunked": np.ones(4, np.float32)}))
    assert [o.request_id for o in outs if o.finished] == ["chunked"]
    assert sched.requests.keys() == {"gen"}


def test_a_prompt_seen_again_is_cached_and_its_third_request_hits() -> None:
    """Pooling prompts computed whole enter the prefix cache from the second sighting of their
    first block on: the first leaves no keys behind (its step is ``kv_unread``), the second
    stores and caches them, the third reads them from the cache."""
    sched = _scheduler()
    kv = sched.kv_cache_manager
    seen = []
    for rid, n in [("first", 8), ("second", 8), ("third", 9)]:  # the third: one token more
        sched.add_request(_pooling(rid, n))
        so = sched.schedule()
        sched.after_launch(so)
        sched.update_from_output(so, _output(so, {rid: np.ones(4, np.float32)}))
        seen.append((so.kv_unread, so.num_scheduled_tokens[rid]))
    assert seen == [(True, 8), (False, 8), (False, 1)]  # the third: two blocks from the cache
    assert kv.prefix_cache_stats.hits == 8


def test_every_prompt_cached_with_the_skip_off_or_behind_other_readers(monkeypatch) -> None:
    """``SKIP_UNREAD_KV`` off, or with pipeline batches in flight (another reader behind the
    step): a pooling prompt's step is not ``kv_unread`` and its blocks are cached at once."""
    from pagoda.scheduler import scheduler as mod

    for skip, batch_queue in [(False, False), (True, True)]:
        monkeypatch.setattr(mod, "SKIP_UNREAD_KV", skip)
        sched = _scheduler(batch_queue=batch_queue)
        sched.add_request(_pooling("p", 8))
        so = sched.schedule()
        assert not so.kv_unread
        sched.after_launch(so)
        sched.update_from_output(so, _output(so, {"p": np.ones(4, np.float32)}))
        assert "p" not in sched.requests
        sched.add_request(_pooling("q", 9))
        assert sched.schedule().num_scheduled_tokens == {"q": 1}, (skip, batch_queue)


def test_the_manager_admits_a_prompt_on_its_first_blocks_second_sighting() -> None:
    kv = KVCacheManager(2, BS, True, 64)  # remembers two sightings
    a, b, c = (_pooling(r, 8, first=f) for r, f in [("a", 100), ("b", 200), ("c", 300)])
    assert not kv.admits_pooled_prompt(a) and not kv.admits_pooled_prompt(b)
    assert kv.admits_pooled_prompt(_pooling("a2", 5, first=100))  # the same first block
    # (admitted, a's sighting is spent: a third request of it is a first sighting again)
    assert not kv.admits_pooled_prompt(c) and not kv.admits_pooled_prompt(_pooling("a3", 8))
    assert not kv.admits_pooled_prompt(_pooling("b2", 8, first=200))  # forgotten: c, a since
    assert not kv.admits_pooled_prompt(_pooling("short", BS - 1))  # no full block
    assert not kv.admits_pooled_prompt(_pooling("short", BS - 1))
    off = KVCacheManager(8, BS, False, 64)
    assert not off.admits_pooled_prompt(a) and not off.admits_pooled_prompt(a)


@pytest.mark.parametrize("aborted", [False, True])
def test_an_ended_request_is_released_once_whatever_comes_first(aborted: bool) -> None:
    sched = _scheduler()
    kv = sched.kv_cache_manager
    free = kv.block_pool.get_num_free_blocks()
    sched.add_request(_pooling("p", 8))
    so = sched.schedule()
    sched.after_launch(so)
    if aborted:  # (an abort between the launch and the output: the output is dropped)
        sched.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so, _output(so, {"p": np.ones(4, np.float32)}))
    assert [o.request_id for o in outs] == ([] if aborted else ["p"])
    assert kv.block_pool.get_num_free_blocks() == free
    assert not sched.has_unfinished_requests()


def test_with_batches_in_flight_blocks_go_back_with_the_output() -> None:
    sched = _scheduler(batch_queue=True)
    kv = sched.kv_cache_manager
    sched.add_request(_pooling("p", 8))
    so = sched.schedule()
    sched.after_launch(so)
    assert kv.num_held_blocks("p") == 2
    sched.update_from_output(so, _output(so, {"p": np.ones(4, np.float32)}))
    assert kv.num_held_blocks("p") == 0
