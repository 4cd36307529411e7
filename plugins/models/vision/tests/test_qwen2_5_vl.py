"""Qwen2.5-VL, native, against transformers' own generate on a tiny random model (float32):
greedy tokens and log-probabilities within 1e-4 with 1 and 3 images of different sizes, the
image tokens split over prompt chunks, a prefix-cache hit and an encoder-cache hit on a repeated
image; and the image's hash in the prefix cache's keys (two images, same text, different KV)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from vl_tiny import hf_generate, hf_model, image, prompt_ids, save

from pagoda import LLM, SamplingParams
from pagoda.multimodal_inputs import MultiModalInputs

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    hf = hf_model()
    return hf, save(hf, tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    # 16 tokens a step: the 20-token image is split over chunks; the encoder computes it whole.
    return LLM(model=str(model[1]), dtype="float32", device="cpu", max_model_len=256,
               max_num_batched_tokens=16, max_num_encoder_input_tokens=64,
               enable_prefix_caching=True, block_size=4)  # fmt: skip


IMAGES = [image(56, 84, 1), image(112, 84, 2), image(140, 112, 3)]
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)


def _check(llm: LLM, hf, prompt: dict) -> object:
    processed = llm.engine.input_processor.process(prompt)
    ref_tokens, ref_lps = hf_generate(hf, processed.prompt_token_ids, processed.mm_inputs,
                                      MAX_TOKENS)  # fmt: skip
    out = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    got = out.outputs[0]
    assert got.token_ids == ref_tokens
    for step, lps in enumerate(got.logprobs):
        for token, lp in lps.items():
            assert abs(lp.logprob - ref_lps[step, token].item()) < 1e-4, (step, token)
    return out


@pytest.mark.parametrize("num_images", [1, 3])
def test_greedy_tokens_and_logprobs_match_transformers_with_chunked_images(llm, model, num_images):
    prompt = {"prompt_token_ids": prompt_ids(num_images),
              "multi_modal_data": {"image": IMAGES[:num_images]}}  # fmt: skip
    _check(llm, model[0], prompt)


def test_repeated_image_hits_the_prefix_cache_and_the_encoder_cache(llm, model):
    prompt = {"prompt_token_ids": prompt_ids(3, text=7), "multi_modal_data": {"image": IMAGES}}
    _check(llm, model[0], prompt)
    cache = llm.engine.engine_core.scheduler.encoder_cache
    hits = cache.hits
    out = _check(llm, model[0], prompt)
    assert out.num_cached_tokens > 0
    # The prefix hit covers the images' placeholders in whole blocks; what it leaves comes
    # from the encoder outputs held since (no image is encoded again).
    assert cache.hits > hits or out.num_cached_tokens >= len(out.prompt_token_ids) - 4


def _same_text_two_images(llm: LLM) -> tuple[list[int], list[int]]:
    a, b = image(112, 84, 11), image(112, 84, 12)  # same size: the same token ids
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = [
        llm.generate([{"prompt_token_ids": prompt_ids(1, text=9),
                       "multi_modal_data": {"image": im}}], params, use_tqdm=False)[0]
        for im in (a, b)
    ]  # fmt: skip
    return outs[0].outputs[0].token_ids, outs[1].outputs[0].token_ids


def test_image_hash_keeps_two_images_with_the_same_text_apart(llm, model):
    first, second = _same_text_two_images(llm)
    b = image(112, 84, 12)
    prompt = {"prompt_token_ids": prompt_ids(1, text=9), "multi_modal_data": {"image": b}}
    processed = llm.engine.input_processor.process(prompt)
    ref, _ = hf_generate(model[0], processed.prompt_token_ids, processed.mm_inputs, 8)
    assert second == ref
    assert first != second


def test_without_the_image_hash_the_second_image_reuses_the_first_ones_kv(
    model, monkeypatch: pytest.MonkeyPatch
):
    """What the test above guards against: with the image's hash out of the block hashes, the
    second prompt's blocks are the first's and its output is the first image's."""
    monkeypatch.setattr(MultiModalInputs, "hash_keys", lambda self, start, end: [])
    llm = LLM(model=str(model[1]), dtype="float32", device="cpu", max_model_len=256,
              enable_prefix_caching=True, block_size=4)  # fmt: skip
    first, second = _same_text_two_images(llm)
    assert first == second


def test_text_only_prompt_on_the_vision_model_matches_transformers(llm, model):
    ids = prompt_ids(0, text=12)
    ref, ref_lps = hf_generate(model[0], ids, None, MAX_TOKENS)
    got = llm.generate([{"prompt_token_ids": ids}], PARAMS, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == ref
    lp = got.logprobs[0][ref[0]].logprob
    assert abs(lp - ref_lps[0, ref[0]].item()) < 1e-4
    assert torch.isfinite(ref_lps).all()


@pytest.mark.parametrize(
    ("images", "named"),
    [
        (b"\x89PNG\r\n\x1a\n broken", "cannot be decoded"),
        ([image(56, 56, 1)] * 9, "limit_mm_per_prompt['image']=8"),
        ([image(56, 56, 1)] * 2, "2 images in multi_modal_data"),
        (np.zeros((56, 56, 3), np.float32), "must be uint8"),
        ("not an image", "an image is a PIL image"),
    ],
)  # fmt: skip
def test_bad_images_are_refused_naming_the_problem_and_the_engine_goes_on(llm, images, named):
    prompt = {"prompt_token_ids": prompt_ids(1), "multi_modal_data": {"image": images}}
    with pytest.raises((ValueError, TypeError), match=re.escape(named)):
        llm.generate([prompt], PARAMS, use_tqdm=False)
    ok = {"prompt_token_ids": prompt_ids(1), "multi_modal_data": {"image": IMAGES[0]}}
    assert llm.generate([ok], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_llm_chat_takes_image_parts_as_generate_takes_multi_modal_data(llm, model, tmp_path):
    img = IMAGES[1]
    chat = [{"role": "user", "content": [{"type": "text", "text": "t50 t51 "},
                                         {"type": "image", "image": img}]}]  # fmt: skip
    got = llm.chat(chat, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    # The template's text: t3, the words, the placeholder, t4, then t5 (vl_tiny.TEMPLATE).
    ids = [3, 50, 51, 188, 190, 189, 4, 5]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": img}}
    want = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_preempted_image_requests_resume_with_transformers_tokens(model):
    """A KV cache too small for the batch: requests are preempted mid-image and recomputed; each
    still gives transformers' tokens (the encoder's outputs are held or computed again)."""
    llm = LLM(model=str(model[1]), dtype="float32", device="cpu", max_model_len=128,
              max_num_batched_tokens=24, max_num_encoder_input_tokens=64, block_size=4,
              num_gpu_blocks_override=40, enable_prefix_caching=False)  # fmt: skip
    prompts = [{"prompt_token_ids": prompt_ids(n, text=6 + i),
                "multi_modal_data": {"image": (IMAGES * 2)[i % 3 : i % 3 + n]}}
               for i, n in enumerate((1, 2, 1, 2, 1, 2))]  # fmt: skip
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.engine_core.scheduler.num_preemptions_total > 0
    for prompt, out in zip(prompts, outs):
        processed = llm.engine.input_processor.process(prompt)
        ref, _ = hf_generate(model[0], processed.prompt_token_ids, processed.mm_inputs, 10)
        assert out.outputs[0].token_ids == ref


def test_images_in_a_pooling_request_are_refused_by_name(llm):
    prompt = {"prompt_token_ids": prompt_ids(1), "multi_modal_data": {"image": IMAGES[0]}}
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.engine.input_processor.process_pooling(prompt)


def test_two_tensor_parallel_ranks_give_transformers_tokens(model):
    """The decoder split over two gloo CPU ranks (the vision tower whole on each)."""
    llm = LLM(model=str(model[1]), tensor_parallel_size=2, executor="multiproc", dtype="float32",
              device="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20,
              max_num_batched_tokens=16, max_num_encoder_input_tokens=64)  # fmt: skip
    try:
        prompt = {"prompt_token_ids": prompt_ids(2), "multi_modal_data": {"image": IMAGES[:2]}}
        processed = llm.engine.input_processor.process(prompt)
        ref, _ = hf_generate(model[0], processed.prompt_token_ids, processed.mm_inputs, 6)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == ref
    finally:
        llm.engine.shutdown()
