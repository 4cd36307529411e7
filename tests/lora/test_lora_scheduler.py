"""The scheduler's LoRA limit: no step runs more distinct adapters than ``lora.max_loras``; a
request whose adapter has no slot waits while those behind it go ahead, and runs once a slot
is free."""

from __future__ import annotations

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.lora_request import LoRARequest
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import ModelRunnerOutput

LORAS = [None] + [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3)]


def _run(max_loras: int | None, order: list[int]) -> list[set[str | None]]:
    """Each step's distinct adapters (None: the base model), until every request ends."""
    kv = KVCacheManager(256, 16, True, 512)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8), CacheConfig(block_size=16), kv, 512, max_loras=max_loras
    )
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, which in enumerate(order):
        sched.add_request(Request(f"r{i}", [1, 2, 3, 4 + i], sp, lora_request=LORAS[which]))
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        by_id = {r.req_id: r.lora_request for r in out.scheduled_new_reqs}
        names = {sched.requests[r].lora_name for r in ids}
        assert all(by_id[r] == sched.requests[r].lora_request for r in by_id)
        steps.append(names)
        sched.update_from_output(out, ModelRunnerOutput(ids, [[7] for _ in ids]))
    return steps


def test_no_step_runs_more_adapters_than_slots() -> None:
    order = [1, 2, 1, 3, 0, 2, 3, 0]
    steps = _run(2, order)
    assert max(len(s - {None}) for s in steps) == 2
    assert {n for s in steps for n in s} == {None, "a1", "a2", "a3"}  # all of them ran
    # Without the limit, the first step runs all three adapters at once.
    assert len(_run(None, order)[0] - {None}) == 3


def test_a_request_without_a_slot_waits_and_those_behind_it_go_ahead() -> None:
    steps = _run(1, [1, 2, 0, 1])
    assert steps[0] == {"a1", None}  # a2 waits; the base-model request and a1's second go
    assert "a2" in set().union(*steps[1:]) and all(len(s - {None}) <= 1 for s in steps)
