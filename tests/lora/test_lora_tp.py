"""LoRA under tensor parallelism over gloo on two CPU processes: a mixed batch of base and
adapter requests gives transformers' tokens on the merged weights (each rank holds its rows of
q/k/v's and gate/up's B, its columns of o's and down's A; the row-parallel partial products join
the base's before the one all-reduce)."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.lora_request import LoRARequest

pytestmark = pytest.mark.slow

PROMPTS = [[1, 17, 301, 45, 12, 99], [1, 400, 3, 3, 250], [1, 9, 9, 120, 33, 410, 270]]


def test_two_tensor_ranks_serve_a_mixed_adapter_batch_like_transformers(lora_model) -> None:
    paths = lora_model["paths"]
    loras = [None, LoRARequest("lora-a", 1, str(paths["lora-a"])),
             LoRARequest("lora-b", 2, str(paths["lora-b"]))]  # fmt: skip
    llm = LLM(
        model=str(lora_model["base"]), tensor_parallel_size=2, executor="multiproc",
        enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32", max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
    )  # fmt: skip
    try:
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], sp, lora_request=loras, use_tqdm=False
        )
    finally:
        llm.engine.shutdown()
    for out, prompt, lora in zip(outs, PROMPTS, loras):
        ids = list(prompt)
        hf = lora_model["hf"][None if lora is None else lora.lora_name]
        with torch.inference_mode():
            for _ in range(5):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt) :], lora
