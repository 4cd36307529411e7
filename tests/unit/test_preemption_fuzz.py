"""Preemption and recompute lose nothing: seeded random scenarios with a KV cache a fraction of
the workload's need, random arrivals, priorities, aborts and samples of one request (n > 1). Every
request that finishes has exactly the greedy output of the context-only fake model (what an ample
cache gives), and the block pool and prefix cache are consistent after every step."""

from __future__ import annotations

import random

import pytest
from test_scheduler import FakeRunner, make_scheduler, reference_output, step

from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.testing.kv_cache import check_kv_cache

SCENARIOS = 200
EOS = 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scenario(seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    max_model_len = 48
    chunked = rng.random() < 0.7
    caching = rng.random() < 0.8
    arrivals = []  # (step, request id, prompt, max_tokens, priority, samples)
    prefixes = [[rng.randrange(100, 1000) for _ in range(16)] for _ in range(2)]
    for i in range(rng.randint(4, 14)):
        prompt = rng.choice(prefixes)[: rng.randint(0, 16)] + [
            rng.randrange(100, 1000) for _ in range(rng.randint(1, 20))
        ]
        max_tokens = rng.randint(1, max_model_len - len(prompt))
        samples = rng.choice([1, 1, 1, 2, 3])
        arrivals.append(
            (rng.randint(0, 30), f"r{i}", prompt, max_tokens, rng.randint(0, 3), samples)
        )
    need = sum(s * _cdiv(len(p) + m, block_size) for _, _, p, m, _, s in arrivals)
    smallest = _cdiv(max_model_len, block_size) + 1
    num_blocks = max(smallest, int(need * rng.uniform(0.1, 0.5)) + 1)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        caching=caching,
        max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=max_model_len if not chunked else rng.randint(8, 64),
        enable_chunked_prefill=chunked,
        policy=rng.choice(["fcfs", "priority"]),
    )
    runner = FakeRunner(block_size)
    requests: dict[str, Request] = {}
    streamed: dict[str, list[int]] = {}
    finished: set[str] = set()
    aborted: set[str] = set()
    t = 0
    while t <= 30 or sched.has_unfinished_requests():
        for when, rid, prompt, max_tokens, priority, samples in arrivals:
            if when != t:
                continue
            for k in range(samples):
                req = Request(
                    f"{rid}-{k}",
                    list(prompt),
                    SamplingParams(max_tokens=max_tokens),
                    eos_token_id=EOS,
                    arrival_time=float(t),
                    priority=priority,
                    prefill_leader=f"{rid}-0" if k else None,
                )
                requests[req.request_id] = req
                sched.add_request(req)
        if rng.random() < 0.04 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            aborted.add(victim)
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            check_kv_cache(sched.kv_cache_manager, sched)
        _, outs = step(sched, runner)
        check_kv_cache(sched.kv_cache_manager, sched)
        for o in outs:
            assert o.request_id not in finished, f"seed {seed}: {o.request_id} reported twice"
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)
        t += 1
        assert t < 5000, f"seed {seed}: the scheduler did not drain"

    runner.execute(sched.schedule())
    assert runner.reqs == {}, f"seed {seed}: the runner still holds {runner.reqs}"
    assert sched.kv_cache_manager.num_free_blocks == num_blocks - 1, f"seed {seed}: leaked blocks"
    check_kv_cache(sched.kv_cache_manager, sched)
    assert finished == set(requests) - aborted, f"seed {seed}"
    for rid in finished:
        req = requests[rid]
        expected = reference_output(req.prompt_token_ids, req.sampling_params.max_tokens or 0)
        assert streamed[rid] == req.output_token_ids == expected, f"seed {seed}: {rid}"
    return {
        "preemptions": sum(r.num_preemptions for r in requests.values()),
        "finished": len(finished),
        "cached_tokens": sum(max(r.num_cached_tokens, 0) for r in requests.values()),
    }


def test_random_preemption_scenarios_lose_nothing_and_keep_the_cache_consistent() -> None:
    totals = [_scenario(seed) for seed in range(SCENARIOS)]
    preempted = sum(1 for s in totals if s["preemptions"])
    assert preempted >= SCENARIOS // 2, f"only {preempted} scenarios preempted anything"
    assert sum(s["finished"] for s in totals) > SCENARIOS * 4
    assert sum(1 for s in totals if s["cached_tokens"]) >= SCENARIOS // 4  # prefix hits too


def test_the_checker_catches_broken_bookkeeping() -> None:
    def running_scheduler():
        sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=32)
        runner = FakeRunner(4)
        for i in range(2):
            prompt = [100 + i] * 9
            sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=8), EOS))
        for _ in range(3):
            step(sched, runner)
        check_kv_cache(sched.kv_cache_manager, sched)
        return sched, sched.kv_cache_manager.block_pool

    def extra_reference(sched, pool):
        pool.blocks[sched.kv_cache_manager.get_block_ids("r0")[0]].ref_cnt += 1

    def lost_index_entry(sched, pool):
        pool.cached_block_hash_to_block.popitem()

    def freed_while_held(sched, pool):
        block = sched.kv_cache_manager.req_to_blocks["r1"][-1]
        block.ref_cnt = 0
        pool.free_block_queue.append(block)

    def held_by_a_waiting_request(sched, pool):
        sched.requests["r0"].status = RequestStatus.WAITING

    for corrupt in (extra_reference, lost_index_entry, freed_while_held, held_by_a_waiting_request):
        sched, pool = running_scheduler()
        corrupt(sched, pool)
        with pytest.raises(AssertionError, match="KV cache inconsistent"):
            check_kv_cache(sched.kv_cache_manager, sched)
