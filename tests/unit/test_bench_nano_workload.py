"""The nano workload is nano-vllm's own benchmark, drawn exactly as its bench.py draws it."""

from __future__ import annotations

import argparse

import pytest

from pagoda.bench.throughput import add_throughput_args
from pagoda.bench.workloads import nano_draws, resolve_workload


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_throughput_args(p)
    return p.parse_args(list(argv))


def test_nano_draws_give_nano_vllms_published_token_count() -> None:
    prompts, out_lens = nano_draws(256, seed=0)
    # 133,966 output tokens is the figure nano-vllm's benchmark reports for its workload.
    assert sum(out_lens) == 133_966
    assert len(prompts) == len(out_lens) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts)
    assert all(0 <= t <= 10_000 for p in prompts for t in p)
    # Prompts are drawn before any output length: the first prompt is the first draws of seed 0.
    assert len(prompts[0]) == 964 and prompts[0][:3] == [6311, 6890, 663]


def test_nano_preset_samples_at_0_6_without_transformers_peers() -> None:
    wl = resolve_workload(_args("--workload", "nano"), model_given=False)
    assert (wl.temperature, wl.peers, wl.draws, wl.num_prompts) == (0.6, "none", "nano", 256)
    assert wl.random_weights is not None and wl.random_weights.name == "qwen3-0.6b"
    wl = resolve_workload(_args("--workload", "nano", "--temperature", "0", "--peers", "cb"), False)
    assert (wl.temperature, wl.peers) == (0.0, "cb")
    assert resolve_workload(_args("--workload", "a"), False).peers == "all"


def test_nano_lengths_are_fixed() -> None:
    with pytest.raises(ValueError, match="nano-vllm's"):
        resolve_workload(_args("--workload", "nano", "--max-input-len", "512"), False)
