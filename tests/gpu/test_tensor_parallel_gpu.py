"""On two GPUs: Llama-3.1-8B (random weights, bf16) split over two ranks gives the greedy tokens
of one GPU (first 32 tokens of 16 prompts), except at near-ties; through the multiprocess
executor and, where Ray is installed, the Ray executor."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams

from .gpu_helpers import check_same_or_near_tie

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.1-8b"
VOCAB = 128256


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(10, VOCAB - 10, int(n)).tolist() for n in rng.integers(8, 300, 16)]


@pytest.fixture(scope="module")
def weights() -> Path:
    from pagoda.bench.random_weights import ensure_random_weights

    folder, _ = ensure_random_weights(CONFIG, 0, torch.device("cuda", 0))
    return folder


@pytest.fixture(scope="module")
def reference(weights: Path):
    """One GPU, and its tokens."""
    llm = LLM(**_engine(weights, 1, "uniproc"))
    yield llm, _generate(llm)
    llm.engine.shutdown()


def _engine(weights: Path, tp: int, executor: str) -> dict:
    return dict(
        model=str(weights),
        dtype="bfloat16",
        max_model_len=1024,
        kv_cache_memory_bytes=4 << 30,
        max_num_seqs=32,
        tensor_parallel_size=tp,
        executor=executor,
    )


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("executor", ["multiproc", "ray"])
def test_two_ranks_give_one_gpus_greedy_tokens(weights: Path, reference, executor: str) -> None:
    if executor == "ray" and importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed")
    ref, want = reference
    llm = LLM(**_engine(weights, 2, executor))
    try:
        got = _generate(llm)
    finally:
        llm.engine.shutdown()
    for p, w, g in zip(_prompts(), want, got):
        assert len(g) == 32
        check_same_or_near_tie(ref, p, w, g)
    same = sum(w == g for w, g in zip(want, got))
    print(f"{executor}: {same} of 16 prompts identical for 32 tokens at TP=2")
