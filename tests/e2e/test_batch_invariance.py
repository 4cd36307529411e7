"""Batch-invariant mode on a CPU: a seeded and a greedy request give the same tokens and the same
logprobs, bit for bit, alone, in mixed batches of several sizes, as the first sample of n = 4, with
chunked prefill on and off; random-weight Llama and Qwen3 (q/k norm) models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from invariance_helpers import check_invariance, write_config

from pagoda import LLM
from pagoda.ops import batch_invariant

# Widths are multiples of 64 (the CPU row chunks' vector alignment) except where a test says.
SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=2,
    vocab_size=2048,
    max_position_embeddings=512,
)
PROMPT = list(range(100, 171))  # 71 tokens: two key tiles, several prefill chunks
OTHERS = [list(range(300 + 7 * i, 340 + 9 * i)) for i in range(6)]


def _engine(model: Path, invariant: bool) -> Callable[[bool], LLM]:
    def make(chunked: bool) -> LLM:
        sched = (
            {"enable_chunked_prefill": True, "max_num_batched_tokens": 24}
            if chunked
            else {"enable_chunked_prefill": False}
        )
        return LLM(
            model=str(model),
            load_format="dummy",
            max_model_len=160,
            kv_cache_memory_bytes=16 << 20,
            batch_invariant=invariant,
            **sched,
        )

    return make


@pytest.fixture(autouse=True)
def _setup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Random weights of a trained model's scale: the default +-1e-3 gives flat logits whose
    # last bits vanish in the logprobs.
    monkeypatch.setattr("pagoda.loader.weights.DUMMY_RANGE", 0.1)
    yield
    batch_invariant.set_batch_invariant(False)  # process-wide: leave it as other tests expect


@pytest.mark.parametrize(
    "base,changes",
    [
        ("tiny-llama", SMALL),
        ("qwen3-0.6b", {**SMALL, "num_key_value_heads": 1, "head_dim": 64}),
        # widths off the vector alignment: the row-by-row path
        ("tiny-llama", {**SMALL, "hidden_size": 96, "intermediate_size": 160, "vocab_size": 2000}),
    ],
    ids=["llama", "qwen3", "unaligned"],
)
def test_request_gives_identical_tokens_and_logprobs_in_any_batch_and_chunking(
    tmp_path: Path, base: str, changes: dict
) -> None:
    model = write_config(tmp_path / "model", base, **changes)
    bad = check_invariance(_engine(model, True), PROMPT, OTHERS, (2, 5), max_tokens=8)
    assert not bad, "\n".join(bad)


def test_without_the_mode_batches_change_the_bits(tmp_path: Path) -> None:
    """The check above can fail: without the mode, GEMM kernels chosen by the batch's row count
    change a request's logprobs."""
    model = write_config(tmp_path / "model", "tiny-llama", **SMALL)
    bad = check_invariance(_engine(model, False), PROMPT, OTHERS, (2, 5), max_tokens=8)
    assert bad


def test_linear_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(192, 128, generator=gen)
    x = torch.randn(200, 128, generator=gen)
    batch_invariant.set_batch_invariant(True)
    alone = batch_invariant.linear(x[:1], w)
    for m in (2, 3, 17, 64, 65, 200):
        rows = torch.randperm(m, generator=gen)
        y = batch_invariant.linear(torch.cat([x[:1], x[1:m]])[rows], w)
        assert torch.equal(y[(rows == 0).nonzero()[0, 0]], alone[0]), m
