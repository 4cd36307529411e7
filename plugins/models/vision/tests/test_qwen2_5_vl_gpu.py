"""Qwen2.5-VL on a GPU (skipped without CUDA): the tiny random model in float32 gives
transformers' greedy tokens with images (chunked, cached and in a batch of mixed requests),
with decode steps replayed as CUDA graphs; and the encoder cache's hits on a shared image."""

from __future__ import annotations

import pytest
import torch
from vl_tiny import hf_generate, hf_model, image, prompt_ids, save

from pagoda import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

IMAGES = [image(56, 84, 1), image(112, 84, 2), image(140, 112, 3), image(224, 224, 4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    hf = hf_model()
    return hf, save(hf, tmp_path_factory.mktemp("qwen2_5_vl_gpu"))


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model=str(model[1]), dtype="float32", device="cuda", max_model_len=512,
               max_num_batched_tokens=32, max_num_encoder_input_tokens=128,
               enable_prefix_caching=True, block_size=16,
               gpu_memory_utilization=0.3)  # fmt: skip


def test_batch_of_image_and_text_requests_matches_transformers_with_cuda_graphs(llm, model):
    hf = model[0]
    prompts = [
        {"prompt_token_ids": prompt_ids(n, text=5 + n), "multi_modal_data": {"image": IMAGES[:n]}}
        if n else {"prompt_token_ids": prompt_ids(0, text=11)}
        for n in (1, 0, 3, 4, 2)
    ]  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        processed = llm.engine.input_processor.process(prompt)
        ref, _ = hf_generate(hf, processed.prompt_token_ids, processed.mm_inputs, 12)
        assert out.outputs[0].token_ids == ref
    again = llm.generate(prompts, params, use_tqdm=False)  # prefix and encoder caches warm
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_requests_sharing_an_image_hit_the_encoder_cache(llm):
    cache = llm.engine.engine_core.scheduler.encoder_cache
    queries, hits = cache.queries, cache.hits
    shared = image(224, 224, 9)
    prompts = [{"prompt_token_ids": [20 + i] + prompt_ids(1), "multi_modal_data": {"image": shared}}
               for i in range(8)]  # fmt: skip
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert cache.queries - queries == 8
    assert cache.hits - hits == 7
