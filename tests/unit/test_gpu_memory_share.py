"""``cache.gpu_memory_utilization`` is each engine's own share of the device (vLLM's meaning):
what others held before the engine started is not counted against it, so two engines at 0.3
each fit one GPU. The arithmetic runs here on faked memory readings; the GPU test builds two
engines in one process."""

from __future__ import annotations

import pytest
import torch

from pagoda.worker.profile import check_gpu_share, gpu_kv_budget

GIB = 2**30
TOTAL = 140 * GIB


def test_the_second_engine_at_0_3_gets_the_same_budget_as_the_first() -> None:
    weights_and_context, activations = 2 * GIB, 1 * GIB
    # the first engine starts on an empty device and takes 0.3 of it
    first = gpu_kv_budget(0.3, TOTAL, TOTAL, TOTAL - weights_and_context, activations)
    assert first == int(0.3 * TOTAL) - 3 * GIB
    used_by_first = weights_and_context + first
    # the second starts with the first's memory already in use: its share is still 0.3
    free_at_start = TOTAL - used_by_first
    free_now = free_at_start - weights_and_context
    second = gpu_kv_budget(0.3, TOTAL, free_at_start, free_now, activations)
    assert second == first > 0
    check_gpu_share(0.3, TOTAL, free_at_start)  # 0.3 of the device is still free


def test_memory_held_before_the_start_does_not_shrink_the_share() -> None:
    other_process = 50 * GIB
    budget = gpu_kv_budget(0.5, TOTAL, TOTAL - other_process, TOTAL - other_process - GIB, GIB)
    assert budget == int(0.5 * TOTAL) - 2 * GIB


def test_decode_graphs_pool_comes_out_of_the_share() -> None:
    assert gpu_kv_budget(0.5, 100, 100, 90, 5, 3) == 50 - 10 - 5 - 3


def test_a_share_larger_than_the_free_memory_at_start_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"cache\.gpu_memory_utilization=0\.90 asks for 126\.00"):
        check_gpu_share(0.9, TOTAL, TOTAL - 40 * GIB)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_engines_at_0_3_share_one_gpu() -> None:
    from pagoda import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = LLM(gpu_memory_utilization=0.3, max_model_len=512, enforce_eager=True)
    second = LLM(gpu_memory_utilization=0.3, max_model_len=512, enforce_eager=True)
    blocks = [llm.engine.engine_core.num_blocks for llm in (first, second)]
    assert min(blocks) > 0.8 * max(blocks)  # each its own 0.3, not what the first left
    outs = [llm.generate(["Hello"], params)[0].outputs[0].token_ids for llm in (first, second)]
    assert outs[0] == outs[1]
