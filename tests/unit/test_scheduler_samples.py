"""The n > 1 samples of a prompt: the ones after the first wait until its prompt is computed,
then take its full blocks from the prefix cache (the fake runner checks every KV read)."""

from __future__ import annotations

from test_scheduler import FakeRunner, make_request, make_scheduler, prompt_of, run_to_end, step

from pagoda.request import Request, RequestStatus
from pagoda.scheduler.scheduler import Scheduler


def _samples(prompt: list[int], n: int = 3) -> list[Request]:
    reqs = [make_request(f"{i}_r", prompt, max_tokens=3) for i in range(n)]
    for req in reqs[1:]:
        req.prefill_leader = reqs[0].request_id
    return reqs


def _add(sched: Scheduler, reqs: list[Request]) -> None:
    for req in reqs:
        sched.add_request(req)


def test_samples_wait_for_the_leaders_prompt_then_hit_its_full_blocks() -> None:
    sched, runner = make_scheduler(block_size=4), FakeRunner(4)
    reqs = _samples(prompt_of(10))
    _add(sched, reqs)
    assert sched.num_waiting == 3  # parked samples still count as waiting
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"0_r": 10}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"0_r": 1, "1_r": 2, "2_r": 2}  # 8 of 10 from the cache
    assert [r.num_cached_tokens for r in reqs] == [0, 8, 8]
    streamed = run_to_end(sched, runner)
    assert all(streamed[r.request_id][1] == ["length"] for r in reqs)
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_a_chunked_leader_releases_its_samples_only_after_its_last_chunk() -> None:
    sched, runner = make_scheduler(block_size=4, max_num_batched_tokens=8), FakeRunner(4)
    _add(sched, _samples(prompt_of(18), n=2))
    scheduled = [step(sched, runner)[0].num_scheduled_tokens for _ in range(4)]
    assert scheduled == [{"0_r": 8}, {"0_r": 8}, {"0_r": 2}, {"0_r": 1, "1_r": 2}]


def test_aborting_a_parked_sample_or_its_leader_leaves_nothing_behind() -> None:
    sched, runner = make_scheduler(block_size=4), FakeRunner(4)
    reqs = _samples(prompt_of(10))
    _add(sched, reqs)
    sched.finish_requests("1_r")
    assert reqs[1].status == RequestStatus.FINISHED_ABORTED and sched.num_waiting == 2
    sched.finish_requests("0_r")  # before its prompt ran: the last sample computes its own
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"2_r": 10}
    run_to_end(sched, runner)
    assert not sched.has_unfinished_requests() and not sched.parked
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_without_prefix_caching_samples_do_not_wait() -> None:
    sched, runner = make_scheduler(block_size=4, caching=False), FakeRunner(4)
    _add(sched, _samples(prompt_of(10)))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"0_r": 10, "1_r": 10, "2_r": 10}
