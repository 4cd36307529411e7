"""End-to-end behaviour of the engine on SmolLM2: prefix caching, stopping, inputs, errors."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=2048)


def _record_schedules(llm: LLM) -> list[dict[str, int]]:
    """Wrap the scheduler so each step's scheduled token counts are kept."""
    scheduler = llm.engine.engine_core.scheduler
    seen: list[dict[str, int]] = []
    original = scheduler.schedule

    def schedule():
        out = original()
        seen.append(dict(out.num_scheduled_tokens))
        return out

    scheduler.schedule = schedule
    return seen


def _all_blocks_free(llm: LLM) -> bool:
    core = llm.engine.engine_core
    return core.kv_cache_manager.num_free_blocks == core.num_blocks - 1


def test_prefix_cache_hit_computes_only_tokens_after_cached_blocks(smollm2_tokenizer) -> None:
    prefix = list(range(1000, 1500))  # 500 tokens: 31 full blocks of 16 = 496 cached tokens
    first = {"prompt_token_ids": prefix + [7, 8, 9]}
    second = {"prompt_token_ids": prefix + list(range(2000, 2020))}
    cached = LLM(max_model_len=2048)
    cached.generate(first, GREEDY)
    steps = _record_schedules(cached)
    out = cached.generate(second, GREEDY)[0]
    assert steps[0][out.request_id] == 520 - 496
    assert out.num_cached_tokens == 496

    uncached = LLM(max_model_len=2048, enable_prefix_caching=False)
    uncached.generate(first, GREEDY)
    steps = _record_schedules(uncached)
    want = uncached.generate(second, GREEDY)[0]
    assert steps[0][want.request_id] == 520
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_new_prompt_is_hashed_while_its_first_step_runs(llm: LLM) -> None:
    """The schedule hashes a new prompt's blocks only as far as its prefix-cache hit; the engine
    hashes the rest once it has launched the step, before it reads any output."""
    engine = llm.engine
    scheduler = engine.engine_core.scheduler
    seen: list[int] = []
    launch = engine.engine_core.executor.launch

    def launched(so):
        seen.append(len(scheduler.requests["hashed"].block_hashes))
        return launch(so)

    engine.engine_core.executor.launch = launched
    try:
        engine.add_request("hashed", {"prompt_token_ids": list(range(3000, 3100))}, GREEDY)
        engine.step()
        assert seen == [1]  # 100 tokens, 6 full blocks of 16: the lookup hashed the first
        assert len(scheduler.requests["hashed"].block_hashes) == 6
    finally:
        engine.engine_core.executor.launch = launch
        engine.abort_request(["hashed"])
        while engine.has_unfinished_requests():
            engine.step()
    assert _all_blocks_free(llm)


def test_stop_string_is_cut_from_text_unless_asked_to_keep_it(llm: LLM) -> None:
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = llm.generate(prompt, GREEDY)[0].outputs[0].text
    stop = full.strip()[:2]
    assert stop, full
    cut = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0]
    idx = full.index(stop)
    assert cut.outputs[0].text == full[:idx]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    kept = llm.generate(
        prompt,
        SamplingParams(max_tokens=16, temperature=0, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.outputs[0].text == full[: idx + len(stop)]
    assert _all_blocks_free(llm)


def test_stop_token_ids_and_max_tokens_set_finish_reasons(llm: LLM) -> None:
    prompt = "The quick brown fox"
    full = llm.generate(prompt, GREEDY)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    stop_id = full.token_ids[3]
    out = llm.generate(
        prompt, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_id])
    )[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Say only the word: yes"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=64, temperature=0))[0].outputs[0]
    eos = llm.get_tokenizer().eos_token_id
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and out.stop_reason is None
    ignored = llm.chat(msgs, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert len(ignored.outputs[0].token_ids) == 40
    assert ignored.outputs[0].finish_reason == "length"


def test_chat_answers_the_capital_of_france(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.outputs[0].text


def test_generate_takes_text_token_ids_and_per_prompt_params(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time")
    outs = llm.generate(
        ["Once upon a time", {"prompt_token_ids": ids}],
        [GREEDY, SamplingParams(max_tokens=4, temperature=0)],
    )
    assert outs[0].prompt == "Once upon a time" and outs[0].prompt_token_ids == ids
    assert outs[1].prompt is None and outs[1].prompt_token_ids == ids
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids[:4]
    assert outs[0].finished and outs[0].outputs[0].text == tok.decode(
        outs[0].outputs[0].token_ids, skip_special_tokens=True
    )
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["a", "b"], [GREEDY] * 3)


def test_seeded_sampling_repeats_and_differs_by_seed(llm: LLM) -> None:
    def sample(seed: int, batch_with: list[str]) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=seed)
        others = SamplingParams(max_tokens=5, temperature=1.0)
        outs = llm.generate(batch_with + ["Tell me a story"], [others] * len(batch_with) + [params])
        return outs[-1].outputs[0].token_ids

    a = sample(3, [])
    assert sample(3, ["Hello there", "Other prompt in the batch"]) == a
    assert sample(4, []) != a


def test_bad_prompts_raise_clear_errors_and_leave_the_engine_working(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2048"):
        llm.generate({"prompt_token_ids": [5] * 2048}, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 49152\)"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, GREEDY)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([42], GREEDY)  # type: ignore[list-item]
    # A batch with one bad prompt is refused whole, and nothing of it stays in the engine.
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": []}], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hello", GREEDY)[0].outputs[0].token_ids
    assert _all_blocks_free(llm)


def test_logprobs_beyond_max_logprobs_are_refused_unless_the_limit_is_lifted(llm: LLM) -> None:
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{field}=21: more than model.max_logprobs=20"):
            llm.generate("Hello", SamplingParams(max_tokens=2, **{field: 21}))
    assert not llm.engine.has_unfinished_requests()
    within = SamplingParams(max_tokens=2, temperature=0.0, logprobs=20)
    assert all(len(pos) >= 20 for pos in llm.generate("Hello", within)[0].outputs[0].logprobs)
    assert _all_blocks_free(llm)
    unlimited = LLM(max_model_len=256, max_logprobs=-1)
    wide = SamplingParams(max_tokens=2, temperature=0.0, logprobs=64, prompt_logprobs=64)
    out = unlimited.generate("Hello there", wide)[0]
    # The top 64 of each position, and the chosen token where it is not among them.
    assert len(out.outputs[0].logprobs) == 2
    assert all(len(pos) in (64, 65) for pos in out.outputs[0].logprobs)
    assert all(len(pos) in (64, 65) for pos in out.prompt_logprobs[1:])


def test_a_batch_past_max_waiting_requests_is_refused_whole() -> None:
    from pagoda.plugins import RequestRejectedError

    small = LLM(max_model_len=256, max_waiting_requests=2)
    with pytest.raises(RequestRejectedError, match="max_waiting_requests=2"):
        small.generate(["one", "two", "three"], GREEDY)
    assert not small.engine.has_unfinished_requests()
    assert not small.engine.output_processor.has_unfinished()
    assert _all_blocks_free(small)
    # The samples of an admitted request all come in, past the limit or not.
    outs = small.generate("one", SamplingParams(n=3, max_tokens=2, temperature=0.8))
    assert len(outs[0].outputs) == 3


def test_abort_returns_every_block(llm: LLM) -> None:
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"abort-{i}", "A long story about " * (i + 1), GREEDY)
    engine.step()
    engine.step()
    engine.abort_request(["abort-0", "abort-1", "abort-2"])
    engine.step()  # the runner learns of the aborts
    assert not engine.has_unfinished_requests()
    assert _all_blocks_free(llm)


def test_final_only_steps_return_finished_requests_whole(llm: LLM) -> None:
    """A request added with ``final_only`` (as ``LLM.generate`` and the server's non-streaming
    requests add theirs) gets no output while it runs, and the finished one is whole: the same
    tokens and text as the last output of the same request with every output built."""
    engine = llm.engine
    prompts = {"a": "The capital of France is", "b": "Once upon a time"}
    params = {"a": SamplingParams(max_tokens=3, temperature=0.0), "b": GREEDY}

    def run(tag: str, final_only: bool) -> dict[str, list]:
        seen: dict[str, list] = {f"{tag}{k}": [] for k in prompts}
        for k, prompt in prompts.items():
            engine.add_request(f"{tag}{k}", prompt, params[k], final_only=final_only)
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out)
        return seen

    final, every = run("final-", True), run("every-", False)
    assert [len(v) for v in final.values()] == [1, 1]
    assert all(v[0].finished for v in final.values())
    # Built every step: one output for each step that added a token, the last one finished.
    assert [len(o.outputs[0].token_ids) for o in every["every-a"]] == [1, 2, 3]
    for k in prompts:
        got, ref = final[f"final-{k}"][0].outputs[0], every[f"every-{k}"][-1].outputs[0]
        assert got.token_ids == ref.token_ids and got.text == ref.text
        assert got.finish_reason == ref.finish_reason == "length"
