"""Data parallelism on CPU processes: two engine cores behind one ``AsyncLLM`` give one core's
greedy tokens and share the requests; a repeated prefix goes back to the core that cached it;
killing one core fails its requests only, and ``/health`` and ``/metrics`` say so.

One engine serves the module; the test that kills a core runs last."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from dpkit import GREEDY, PROMPTS, SETTINGS
from fastapi.testclient import TestClient

from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.core_client import EngineDeadError
from pagoda.engine.request_stream import OutputKind
from pagoda.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.slow

# Six blocks of 16 tokens and more: a prefix the prefix cache keeps.
PREFIX = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(12))


@pytest.fixture(scope="module")
def dp() -> AsyncLLM:
    engine = AsyncLLM(EngineConfig.load(overrides={**SETTINGS, "data_parallel_size": 2}))
    yield engine
    engine.shutdown()


def _final(engine: AsyncLLM, prompts: list[str], params: SamplingParams = GREEDY) -> list:
    async def one(i: int, prompt: str):
        outs = engine.generate(prompt, params, f"r{time.monotonic_ns()}-{i}",
                               output_kind=OutputKind.FINAL_ONLY)  # fmt: skip
        return [o async for o in outs][-1]

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(run())


def test_two_cores_give_one_cores_greedy_tokens_and_share_the_prompts(
    dp: AsyncLLM, one_core_tokens: list[list[int]]
) -> None:
    assert len(PROMPTS) == 32
    before = dp.client.coordinator.routed
    got = _final(dp, PROMPTS)
    assert [o.outputs[0].token_ids for o in got] == one_core_tokens
    routed = [b - a for a, b in zip(before, dp.client.coordinator.routed)]
    assert sum(routed) == 32 and min(routed) >= 12, routed  # least load: about half each


def test_a_repeated_prefix_goes_back_to_the_core_that_cached_it(dp: AsyncLLM) -> None:
    coordinator = dp.client.coordinator
    params = SamplingParams(max_tokens=1, temperature=0.0)
    before = coordinator.routed
    first = _final(dp, [PREFIX + " First question: what is rain?"], params)[0]
    holder = next(i for i, (a, b) in enumerate(zip(before, coordinator.routed)) if b > a)
    assert first.num_cached_tokens == 0
    # The holder looks busier than the other core, within the load cap: affinity still wins.
    coordinator.started(holder, 2)
    try:
        second = _final(dp, [PREFIX + " Second question: what is snow?"], params)[0]
    finally:
        coordinator.finished(holder, 2)
    assert second.num_cached_tokens >= 16 * 6, "the prefix went to the core without it"
    # Past the cap, the least loaded core takes it, prefix or not.
    coordinator.started(holder, coordinator.affinity_slack + 2)
    try:
        before = coordinator.routed
        third = _final(dp, [PREFIX + " Third question: what is hail?"], params)[0]
    finally:
        coordinator.finished(holder, coordinator.affinity_slack + 2)
    assert coordinator.routed[holder] == before[holder]
    assert third.num_cached_tokens == 0


def test_the_samples_of_one_request_stay_on_one_core(dp: AsyncLLM) -> None:
    """Samples after the first wait for its prompt's blocks: they must share its core."""
    before = dp.client.coordinator.routed
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=1)
    out = _final(dp, ["Name three colours:"], params)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 3 for c in out.outputs)
    assert sum(b - a for a, b in zip(before, dp.client.coordinator.routed)) == 1


def test_metrics_give_each_core_and_their_sum(dp: AsyncLLM) -> None:
    text = dp.metrics.render().decode()
    for engine in ("0", "1"):
        assert f'pagoda:engine_up{{engine="{engine}",model_name=' in text
        assert f'pagoda:engine_num_requests_running{{engine="{engine}"' in text
    assert "pagoda:num_requests_running{" in text
    hits = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagoda:engine_prefix_cache_hits_total{")
    ]
    assert len(hits) == 2 and sum(hits) >= 16 * 6


def test_a_killed_core_fails_its_requests_only_and_health_names_it(dp: AsyncLLM) -> None:
    """Runs last: it kills core 0."""
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    victim_pid = dp.client.pids[0]
    ended: dict[str, tuple[float, BaseException | None, int]] = {}

    async def one(rid: str, started: asyncio.Event) -> None:
        tokens = 0
        try:
            async for out in dp.generate(f"Story {rid}: once upon a time", long, rid):
                tokens = len(out.outputs[0].token_ids)
                started.set()
            ended[rid] = (time.monotonic(), None, tokens)
        except EngineDeadError as e:
            ended[rid] = (time.monotonic(), e, tokens)

    async def run() -> float:
        events = {f"k{i}": asyncio.Event() for i in range(4)}
        tasks = [asyncio.create_task(one(rid, ev)) for rid, ev in events.items()]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events.values())), 60)
        on_victim = {rid for rid in events if dp.client.core_of(rid) == 0}
        assert on_victim and len(on_victim) < 4
        os.kill(victim_pid, signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.gather(*tasks)
        # The survivor takes new requests.
        after = [o async for o in dp.generate("The survivor says", GREEDY, "after")]
        assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 6
        return killed, on_victim

    killed, on_victim = asyncio.run(run())
    for rid, (when, error, tokens) in ended.items():
        if rid in on_victim:
            assert isinstance(error, EngineDeadError) and "engine core 0" in str(error)
            assert when - killed < 10.0, (rid, when - killed)
        else:
            assert error is None and tokens == 40, (rid, error, tokens)
    with pytest.raises(EngineDeadError, match="1 of 2 engine cores stopped"):
        dp.check_health()
    http = TestClient(build_app(dp, ["smollm2"]))
    health = http.get("/health")
    assert health.status_code == 503 and "engine core 0" in health.json()["error"]["message"]
    up = {
        line.split('engine="')[1][0]: float(line.rsplit(" ", 1)[1])
        for line in http.get("/metrics").text.splitlines()
        if line.startswith("pagoda:engine_up{")
    }
    assert up == {"0": 0.0, "1": 1.0}
