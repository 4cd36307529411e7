"""Async scheduling (step N+1 launched before step N's output is read) gives what the
synchronous engine gives, on SmolLM2: every sampling feature, stops, preemption and aborts."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.step import ModelRunnerOutput
from pagoda.worker.step_output import StepOutput

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away, there lived a dragon who",
    "def fibonacci(n):",
    "The three primary colours are",
]


def _params() -> list[SamplingParams]:
    """One setting per prompt: greedy with EOS, a stop string, seeded sampling with penalties,
    bad words (read on the host), logprobs with prompt logprobs, min_tokens."""
    return [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, stop=["\n\n"]),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.5),
        SamplingParams(max_tokens=30, temperature=0.0, bad_words=["dragon", " the"]),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.0, min_tokens=10, repetition_penalty=1.2),
    ]


def _run(llm: LLM) -> list[tuple]:
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [sorted(d) for d in c.logprobs] if c.logprobs else None
        result.append((c.token_ids, c.text, c.finish_reason, lps, o.prompt_logprobs is not None))
    return result


def _all_blocks_free(llm: LLM) -> bool:
    core = llm.engine.engine_core
    return core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


@pytest.fixture(scope="module")
def sync_results() -> list[tuple]:
    return _run(LLM(max_model_len=1024, async_scheduling=False))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"max_num_batched_tokens": 16}, {"num_gpu_blocks_override": 8, "block_size": 16}],
    ids=["default", "chunked", "preempting"],
)
def test_async_engine_gives_the_synchronous_engines_outputs(
    sync_results: list[tuple], overrides: dict
) -> None:
    llm = LLM(max_model_len=96 if "block_size" in overrides else 1024, **overrides)
    core = llm.engine.engine_core
    assert core.async_scheduling
    launched, unread_at_read = [], []
    original_launch, original_finish = core.executor.launch, core._finish

    def launch(so):
        launched.append(so)
        return original_launch(so)

    def finish(so, pending):
        unread_at_read.append(len(launched) - len(unread_at_read))
        return original_finish(so, pending)

    core.executor.launch, core._finish = launch, finish
    got = _run(llm)
    if "block_size" in overrides:
        assert core.scheduler.num_preemptions_total > 0
    assert got == sync_results
    # Most steps' outputs are read with the next step already launched (two unread).
    assert unread_at_read.count(2) > len(unread_at_read) // 2
    assert _all_blocks_free(llm) and not core.has_unfinished_requests()


def test_a_request_ended_by_max_tokens_is_not_scheduled_again() -> None:
    llm = LLM(max_model_len=256)
    scheduler = llm.engine.engine_core.scheduler
    scheduled: list[int] = []
    original = scheduler.schedule

    def schedule():
        out = original()
        scheduled.append(out.num_scheduled_tokens.get("0", 0))
        return out

    scheduler.schedule = schedule
    out = llm.generate(
        ["Hello there"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5
    n_prompt = len(out[0].prompt_token_ids)
    # One prefill and four decodes: the token after the fifth is never computed.
    assert [n for n in scheduled if n] == [n_prompt, 1, 1, 1, 1]


def test_a_request_ended_by_eos_costs_one_dropped_token_and_frees_its_blocks() -> None:
    llm = LLM(max_model_len=256)
    core = llm.engine.engine_core
    dropped = []
    original = core._finish

    def finish(so, pending):
        out = original(so, pending)
        got = {o.request_id for o in out}
        dropped.extend(r for r in so.num_scheduled_tokens if r not in got)
        return out

    core._finish = finish
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "stop" and len(out[0].outputs[0].token_ids) > 3
    assert not core.has_unfinished_requests()
    assert llm.engine.step() == []  # reads the step launched before EOS was seen
    assert dropped == [out[0].request_id]  # the step after EOS computed a token nobody gets
    assert _all_blocks_free(llm) and not core.has_unfinished_requests()


def test_step_output_is_read_once_and_writes_sampled_ids_back() -> None:
    llm = LLM(max_model_len=256)
    runner = llm.engine.engine_core.executor.worker.model_runner
    seen: list[StepOutput] = []
    original = runner.launch

    def launch(so):
        out = original(so)
        seen.append(out)
        return out

    runner.launch = launch
    llm.generate(["Hi"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    stepped = [s for s in seen if s.sampled is not None]
    assert len(stepped) == 4 and all(s.done for s in stepped)
    first = stepped[0].get()
    assert isinstance(first, ModelRunnerOutput) and first is stepped[0].get()
    # No placeholder is left in the rows once every output was read.
    assert (runner.input_batch.token_ids[:, :64] >= 0).all()
