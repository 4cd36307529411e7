"""The fused MoE operator on a GPU (bfloat16): the grouped-GEMM Triton kernels against the torch
reference for 8, 64 and 128 experts, top-2 and top-8, 1 to 8,192 tokens (fewer tokens than
experts, experts that receive no token, pairs of no expert); a row's result independent of the
batch in batch-invariant mode; capture in a CUDA graph; and a MoE model's request alone and in
a batch of 64 giving identical tokens and logprobs with ``batch_invariant: true``."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from pagoda.ops import batch_invariant, fused_experts
from pagoda.ops.fused_moe import fused_experts_reference, route

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))
from invariance_helpers import check_invariance, write_config  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# A hidden size of whole K blocks, an intermediate size of partial ones (N tiles of the gate/up
# kernel and K tiles of the down kernel end mid-block).
HIDDEN, INTER = 768, 200


@cache
def _experts(num: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(num)
    w13 = torch.randn(num, 2 * INTER, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5
    w2 = torch.randn(num, HIDDEN, INTER, generator=g, device="cuda") * INTER**-0.5
    return w13.bfloat16(), w2.bfloat16()


def _tokens(n: int, num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g, device="cuda").bfloat16()
    logits = torch.randn(n, num, generator=g, device="cuda") * 2
    return x, logits


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _mode() -> None:
    yield
    batch_invariant.set_batch_invariant(False)


@pytest.mark.parametrize("n", [1, 7, 128, 1000, 8192])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("num", [8, 64, 128])
def test_kernels_match_the_reference(num: int, top_k: int, n: int) -> None:
    w13, w2 = _experts(num)
    x, logits = _tokens(n, num, seed=n + num + top_k)
    weights, ids = route(logits, top_k, "softmax", renormalize=True)
    got = fused_experts(x, w13, w2, weights, ids)
    _close(got, fused_experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("num", [64, 128])
def test_experts_with_no_token_are_never_read(num: int) -> None:
    """Only the first 16 experts are routed to, some pairs go to no expert (-1), and the other
    experts' weights are NaN: reading any of them would show in the output."""
    w13, w2 = (w.clone() for w in _experts(num))
    w13[16:], w2[16:] = float("nan"), float("nan")
    x, logits = _tokens(40, num, seed=3)
    logits[:, 16:] = float("-inf")
    weights, ids = route(logits, 8, "softmax", renormalize=False)
    ids[::3, 0] = -1
    got = fused_experts(x, w13, w2, weights, ids)
    _close(got, fused_experts_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("num", [8, 128])
def test_a_rows_result_does_not_depend_on_the_batch_in_invariant_mode(num: int) -> None:
    w13, w2 = _experts(num)
    x, logits = _tokens(700, num, seed=11)
    batch_invariant.set_batch_invariant(True)
    weights, ids = route(logits, 8 if num > 8 else 2, "softmax", renormalize=True)
    alone = fused_experts(x[:1], w13, w2, weights[:1], ids[:1])
    gen = torch.Generator().manual_seed(0)
    for m in (2, 7, 64, 129, 256, 700):
        rows = torch.randperm(m, generator=gen).cuda()
        where = int((rows == 0).nonzero()[0, 0])
        w_m, i_m = route(logits[:m][rows], ids.shape[1], "softmax", renormalize=True)
        assert torch.equal(w_m[where], weights[0]) and torch.equal(i_m[where], ids[0]), m
        got = fused_experts(x[:m][rows], w13, w2, w_m, i_m)
        assert torch.equal(got[where], alone[0]), m


def test_the_operator_replays_in_a_cuda_graph() -> None:
    w13, w2 = _experts(64)
    x, logits = _tokens(48, 64, seed=5)
    weights, ids = route(logits, 8, "softmax", renormalize=True)
    static = [t.clone() for t in (x, weights, ids)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_experts(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(static[0], w13, w2, static[1], static[2])
    x2, logits2 = _tokens(48, 64, seed=6)
    w2_, ids2 = route(logits2, 8, "softmax", renormalize=True)
    for dst, src in zip(static, (x2, w2_, ids2), strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_experts(x2, w13, w2, w2_, ids2))


PROMPT = list(range(1000, 1150))
OTHERS = [list(range(3000 + 11 * i, 3040 + 37 * i)) for i in range(12)]
QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_hidden_layers=4,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def test_moe_request_gives_identical_tokens_and_logprobs_alone_and_in_a_batch_of_64(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagoda import LLM

    # Random weights of a trained model's scale: +-1e-3 gives flat logits and flat routing.
    monkeypatch.setattr("pagoda.loader.weights.DUMMY_RANGE", 0.05)
    model = write_config(tmp_path / "model", "qwen3-0.6b", **QWEN3_MOE)

    def make(chunked: bool) -> LLM:
        sched = (
            {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}
            if chunked
            else {"enable_chunked_prefill": False}
        )
        return LLM(model=str(model), load_format="dummy", dtype="bfloat16", max_model_len=512,
                   kv_cache_memory_bytes=256 << 20, max_num_seqs=64, batch_invariant=True,
                   **sched)  # fmt: skip

    bad = check_invariance(make, PROMPT, OTHERS, (64,), max_tokens=12)
    assert not bad, "\n".join(bad)
