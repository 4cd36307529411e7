from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput

EOS = 2


def greedy(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the context (never EOS)."""
    return 10 + (tokens[-1] * 31 + len(tokens) * 7) % 50


@dataclass
class _RunnerState:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


@dataclass
class FakeRunner:
    """Plays the model runner's side of the contract.

    It keeps per-request state only from what the scheduler sends, drops it on finished ids, and
    writes each computed token id into a fake paged KV cache. Before a step it checks that every
    earlier position a request attends to (its own or a prefix-cache hit) holds that request's
    token; writes of the step become visible only after all reads, as on a real batch.
    """

    block_size: int
    sample: Callable[[str, list[int]], int] = lambda rid, tokens: greedy(tokens)
    kv: dict[int, list[int | None]] = field(default_factory=dict)
    reqs: dict[str, _RunnerState] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for rid in out.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} re-sent without being dropped"
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.reqs[new.req_id] = _RunnerState(
                tokens, list(new.block_ids), new.num_computed_tokens
            )
        for cached in out.scheduled_cached_reqs:
            state = self.reqs[cached.req_id]
            assert state.num_computed == cached.num_computed_tokens
            state.block_ids += cached.new_block_ids
        assert set(out.num_scheduled_tokens) == {
            r.req_id for r in [*out.scheduled_new_reqs, *out.scheduled_cached_reqs]
        }
        writes = []
        for rid, n in out.num_scheduled_tokens.items():
            state = self.reqs[rid]
            start = state.num_computed
            assert n >= 1 and start + n <= len(state.tokens)
            assert 0 not in state.block_ids, "the null block was handed out"
            assert len(state.block_ids) * bs >= start + n
            for p in range(start):
                slot = self.kv.get(state.block_ids[p // bs], [None] * bs)[p % bs]
                assert slot == state.tokens[p], f"{rid}: stale KV at position {p}"
            writes += [
                (state.block_ids[p // bs], p % bs, state.tokens[p]) for p in range(start, start + n)
            ]
        for block_id, offset, token in writes:
            self.kv.setdefault(block_id, [None] * bs)[offset] = token
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            state = self.reqs[rid]
            state.num_computed += n
            new_tokens = []
            if state.num_computed == len(state.tokens):
                new_tokens.append(self.sample(rid, state.tokens))
                state.tokens.append(new_tokens[0])
            req_ids.append(rid)
            sampled.append(new_tokens)
        return ModelRunnerOutput(req_ids, sampled)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 128,
    caching: bool = True,
    **sched: object,
) -> Scheduler:
    manager = KVCacheManager(num_blocks, block_size, caching, max_model_len)
    return Scheduler(
        SchedulerConfig(**sched),  # type: ignore[arg-type]
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        manager,
        max_model_len,
    )


def make_request(
    rid: str, prompt: list[int], priority: int = 0, arrival: float = 0.0, **sp: object
) -> Request:
    sp.setdefault("max_tokens", 4)
    params = SamplingParams(**sp)  # type: ignore[arg-type]
    return Request(
        rid, list(prompt), params, eos_token_id=EOS, arrival_time=arrival, priority=priority
    )


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
    assert sched.num_running <= sched.max_num_seqs
    return out, sched.update_from_output(out, runner.execute(out))


def run_to_end(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> dict[str, list]:
    """Step until idle; returns each request's streamed tokens and finish reasons."""
    streamed: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return streamed
        _, outs = step(sched, runner)
        for o in outs:
            entry = streamed.setdefault(o.request_id, [[], []])
            entry[0] += o.new_token_ids
            if o.finished:
                entry[1].append(o.finish_reason)
    raise AssertionError("scheduler did not drain")


def reference_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(greedy(tokens))
    return tokens[len(prompt) :]


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 1000) for _ in range(n)]


# --- admission ---


def test_add_request_rejects_an_empty_prompt() -> None:
    sched = make_scheduler()
    with pytest.raises(ValueError, match="'r0'.*prompt is empty"):
        sched.add_request(make_request("r0", []))


def test_add_request_rejects_a_prompt_as_long_as_max_model_len() -> None:
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="'long'.*32 tokens.*max_model_len=32"):
        sched.add_request(make_request("long", prompt_of(32)))
    sched.add_request(make_request("ok", prompt_of(31)))
    assert sched.num_waiting == 1


def test_max_waiting_requests_sheds_new_requests_and_admits_samples_of_an_admitted_one() -> None:
    from pagoda.plugins import RequestRejectedError

    sched = make_scheduler(max_num_seqs=1, max_waiting_requests=2)
    runner = FakeRunner(block_size=4)
    sched.add_request(make_request("a", prompt_of(8, seed=1)))
    step(sched, runner)  # a runs; nothing waits
    sched.add_request(make_request("b", prompt_of(8, seed=2)))
    sched.add_request(make_request("c", prompt_of(8, seed=3)))
    with pytest.raises(RequestRejectedError, match=r"'d'.*2 requests.*max_waiting_requests=2"):
        sched.add_request(make_request("d", prompt_of(8, seed=4)))
    assert "d" not in sched.requests and sched.num_waiting == 2
    # The other samples of an admitted request (n > 1) follow their first one in.
    sample = make_request("1_c", prompt_of(8, seed=3))
    sample.prefill_leader = "c"
    sched.add_request(sample)
    assert sched.num_waiting == 3
    sched.finish_requests(["b", "1_c"])  # room again: new requests come in
    sched.add_request(make_request("e", prompt_of(8, seed=5)))
    assert sched.num_waiting == 2


def test_add_request_rejects_a_duplicate_id() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", [5]))
    with pytest.raises(ValueError, match="'r' is already"):
        sched.add_request(make_request("r", [6]))


def test_scheduler_rejects_a_kv_cache_smaller_than_max_model_len() -> None:
    with pytest.raises(ValueError, match="KV cache holds 12 tokens"):
        make_scheduler(num_blocks=4, block_size=4, max_model_len=16)


def test_scheduler_rejects_a_budget_below_max_model_len_without_chunked_prefill() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens=64"):
        make_scheduler(max_model_len=128, max_num_batched_tokens=64, enable_chunked_prefill=False)


def test_default_token_budget_depends_on_chunked_prefill() -> None:
    big = dict(num_blocks=1200, block_size=4, max_model_len=4096)
    assert make_scheduler(**big).max_num_batched_tokens == 2048
    assert make_scheduler(**big, enable_chunked_prefill=False).max_num_batched_tokens == 4096


# --- one rule: computed tokens catch up ---


def test_prompt_then_one_token_per_step_until_max_tokens() -> None:
    sched = make_scheduler()
    runner = FakeRunner(4)
    sched.add_request(make_request("a", prompt_of(10), max_tokens=3))

    out, outs = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 10}
    assert out.scheduled_new_reqs[0].block_ids == sched.kv_cache_manager.get_block_ids("a")
    assert len(outs) == 1 and len(outs[0].new_token_ids) == 1 and not outs[0].finished

    out, outs = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 10
    assert out.scheduled_cached_reqs[0].new_block_ids == []

    out, outs = step(sched, runner)
    assert outs[0].finish_reason == "length"
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


def test_decode_gets_a_new_block_id_when_it_crosses_a_block_boundary() -> None:
    sched = make_scheduler()
    runner = FakeRunner(4)
    sched.add_request(make_request("a", prompt_of(4), max_tokens=3))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert len(out.scheduled_cached_reqs[0].new_block_ids) == 1
    assert len(sched.kv_cache_manager.get_block_ids("a")) == 2


def test_a_new_prompt_is_hashed_after_its_step_is_launched_not_before() -> None:
    """The schedule hashes a new prompt only as far as its prefix-cache hit (its first block,
    a miss); ``after_launch`` (the engine's, while the step runs) hashes the rest."""
    sched = make_scheduler(max_num_batched_tokens=64)
    req = make_request("a", list(range(40)))
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 40} and len(req.block_hashes) == 1
    sched.after_launch(out)
    assert len(req.block_hashes) == 10


def test_prefix_hit_of_a_500_token_prompt_is_skipped_on_first_schedule() -> None:
    sched = make_scheduler(num_blocks=300, block_size=16, max_model_len=1024)
    runner = FakeRunner(16)
    shared = prompt_of(500, seed=1)
    sched.add_request(make_request("first", shared, max_tokens=3))
    run_to_end(sched, runner)

    second = make_request("second", shared + prompt_of(40, seed=2))
    sched.add_request(second)
    out, outs = step(sched, runner)

    hit = 500 // 16 * 16
    assert second.num_cached_tokens == hit
    assert out.scheduled_new_reqs[0].num_computed_tokens == hit
    assert out.num_scheduled_tokens == {"second": 540 - hit}
    assert outs[0].num_cached_tokens == hit


@pytest.mark.parametrize(("prompt_len", "expected_tokens"), [(64, 4), (65, 1)])
def test_fully_cached_prompt_still_computes_at_least_its_last_token(
    prompt_len: int, expected_tokens: int
) -> None:
    sched = make_scheduler()
    runner = FakeRunner(4)
    prompt = prompt_of(prompt_len)
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_end(sched, runner)

    sched.add_request(make_request("b", prompt, max_tokens=1))
    out, outs = step(sched, runner)
    assert out.num_scheduled_tokens == {"b": expected_tokens}
    assert outs[0].new_token_ids == reference_output(prompt, 1)


def test_chunked_prefill_splits_a_long_prompt_while_decodes_continue() -> None:
    sched = make_scheduler(num_blocks=80, max_num_batched_tokens=64, max_model_len=256)
    runner = FakeRunner(4)
    sched.add_request(make_request("short", prompt_of(10), max_tokens=20))
    step(sched, runner)
    sched.add_request(make_request("long", prompt_of(200, seed=3), max_tokens=2))

    chunks = []
    for _ in range(4):
        out, outs = step(sched, runner)
        assert out.num_scheduled_tokens["short"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
        streamed = {o.request_id for o in outs}
        assert "short" in streamed
        assert ("long" in streamed) == (sum(chunks) == 200)
    assert chunks == [63, 63, 63, 11]


def test_without_chunked_prefill_a_prompt_over_the_remaining_budget_waits() -> None:
    sched = make_scheduler(
        num_blocks=80, max_model_len=256, max_num_batched_tokens=256, enable_chunked_prefill=False
    )
    runner = FakeRunner(4)
    sched.add_request(make_request("a", prompt_of(200)))
    sched.add_request(make_request("b", prompt_of(100, seed=1)))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 200}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 100}


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(4)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt_of(5, seed=i), max_tokens=2))
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.num_waiting == 1


# --- stopping ---


def _scripted(script: dict[str, list[int]]) -> Callable[[str, list[int]], int]:
    def sample(rid: str, tokens: list[int]) -> int:
        return script[rid].pop(0)

    return sample


@pytest.mark.parametrize(
    ("sp", "script", "tokens", "reason", "stop_reason"),
    [
        ({}, [5, EOS, 6], [5, EOS], "stop", None),
        ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 6], [5, EOS, 6], "length", None),
        ({"stop_token_ids": [9]}, [5, 9, 6], [5, 9], "stop", 9),
        ({"min_tokens": 3, "stop_token_ids": [9]}, [EOS, 9, 9, 6], [EOS, 9, 9], "stop", 9),
        ({"max_tokens": 2}, [EOS, 5], [EOS], "stop", None),
        ({"max_tokens": 2}, [5, EOS], [5, EOS], "stop", None),
        ({"max_tokens": 2}, [5, 6, 7], [5, 6], "length", None),
        ({"max_tokens": None}, [5] * 10, [5] * 4, "length", None),  # max_model_len = 10
    ],
)
def test_stop_checks(
    sp: dict, script: list[int], tokens: list[int], reason: str, stop_reason: int | None
) -> None:
    sched = make_scheduler(max_model_len=10, num_blocks=8)
    runner = FakeRunner(4, sample=_scripted({"r": list(script)}))
    sched.add_request(make_request("r", prompt_of(6), **{"max_tokens": 16, **sp}))
    streamed = run_to_end(sched, runner)
    assert streamed["r"] == [tokens, [reason]]
    assert "r" not in sched.requests
    assert sched.kv_cache_manager.num_free_blocks == 7


def test_model_eos_ids_from_all_stop_token_ids_stop_unless_ignored() -> None:
    for ignore, expected in ((False, "stop"), (True, "length")):
        sched = make_scheduler()
        runner = FakeRunner(4, sample=_scripted({"r": [5, 77, 6]}))
        req = make_request("r", [1, 2, 3], max_tokens=3, ignore_eos=ignore)
        req.sampling_params.all_stop_token_ids.add(77)
        sched.add_request(req)
        assert run_to_end(sched, runner)["r"][1] == [expected]


def test_finished_request_is_reported_once_and_dropped_by_the_runner_next_step() -> None:
    sched = make_scheduler()
    runner = FakeRunner(4, sample=_scripted({"a": [EOS], "b": [5, 5, 5]}))
    sched.add_request(make_request("a", [1, 2, 3]))
    sched.add_request(make_request("b", [4, 5, 6], max_tokens=3))
    _, outs = step(sched, runner)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "stop"), ("b", None)]
    out, outs = step(sched, runner)
    assert out.finished_req_ids == {"a"}
    assert [o.request_id for o in outs] == ["b"]
    assert "a" not in runner.reqs


# --- preemption ---


def test_preempted_request_resumes_and_finishes_with_the_same_output() -> None:
    # 12 usable blocks of 4 tokens; two requests growing to 36 tokens each cannot both fit.
    sched = make_scheduler(num_blocks=13, block_size=4, max_model_len=40)
    runner = FakeRunner(4)
    prompts = {"old": prompt_of(16, seed=1), "new": prompt_of(16, seed=2)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=20))

    preempted_in: list[set[str]] = []
    resumed: list[int] = []
    streamed: dict[str, list[int]] = {"old": [], "new": []}
    while sched.has_unfinished_requests():
        out, outs = step(sched, runner)
        preempted_in.append(out.finished_req_ids)
        resumed += [len(n.output_token_ids) for n in out.scheduled_new_reqs if n.req_id == "new"]
        for o in outs:
            streamed[o.request_id] += o.new_token_ids

    assert {"new"} in preempted_in  # the newest running request is the victim under fcfs
    assert resumed[0] == 0 and any(n > 0 for n in resumed[1:])
    for rid, prompt in prompts.items():
        assert streamed[rid] == reference_output(prompt, 20)
    assert sched.kv_cache_manager.num_free_blocks == 12


def test_fcfs_preempts_the_newest_running_request_and_puts_it_first_in_line() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", prompt_of(8, seed=1)))
    sched.add_request(make_request("b", prompt_of(16, seed=2)))
    step(sched, runner)  # 6 of 6 blocks in use; "a" needs a third block next step
    sched.add_request(make_request("c", [1, 2, 3]))

    out, _ = step(sched, runner)

    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_req_ids == {"b"}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24, policy="priority")
    runner = FakeRunner(4)
    sched.add_request(make_request("a", prompt_of(8, seed=1), priority=0))
    sched.add_request(make_request("b", prompt_of(16, seed=2), priority=5))
    step(sched, runner)
    sched.add_request(make_request("c", [1, 2, 3], priority=3))  # would fit after b leaves

    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_req_ids == {"b"}

    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "c": 3}


def test_priority_preemption_of_an_earlier_running_request_keeps_scheduling_the_rest() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16, policy="priority")
    runner = FakeRunner(4)
    sched.add_request(make_request("worst", prompt_of(6), priority=9, arrival=0.0))
    step(sched, runner)
    sched.add_request(make_request("b", [1, 2, 3, 4], priority=0, arrival=1.0))
    sched.add_request(make_request("c", [5, 6, 7], priority=0, arrival=2.0))
    step(sched, runner)  # all 4 blocks in use; "b" needs a second block next step

    out, _ = step(sched, runner)

    assert out.finished_req_ids == {"worst"}
    assert out.num_scheduled_tokens == {"b": 1, "c": 1}


def test_resumed_request_gets_a_prefix_hit_on_its_own_blocks() -> None:
    sched = make_scheduler(num_blocks=13, block_size=4, max_model_len=40)
    runner = FakeRunner(4)
    a = make_request("a", prompt_of(16, seed=1), max_tokens=20)
    b = make_request("b", prompt_of(16, seed=2), max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    hits = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        hits += [n.num_computed_tokens for n in out.scheduled_new_reqs if n.req_id == "b"]
    assert b.num_preemptions >= 1
    assert len(hits) >= 2 and hits[0] == 0 and max(hits[1:]) > 0


# --- priority ---


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    sched = make_scheduler(policy="priority")
    runner = FakeRunner(4)
    for rid, prio, arrival in [("c", 2, 0.0), ("b", 0, 2.0), ("a", 0, 1.0), ("d", 1, 0.5)]:
        sched.add_request(make_request(rid, [1, 2, 3], priority=prio, arrival=arrival))
    out, _ = step(sched, runner)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a", "b", "d", "c"]


def test_fcfs_policy_admits_in_arrival_order_regardless_of_priority() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(4)
    sched.add_request(make_request("low", [1, 2], priority=5))
    sched.add_request(make_request("high", [1, 2], priority=0))
    out, _ = step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["low"]


def test_higher_priority_arrival_preempts_a_running_request_when_blocks_run_out() -> None:
    sched = make_scheduler(num_blocks=11, block_size=4, max_model_len=40, policy="priority")
    runner = FakeRunner(4)
    low = make_request("low", prompt_of(30), priority=1, arrival=0.0, max_tokens=5)
    sched.add_request(low)
    step(sched, runner)
    high = make_request("high", prompt_of(20, seed=5), priority=0, arrival=1.0, max_tokens=5)
    sched.add_request(high)

    out, _ = step(sched, runner)

    assert low.status == RequestStatus.PREEMPTED and low.num_preemptions == 1
    assert out.finished_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 20}
    streamed = run_to_end(sched, runner)
    assert streamed["low"] == [reference_output(low.prompt_token_ids, 5)[1:], ["length"]]
    assert sched.kv_cache_manager.num_free_blocks == 10


def test_higher_priority_arrival_preempts_when_max_num_seqs_is_reached() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    runner = FakeRunner(4)
    sched.add_request(make_request("low", [1, 2, 3], priority=1, arrival=0.0))
    step(sched, runner)
    sched.add_request(make_request("high", [4, 5, 6], priority=0, arrival=1.0))
    sched.add_request(make_request("same", [7, 8, 9], priority=1, arrival=2.0))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"high": 3}
    assert out.finished_req_ids == {"low"}
    assert [r.request_id for r in sched.waiting] == ["low", "same"]


@pytest.mark.parametrize("arrival", [0.0, 1.0])
def test_an_arrival_that_is_not_strictly_better_does_not_preempt(arrival: float) -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    runner = FakeRunner(4)
    sched.add_request(make_request("first", [1, 2, 3], priority=1, arrival=0.0))
    step(sched, runner)
    sched.add_request(make_request("later", [4, 5, 6], priority=1, arrival=arrival))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"first": 1}
    assert out.finished_req_ids == set()


def test_fcfs_arrival_never_preempts_a_running_request() -> None:
    sched = make_scheduler(num_blocks=11, block_size=4, max_model_len=40)
    runner = FakeRunner(4)
    sched.add_request(make_request("low", prompt_of(30), priority=1, max_tokens=5))
    step(sched, runner)
    sched.add_request(make_request("high", prompt_of(20, seed=5), priority=0, max_tokens=5))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"low": 1}
    assert sched.num_waiting == 1


# --- abort ---


def test_all_blocks_free_after_aborting_waiting_running_and_preempted_requests() -> None:
    sched = make_scheduler(num_blocks=13, block_size=4, max_model_len=40)
    runner = FakeRunner(4)
    for rid in ("r1", "r2"):
        sched.add_request(make_request(rid, prompt_of(16, seed=len(rid)), max_tokens=20))
    while not any(r.status == RequestStatus.PREEMPTED for r in sched.requests.values()):
        step(sched, runner)
    sched.add_request(make_request("w", prompt_of(8)))
    states = {rid: r.status for rid, r in sched.requests.items()}
    assert states == {
        "r1": RequestStatus.RUNNING,
        "r2": RequestStatus.PREEMPTED,
        "w": RequestStatus.WAITING,
    }

    sched.finish_requests(["w", "r2", "r1", "unknown"])

    assert sched.kv_cache_manager.num_free_blocks == 12
    assert not sched.has_unfinished_requests()
    assert sched.num_waiting == 0 and sched.num_running == 0
    assert sched.schedule().finished_req_ids >= {"w", "r1", "r2"}


def test_finish_requests_rejects_a_status_that_is_not_finished() -> None:
    sched = make_scheduler()
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests("x", RequestStatus.RUNNING)


# --- property: random workload ---


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize(("chunked", "caching"), [(True, True), (False, True), (True, False)])
def test_random_workload_respects_budgets_and_returns_every_block(
    policy: str, chunked: bool, caching: bool
) -> None:
    rng = random.Random(1234)
    max_model_len, block_size, num_blocks = 96, 4, 40
    budget = 96 if not chunked else 40
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        caching=caching,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    runner = FakeRunner(block_size)
    prefixes = [prompt_of(24, seed=s) for s in range(3)]  # shared prefixes give cache hits
    requests: dict[str, Request] = {}
    streamed: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    aborted: set[str] = set()

    t = 0
    while t < 300 or sched.has_unfinished_requests():
        if t < 300 and rng.random() < 0.3:
            rid = f"r{t}"
            prompt = rng.choice(prefixes)[: rng.randint(0, 24)] + [
                rng.randrange(100, 1000) for _ in range(rng.randint(1, 50))
            ]
            req = make_request(
                rid,
                prompt,
                priority=rng.randint(0, 3),
                arrival=float(t),
                max_tokens=rng.randint(1, 30),
            )
            requests[rid] = req
            sched.add_request(req)
        if t < 300 and rng.random() < 0.05 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            aborted.add(victim)
            sched.finish_requests(victim)
        _, outs = step(sched, runner)
        for o in outs:
            assert o.request_id not in finished, "reported after finishing"
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o.finish_reason
        t += 1
        assert t < 3000, "scheduler did not drain"

    assert sched.kv_cache_manager.num_free_blocks == num_blocks - 1
    runner.execute(sched.schedule())
    assert runner.reqs == {}
    completed = set(requests) - aborted
    assert set(finished) == completed
    assert completed and any(r.num_preemptions for r in requests.values())
    for rid in completed:
        req = requests[rid]
        expected = reference_output(req.prompt_token_ids, req.sampling_params.max_tokens or 0)
        expected = expected[: max_model_len - req.num_prompt_tokens]
        assert req.output_token_ids == expected, rid
        assert streamed[rid] == expected, rid
    if caching:
        assert any(r.num_cached_tokens > 0 for r in requests.values())
