"""LoRA on a GPU: the SGMV and BGMV Triton kernels against the torch reference (bfloat16 and
float32, Qwen3-0.6B's q/k/v projection, ranks 8 to 64, prompt segments and decode rows with and
without adapters); a LoRA layer's BGMV captured in a CUDA graph replays with other slots; an
engine's decode graphs, captured with the LoRA path, replay a batch of base-model and adapter
requests with transformers' merged tokens and the eager engine's. Each decode kernel of
``pagoda.ops.lora.DECODE_KERNELS`` runs every decode case (``folded``: its expand over a shrink
computed apart, as the stacked GEMM gives it; in the engine, the wrapped layers' own GEMM)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.lora_request import LoRARequest
from pagoda.ops import lora as ops

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
import lorakit  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Qwen3-0.6B's attention: 1024 inputs, q 2048 | k 1024 | v 1024 outputs.
HIDDEN, SIZES, SLOTS = 1024, (2048, 1024, 1024), 8
BOUNDS = (SIZES[0], SIZES[0] + SIZES[1])
TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def _weights(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(rank)
    a = torch.randn(SLOTS, 3 * rank, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5
    b = torch.randn(SLOTS, sum(SIZES), rank, generator=g, device="cuda") * rank**-0.5
    return a.to(dtype), b.to(dtype)


def _batch(lengths: list[int], slots: list[int], rows: bool) -> ops.LoRABatch:
    qsl = np.concatenate([[0], np.cumsum(lengths)])
    token_slots = torch.tensor(np.repeat(slots, lengths), dtype=torch.int32, device="cuda")
    segments = [(int(qsl[i]), int(qsl[i + 1]), s) for i, s in enumerate(slots) if s >= 0]
    order, starts = ops.sort_rows(np.repeat(slots, lengths).astype(np.int32), SLOTS)
    return ops.LoRABatch(
        token_slots,
        torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        torch.tensor(slots, dtype=torch.int32, device="cuda"),
        max(lengths),
        segments,
        use_rows=rows,
        sorted_rows=torch.tensor(order, device="cuda"),
        slot_starts=torch.tensor(starts, device="cuda"),
    )


def _reference(x, a, b, batch, out) -> torch.Tensor:
    """The torch reference of shrink, then expand slice by slice, in float32."""
    want = out.float().clone()
    y = ops.sgmv_shrink_reference(x, a, batch.segments)
    r = b.shape[2]
    edges = (0, *BOUNDS, b.shape[1])
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        ops.sgmv_expand_reference(y, b[:, lo:hi].float(), batch.segments, want[:, lo:hi], i * r)
    return want


def _run(x, a, b, batch, out, kernel: str = "bgmv") -> torch.Tensor:
    if kernel == "folded":
        # The stacked GEMM's output, as ``LoRALinear`` gets it: the base columns (``out``),
        # then every slot's shrink in the weights' dtype; the engine's expand adds into the
        # base columns.
        n = out.shape[1]
        y = torch.cat([out, x @ a.reshape(-1, x.shape[1]).T], dim=1)
        ops.expand_folded(y, n, b, batch, BOUNDS, a.shape[1])
        return y[:, :n]
    got = out.clone()
    ops.add_lora(x, a, b, batch, got, BOUNDS, kernel=kernel)
    return got


def _check(got: torch.Tensor, want: torch.Tensor, out: torch.Tensor, batch, dtype) -> None:
    tol = TOL[dtype]
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    base = batch.token_slots < 0  # base-model rows: untouched, bit for bit
    assert torch.equal(got[base], out[base])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_sgmv_matches_the_torch_reference_on_prompt_segments(rank: int, dtype) -> None:
    a, b = _weights(rank, dtype)
    lengths = [1, 513, 7, 64, 3, 200]
    slots = [0, 3, -1, 7, 3, 5]
    batch = _batch(lengths, slots, rows=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(sum(lengths), HIDDEN, generator=g, device="cuda").to(dtype)
    out = torch.randn(sum(lengths), sum(SIZES), generator=g, device="cuda").to(dtype)
    _check(_run(x, a, b, batch, out), _reference(x, a, b, batch, out), out, batch, dtype)


@pytest.mark.parametrize("kernel", ops.DECODE_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_decode_kernels_match_the_torch_reference_on_decode_rows(
    tokens: int, rank: int, dtype, kernel: str
) -> None:
    a, b = _weights(rank, dtype)
    rng = np.random.default_rng(tokens)
    slots = rng.integers(-1, SLOTS, tokens).tolist()  # -1: base-model rows among them
    batch = _batch([1] * tokens, slots, rows=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(dtype)
    out = torch.randn(tokens, sum(SIZES), generator=g, device="cuda").to(dtype)
    want = _reference(x, a, b, batch, out)
    _check(_run(x, a, b, batch, out, kernel), want, out, batch, dtype)
    # The row reference (what a CPU runs for rows) agrees too.
    ref = out.float().clone()
    y = ops.bgmv_shrink_reference(x, a, batch.token_slots)
    edges = (0, *BOUNDS, b.shape[1])
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        ops.bgmv_expand_reference(y, b[:, lo:hi], batch.token_slots, ref[:, lo:hi], i * rank)
    torch.testing.assert_close(ref, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kernel", ops.DECODE_KERNELS)
def test_decode_kernels_in_a_cuda_graph_replay_with_new_slots(kernel: str) -> None:
    """Captured once with every row on the base model, replayed with slots (and fused-slots'
    rows grouped by slot) written into the same buffers: the adapters' products, as the eager
    kernels give them."""
    dtype, rank, tokens = torch.bfloat16, 16, 32
    a, b = _weights(rank, dtype)
    batch = _batch([1] * tokens, [-1] * tokens, rows=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(dtype)
    out = torch.randn(tokens, sum(SIZES), generator=g, device="cuda").to(dtype)
    _run(x, a, b, batch, out, kernel)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(x, a, b, batch, out, kernel)
    for seed in range(3):
        slots = np.random.default_rng(seed).integers(-1, SLOTS, tokens).astype(np.int32)
        batch.token_slots.copy_(torch.from_numpy(slots))
        order, starts = ops.sort_rows(slots, SLOTS)
        batch.sorted_rows.copy_(torch.from_numpy(order))
        batch.slot_starts.copy_(torch.from_numpy(starts))
        graph.replay()
        eager = _run(x, a, b, batch, out, kernel)
        assert torch.equal(captured, eager)
        rows = _batch([1] * tokens, slots.tolist(), rows=False)
        torch.testing.assert_close(
            captured.float(), _reference(x, a, b, rows, out), atol=3e-2, rtol=3e-2
        )


# ---- an engine ---------------------------------------------------------------------------------

# Bigger than the CPU tests' model, so that a step's kernels see real tile counts; float32, so
# that the graphed engine, the eager one and transformers agree token for token.
CONFIG = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 32}  # fmt: skip
PROMPTS = [[1, 17, 301, 45, 12, 99, 230, 7], [1, 400, 3, 3, 250], [1, 9, 9, 120, 33, 410],
           [1, 60, 200, 311, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 5], [1, 77, 78, 79]]  # fmt: skip
WHICH = [None, "lora-a", "lora-b", "lora-a", None, "lora-b"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> dict:
    return lorakit.build(tmp_path_factory.mktemp("lora-gpu"), CONFIG)


def _generate(kit: dict, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        model=str(kit["base"]), dtype="float32", enable_lora=True, max_loras=2,
        max_lora_rank=16, max_model_len=256, kv_cache_memory_bytes=256 << 20,
        max_num_seqs=8, attention_backend="triton", **kw,
    )  # fmt: skip
    loras = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(kit["paths"].items())}
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        lora_request=[None if w is None else loras[w] for w in WHICH],
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("kernel", ops.DECODE_KERNELS)
def test_decode_graphs_replay_mixed_adapters_with_transformers_tokens(
    kit, kernel: str, monkeypatch
) -> None:
    pytest.importorskip("pagoda_attention_triton")
    monkeypatch.setattr(ops, "DECODE_KERNEL", kernel)  # (the engine runs in this process)
    got, llm = _generate(kit)
    runner = llm.engine.engine_core.executor.worker.model_runner
    try:
        assert runner.decode_graphs is not None and runner.lora is not None
        assert runner.decode_graphs.replays >= 10  # the decode steps of the mixed batch
    finally:
        llm.engine.shutdown()
    del llm, runner
    for tokens, prompt, name in zip(got, PROMPTS, WHICH):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(12):
                ids.append(int(kit["hf"][name](torch.tensor([ids])).logits[0, -1].argmax()))
        assert tokens == ids[len(prompt) :], name
    assert got[1] != got[0] or got[2] != got[0]  # the adapters change the output
    eager, llm = _generate(kit, enforce_eager=True)
    llm.engine.shutdown()
    assert eager == got
