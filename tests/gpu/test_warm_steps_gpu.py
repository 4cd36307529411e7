"""On a GPU with the Triton attention backend: once an engine has started, prompts whose prefix
the cache holds (uncached tails of 1 to 130 tokens, each a launch of its own class) and their
decodes compile no attention kernel; with the start-up's steps over a cached context left out
(``pagoda.worker.warm_steps.QUERY_LENS`` emptied), the same prompts compile some, the failure
this guards against (0.5 s of a request's time for each). Each engine runs in a process of its
own: Triton keeps what one compiled for the next in the process (and on disk, which its compile
hook reports as well)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "smollm2-135m"

_SCRIPT = r"""
import json, sys
import numpy as np
import pagoda.worker.warm_steps as warm_steps
from pagoda import LLM, SamplingParams
from pagoda.bench.device import KernelCompiles

if sys.argv[2] == "off":
    warm_steps.QUERY_LENS = ()
llm = LLM(model=sys.argv[1], load_format="dummy", dtype="bfloat16", attention_backend="triton",
          max_model_len=4096, kv_cache_memory_bytes=1 << 30)
rng = np.random.default_rng(0)
prefix = rng.integers(10, 40000, 1200).tolist()
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
llm.generate({"prompt_token_ids": prefix}, greedy)  # (a fresh prompt: the start-up ran those)
with KernelCompiles() as compiles:
    for tail in (1, 3, 5, 9, 14, 21, 40, 130):
        prompt = prefix + rng.integers(10, 40000, tail).tolist()
        llm.generate({"prompt_token_ids": prompt}, greedy)
print("COMPILES " + json.dumps([d["kernel"] for d in compiles.details]))
"""


def _compiles(mode: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(CONFIG), mode],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("COMPILES ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("COMPILES "))


def test_steps_over_a_cached_context_compile_nothing_after_start_up() -> None:
    assert _compiles("on") == []


def test_without_the_start_up_steps_they_compile() -> None:
    assert "_paged_attention" in _compiles("off")


def test_the_lm_head_is_warmed_for_every_row_count_a_verification_may_score() -> None:
    # (SmolLM2's LM head: every count up to 256 requests of k + 1 rows fits the arithmetic cap)
    from pagoda import LLM

    llm = LLM(model=str(CONFIG), load_format="dummy", dtype="bfloat16", max_model_len=1024,
              kv_cache_memory_bytes=1 << 30, speculative={"method": "ngram"})  # fmt: skip
    runner = llm.engine.engine_core.executor.worker.model_runner
    k = runner.spec.num_spec_tokens
    assert k >= 1
    assert runner.logits_rows_warmed == min(runner.max_num_tokens, runner.max_num_reqs * (k + 1))
    assert runner.startup_times["warm_logits_s"] > 0
