"""``AsyncLLM`` with its engine in another process: output kinds, concurrency, abort."""

from __future__ import annotations

import asyncio

import pytest

from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.request_stream import OutputKind

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM(
        EngineConfig.load(overrides={"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20})
    )
    yield engine
    engine.shutdown()
    assert not engine.client.proc.is_alive()


async def _collect(llm: AsyncLLM, prompt: str, kind: OutputKind, rid: str) -> list:
    return [out async for out in llm.generate(prompt, GREEDY, rid, output_kind=kind)]


def test_output_kinds_agree_and_many_requests_run_at_once(llm: AsyncLLM) -> None:
    prompts = [f"Item {i}: the best way to" for i in range(6)]

    async def run():
        jobs = [
            _collect(llm, p, kind, f"{kind.value}-{i}")
            for i, p in enumerate(prompts)
            for kind in OutputKind
        ]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i in range(len(prompts)):
        cumulative, delta, final = results[3 * i : 3 * i + 3]
        assert len(final) == 1 and final[0].finished
        text = final[0].outputs[0].text
        assert len(final[0].outputs[0].token_ids) == 10
        # Cumulative outputs grow to the final text; deltas add up to it.
        texts = [o.outputs[0].text for o in cumulative]
        assert texts[-1] == text and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert "".join(o.outputs[0].text for o in delta) == text
        assert sum(len(o.outputs[0].token_ids) for o in delta) == 10
        assert cumulative[-1].finished and delta[-1].finished


def test_leaving_a_stream_early_aborts_it_and_frees_its_blocks(llm: AsyncLLM) -> None:
    async def run() -> tuple[int, int]:
        free_before = await llm.num_free_blocks()
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        outputs = llm.generate("Once upon a time", params, "leaver")
        async for out in outputs:
            assert not out.finished
            break
        await outputs.aclose()
        assert llm.num_running_requests == 0
        for _ in range(100):  # the abort reaches the engine process asynchronously
            free_after = await llm.num_free_blocks()
            if free_after == free_before:
                break
            await asyncio.sleep(0.05)
        return free_before, free_after

    free_before, free_after = asyncio.run(run())
    assert free_after == free_before


def test_cancelled_task_and_explicit_abort_free_their_requests(llm: AsyncLLM) -> None:
    async def run() -> int:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(_consume(llm.generate("Tell me", params, "cancelled")))
        stream = llm.add_request("aborted", "Tell me more", params)
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        llm.abort("aborted")
        assert stream.finished is False and llm.num_running_requests == 0
        await asyncio.sleep(0.5)
        return await llm.num_free_blocks()

    free = asyncio.run(run())
    assert free == llm.client.num_blocks - 1


async def _consume(outputs) -> None:
    async for _ in outputs:
        pass


def test_bad_input_raises_before_reaching_the_engine(llm: AsyncLLM) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="empty"):
            await _consume(llm.generate({"prompt_token_ids": []}, GREEDY, "empty"))
        with pytest.raises(ValueError, match="vocabulary|token ids"):
            await _consume(llm.generate({"prompt_token_ids": [10**9]}, GREEDY, "oov"))
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        first = llm.generate("Hello", params, "same-id")
        await first.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await _consume(llm.generate("Hello", GREEDY, "same-id"))
        await first.aclose()

    asyncio.run(run())
    assert llm.num_running_requests == 0


def test_requests_past_max_waiting_requests_are_rejected_and_the_rest_run() -> None:
    from pagoda.entrypoints.openai.serving import error_of
    from pagoda.plugins import RequestRejectedError

    overrides = {"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
    engine = AsyncLLM(
        EngineConfig.load(overrides={**overrides, "max_num_seqs": 1, "max_waiting_requests": 1})
    )
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[BaseException, list]:
        running = engine.generate("Hello", long, "running")
        await running.__anext__()  # it holds the batch's one seat until it is closed
        # The engine takes messages in order: "waiting" waits, then "shed" finds it there.
        waiting = asyncio.create_task(_collect(engine, "Hi", OutputKind.FINAL_ONLY, "waiting"))
        await asyncio.sleep(0.05)  # the task submits its request before it first waits
        with pytest.raises(RequestRejectedError, match="max_waiting_requests=1") as shed:
            await _consume(engine.generate("Hey", GREEDY, "shed"))
        await running.aclose()  # aborted: the waiting request gets the seat
        return shed.value, await waiting

    try:
        error, waited = asyncio.run(run())
        assert len(waited[-1].outputs[0].token_ids) == GREEDY.max_tokens
        assert engine.num_running_requests == 0
        api = error_of(error)
        assert api.status == 429 and api.body()["error"]["type"] == "rate_limit_error"
    finally:
        engine.shutdown()


def test_each_step_s_tokens_reach_the_iteration_tokens_histogram(llm: AsyncLLM) -> None:
    def sample(suffix: str) -> float:
        labels = {"model_name": llm.metrics._model_name}
        value = llm.metrics.registry.get_sample_value(
            f"pagoda:iteration_tokens_total_{suffix}", labels
        )
        return value or 0.0

    prompt = {"prompt_token_ids": [4000 + 7 * i for i in range(37)]}  # nothing of it is cached
    before: list[float] = []

    async def run() -> None:
        # An aborted request's last step is read with the next step that runs (its tokens are
        # dropped): a first request takes in what earlier tests left.
        await _consume(llm.generate("Hello", GREEDY, "flush"))
        before.extend((sample("sum"), sample("count")))
        await _consume(llm.generate(prompt, GREEDY, "steps"))

    asyncio.run(run())
    # One step prefills the 37 prompt tokens and samples the first output token; each of the
    # other nine output tokens takes a step that computes the token before it.
    assert sample("sum") - before[0] == 37 + 9
    assert sample("count") - before[1] == 10


def test_prefix_cache_evictions_reach_their_counter(llm: AsyncLLM) -> None:
    labels = {"model_name": llm.metrics._model_name}

    def evicted() -> float:
        name = "pagoda:prefix_cache_evicted_blocks_total"
        return llm.metrics.registry.get_sample_value(name, labels) or 0.0

    prompts = [{"prompt_token_ids": [3000 + 11 * j + i for j in range(400)]} for i in range(8)]

    async def run() -> tuple[float, int]:
        await _consume(llm.generate("Hello", GREEDY, "flush-evictions"))
        before, free = evicted(), await llm.num_free_blocks()
        for i, prompt in enumerate(prompts):  # one after another: each frees its blocks to cache
            await _consume(llm.generate(prompt, GREEDY, f"evict-{i}"))
        return evicted() - before, free

    count, free = asyncio.run(run())
    # Each request fills 25 blocks with its prompt; past the free pool, cached ones are reused.
    assert count >= 8 * 25 - free > 0
