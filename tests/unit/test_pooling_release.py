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
    sched.after_launch(so)
    # The ending prompt's blocks are back (and cached); the others keep theirs.
    assert kv.num_held_blocks("whole") == 0
    assert kv.num_held_blocks("gen") == 1 and kv.num_held_blocks("chunked") == 1
    assert kv.block_pool.get_num_free_blocks() == free - 2
    assert kv.block_pool.get_cached_block(sched.requests["whole"].block_hashes[1]) is not None
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


def test_a_prefix_hit_on_the_returned_blocks_reads_them_from_the_cache() -> None:
    sched = _scheduler()
    sched.add_request(_pooling("first", 8))
    so = sched.schedule()
    sched.after_launch(so)
    sched.update_from_output(so, _output(so, {"first": np.ones(4, np.float32)}))
    sched.add_request(_pooling("again", 9))  # the same 8 tokens, then one more
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"again": 1}  # two blocks from the prefix cache
    assert sched.requests["again"].num_cached_tokens == 8


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
