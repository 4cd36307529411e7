"""Batch-invariant mode on a GPU (bfloat16, CUDA graphs on): a seeded and a greedy request give
the same tokens and logprobs, bit for bit, alone, in mixed batches of several sizes, as the first
sample of n = 4, with chunked prefill on and off; random-weight Qwen3 and Llama models. The
invariant matmul and RMSNorm give a row the same bits in any batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagoda import LLM
from pagoda.ops import batch_invariant

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from invariance_helpers import check_invariance, write_config  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPT = list(range(1000, 1150))  # 150 tokens: three key tiles, several prefill chunks
OTHERS = [list(range(3000 + 11 * i, 3040 + 37 * i)) for i in range(12)]


@pytest.fixture(autouse=True)
def _setup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Random weights of a trained model's scale: +-1e-3 gives flat logits.
    monkeypatch.setattr("pagoda.loader.weights.DUMMY_RANGE", 0.05)
    yield
    batch_invariant.set_batch_invariant(False)


def _engine(model: Path, invariant: bool):  # noqa: ANN202
    def make(chunked: bool) -> LLM:
        sched = (
            {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}
            if chunked
            else {"enable_chunked_prefill": False}
        )
        return LLM(
            model=str(model),
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=512,
            kv_cache_memory_bytes=256 << 20,
            max_num_seqs=64,
            batch_invariant=invariant,
            **sched,
        )

    return make


@pytest.mark.parametrize("base", ["qwen3-0.6b", "smollm2-135m"])
def test_request_gives_identical_tokens_and_logprobs_in_any_batch_and_chunking(
    tmp_path: Path, base: str
) -> None:
    model = write_config(tmp_path / "model", base, num_hidden_layers=4)
    bad = check_invariance(_engine(model, True), PROMPT, OTHERS, (2, 9, 40), max_tokens=12)
    assert not bad, "\n".join(bad)


def test_linear_and_rms_norm_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3072, 1024, generator=gen) * 0.03).to("cuda", torch.bfloat16)
    x = torch.randn(700, 1024, generator=gen).to("cuda", torch.bfloat16)
    nw = torch.rand(1024, generator=gen).to("cuda", torch.bfloat16)
    batch_invariant.set_batch_invariant(True)
    alone = batch_invariant.linear(x[:1], w)
    norm_alone = batch_invariant.rms_norm(x[:1], nw, 1e-6)
    for m in (2, 7, 64, 129, 256, 700):
        rows = torch.randperm(m, generator=gen).cuda()
        where = (rows == 0).nonzero()[0, 0]
        assert torch.equal(batch_invariant.linear(x[:m][rows], w)[where], alone[0]), m
        assert torch.equal(batch_invariant.rms_norm(x[:m][rows], nw, 1e-6)[where], norm_alone[0])
