"""On a GPU: KV offload to pinned CPU memory, copies on their own stream. A device KV cache too
small for a set of long shared prefixes gives the same greedy output with offload on as off,
while the CPU pool serves the hits (random-weight Qwen3 shapes: fp32 exactly; bf16 with the
default backend except at near-ties), and both pools return to idle afterwards."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams

from .gpu_helpers import check_same_or_near_tie

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3-0.6B's shapes with four layers (the copies see every layer either way)."""
    folder = tmp_path_factory.mktemp("qwen3-offload")
    cfg = json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _workload(llm: LLM) -> list[list[int]]:
    """Six 384-token prefixes, each asked twice (a round apart), one request at a time; then a
    burst of every prefix at once (loads in flight while others compute)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 150_000) for _ in range(384)] for _ in range(6)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for rnd in range(2):
        for i, p in enumerate(prefixes):
            prompt = {"prompt_token_ids": p + [100 + rnd, 200 + i]}
            outs.append(llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)
    burst = [{"prompt_token_ids": p + [300, 400 + i]} for i, p in enumerate(prefixes)]
    outs += [o.outputs[0].token_ids for o in llm.generate(burst, sp, use_tqdm=False)]
    return outs


def _prompts_of_workload() -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 150_000) for _ in range(384)] for _ in range(6)]
    return [p + [100 + r, 200 + i] for r in range(2) for i, p in enumerate(prefixes)] + [
        p + [300, 400 + i] for i, p in enumerate(prefixes)
    ]


def _check_idle(llm: LLM) -> None:
    core = llm.engine.engine_core
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1 and not kv.req_to_blocks
    off = core.scheduler.offload
    if off is not None:
        assert off.idle_figures() == {
            "pinned_slots": 0, "storing_slots": 0, "jobs_in_flight": 0, "requests_loading": 0,
        }  # fmt: skip
        assert not core.executor.worker.model_runner.kv_offload._jobs


@pytest.mark.parametrize(
    ("dtype", "policy", "store"), [("float32", "lru", "evicted"), ("bfloat16", "arc", "full")]
)
def test_offload_on_cuda_gives_the_same_greedy_output_with_cpu_hits(
    qwen3_dir: Path, dtype: str, policy: str, store: str
) -> None:
    common = dict(
        model=str(qwen3_dir),
        load_format="dummy",
        dtype=dtype,
        max_model_len=512,
        # 64 blocks of 16: about two of the six prefixes.
        num_gpu_blocks_override=64,
        max_num_seqs=8,
    )
    ref = LLM(**common)
    want = _workload(ref)
    _check_idle(ref)
    llm = LLM(**common, cpu_offload_gb=0.5, offload_policy=policy, offload_store=store)
    assert llm.engine.engine_core.executor.worker.model_runner.kv_offload.cpu.is_pinned()
    got = _workload(llm)
    stats = llm.engine.engine_core.scheduler.offload.stats_total
    assert stats.loaded_blocks >= 6 * 20 and stats.cpu_hit_tokens >= 6 * 20 * 16, stats
    if dtype == "float32":
        assert got == want
    else:
        for prompt, w, g in zip(_prompts_of_workload(), want, got):
            check_same_or_near_tie(ref, prompt, w, g)
    _check_idle(llm)
