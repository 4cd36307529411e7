"""On a GPU: the fused kernels of `pagoda.ops` against the torch code at Llama-3.1-8B's and
Qwen3-0.6B's shapes in bf16, replayed from a CUDA graph, and an engine with fused ops on against one
with them off (random-weight two-layer models)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import pagoda.ops as ops
from pagoda import LLM, SamplingParams
from pagoda.attention.backend import write_kv_cache
from pagoda.config.model import ModelConfig
from pagoda.loader import ModelArchConfig
from pagoda.models.layers import RotaryEmbedding
from pagoda.ops import reference

from .gpu_helpers import check_same_or_near_tie, last_logits, scale_random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
MODELS = ["llama-3.1-8b", "qwen3-0.6b"]
BF16 = torch.bfloat16


def _arch(name: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(json.loads((CONFIGS / name / "config.json").read_text()))


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(BF16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 tolerance, and rounded like torch: a float32 intermediate computed in another
    order (a norm's sum, SiLU's exp) may flip the last bit of a rare element, no more."""
    torch.testing.assert_close(got, want)
    assert (got != want).float().mean().item() <= 0.01


def _qkv_views(tokens: int, a: ModelArchConfig):
    q_size, kv_size = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    q, k, v = _rand(tokens, q_size + 2 * kv_size, seed=3).split([q_size, kv_size, kv_size], -1)
    return (
        q.view(tokens, a.num_attention_heads, a.head_dim),
        k.view(tokens, a.num_key_value_heads, a.head_dim),
        v,
    )


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tokens", [1, 257, 8192])
def test_fused_add_rms_norm_matches_torch(name: str, tokens: int) -> None:
    from pagoda.ops.triton_norm import rms_norm_triton

    a = _arch(name)
    x, res = _rand(tokens, a.hidden_size), _rand(tokens, a.hidden_size, seed=1)
    weight = 1 + 0.1 * _rand(a.hidden_size, seed=2)
    out, new_res = rms_norm_triton(x, weight, a.rms_norm_eps, res)
    want_out, want_res = reference.rms_norm(x, weight, a.rms_norm_eps, res)
    assert torch.equal(new_res, want_res)
    _close(out, want_out)
    eps = a.rms_norm_eps
    _close(rms_norm_triton(x, weight, eps), reference.rms_norm(x, weight, eps))


@pytest.mark.parametrize("tokens", [1, 257, 8192])
def test_per_head_qk_norm_on_strided_views_matches_torch(tokens: int) -> None:
    from pagoda.ops.triton_norm import rms_norm_triton

    a = _arch("qwen3-0.6b")
    q, k, _ = _qkv_views(tokens, a)
    weight = 1 + 0.1 * _rand(a.head_dim, seed=4)
    for t in (q, k):
        _close(rms_norm_triton(t, weight, 1e-6), reference.rms_norm(t, weight, 1e-6))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tokens", [1, 257, 8192])
def test_silu_and_mul_matches_torch(name: str, tokens: int) -> None:
    from pagoda.ops.triton_activation import silu_and_mul_triton

    x = 2 * _rand(tokens, 2 * _arch(name).intermediate_size)
    _close(silu_and_mul_triton(x), reference.silu_and_mul(x))


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the fused gate/up kernel runs on Hopper",
)


@needs_hopper
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tokens", [4096, 5000])
def test_gate_up_silu_is_closer_to_exact_than_the_unfused_path(name: str, tokens: int) -> None:
    """The fused projection and activation against float64 arithmetic on the same bf16 inputs:
    within bf16 rounding of the exact result, and no farther from it than the projection then
    silu_and_mul (which round the gate and the up first). 5,000 rows: a last row tile cut short."""
    a = _arch(name)
    inter = a.intermediate_size
    x = _rand(tokens, a.hidden_size, seed=5)
    w = (_rand(2 * inter, a.hidden_size, seed=6) * a.hidden_size**-0.5).to(BF16)
    got = ops.gate_up_silu(x, w)
    assert got is not None and got.shape == (tokens, inter) and got.dtype == BF16
    y = x.double() @ w.double().T
    exact = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
    unfused = ops.silu_and_mul(ops.linear(x, w))
    err = (got.double() - exact).abs()
    # bf16 keeps 8 bits: half an ulp of each value, and a floor for values near zero.
    assert (err <= exact.abs() * 2**-8 + 1e-3).all()
    assert err.mean() <= (unfused.double() - exact).abs().mean()


@needs_hopper
@pytest.mark.parametrize("tokens", [4096, 5000])
def test_qkv_norm_rotary_kernel_is_within_bf16_rounding_of_exact(tokens: int) -> None:
    """The projection with q's and k's per-head norms and rotation in its epilogue, at Qwen3-0.6B's
    heads, against float64 arithmetic on the same bf16 inputs: each element within the bf16
    roundings of the steps that make it, and no farther from exact on average than the projection
    then qk_norm_rotary.

    A rotated element is a difference of two products, so its rounding error scales with the
    products, not with the (possibly cancelled) result: the bound is relative to
    ``|h1 cos| + |h2 sin|``. (Relative to the result, the unfused path failed it too.)"""
    from pagoda.ops.triton_qkv_norm_rotary import qkv_norm_rotary_triton

    a = _arch("qwen3-0.6b")
    qh, kvh, d, eps = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
    heads = qh + 2 * kvh
    x = _rand(tokens, a.hidden_size, seed=7)
    w = (_rand(heads * d, a.hidden_size, seed=8) * a.hidden_size**-0.5).to(BF16)
    wq, wk = 1 + 0.3 * _rand(d, seed=9), 0.5 + 0.3 * _rand(d, seed=10)
    rot = RotaryEmbedding(d, a.max_position_embeddings, a.rope_theta).cuda()
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    got = qkv_norm_rotary_triton(x, w, qh, kvh, d, wq, wk, eps, pos, rot.cos, rot.sin)
    cos, sin = rot.cos[pos].double().unsqueeze(1), rot.sin[pos].double().unsqueeze(1)
    # With a cache: the same output, and keys and values in their (shuffled) slots as the cache
    # write stores them.
    page = 16
    slots = torch.randperm(tokens // page + 8, device="cuda")[: -(-tokens // page)] * page
    slots = (slots[:, None] + torch.arange(page, device="cuda")).reshape(-1)[:tokens]
    cache = torch.zeros(2, tokens // page + 8, page, kvh, d, dtype=BF16, device="cuda")
    want_cache = torch.zeros_like(cache)
    stored = qkv_norm_rotary_triton(x, w, qh, kvh, d, wq, wk, eps, pos, rot.cos, rot.sin,
                                    kv_cache=cache, slot_mapping=slots)  # fmt: skip
    assert torch.equal(stored, got)
    _, key, value = got.split([qh * d, kvh * d, kvh * d], -1)
    write_kv_cache(key.view(tokens, kvh, d), value.view(tokens, kvh, d), want_cache, slots, tokens)
    assert torch.equal(cache, want_cache)

    def exact(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised and rotated heads, and the size of the products that make each."""
        h1, h2 = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).chunk(
            2, dim=-1
        )
        value = torch.cat((h1 * cos - h2 * sin, h2 * cos + h1 * sin), dim=-1)
        size = torch.cat(
            ((h1 * cos).abs() + (h2 * sin).abs(), (h2 * cos).abs() + (h1 * sin).abs()), dim=-1
        )
        return value, size

    y = (x.double() @ w.double().T).view(tokens, heads, d)
    (q_want, q_size), (k_want, k_size) = exact(y[:, :qh], wq), exact(y[:, qh : qh + kvh], wk)
    v = y[:, qh + kvh :]
    want = torch.cat((q_want, k_want, v), dim=1).view(tokens, -1)
    size = torch.cat((q_size, k_size, v.abs()), dim=1).view(tokens, -1)
    q, k, v = ops.linear(x, w).split([qh * d, kvh * d, kvh * d], -1)
    qn, kn = ops.qk_norm_rotary(
        pos, q.view(tokens, qh, d), k.view(tokens, kvh, d), wq, wk, eps, rot.cos, rot.sin
    )
    unfused = torch.cat((qn.reshape(tokens, -1), kn.reshape(tokens, -1), v), dim=1)
    # Five bf16 roundings (projection, norm, weight, products, sum) of 2**-9 each, and a floor
    # for elements whose products are near zero.
    bound = size * 2**-6 + 1e-3
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert ((unfused.double() - want).abs() <= bound).all()  # the bound is the roundings'
    assert err.mean() <= (unfused.double() - want).abs().mean() * 1.05


@needs_hopper
def test_gate_up_silu_leaves_small_steps_and_other_layouts_to_the_unfused_path() -> None:
    from pagoda.ops import triton_gated_gemm

    w = _rand(2 * 3072, 1024, seed=6)
    assert ops.gate_up_silu(_rand(triton_gated_gemm.MIN_ROWS - 1, 1024), w) is None
    assert ops.gate_up_silu(_rand(8192, 1024).float(), w.float()) is None  # fp32
    assert ops.gate_up_silu(_rand(8192, 2048)[:, :1024], w) is None  # not contiguous
    ops.set_fused_ops(False)
    try:
        assert ops.gate_up_silu(_rand(8192, 1024), w) is None
    finally:
        ops.set_fused_ops(True)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tokens", [1, 257, 8192])
def test_rotary_in_place_on_qkv_views_equals_torch(name: str, tokens: int) -> None:
    from pagoda.ops.triton_rotary import rotary_embedding_triton

    a = _arch(name)
    rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
    rope = rope.cuda()
    q, k, v = _qkv_views(tokens, a)
    gen = torch.Generator(device="cuda").manual_seed(5)
    positions = torch.randint(0, a.max_position_embeddings, (tokens,), generator=gen, device="cuda")
    want_q, want_k = reference.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    v0 = v.clone()
    rotary_embedding_triton(positions, q, k, rope.cos, rope.sin)
    # Same float32 operations in the same order (no fused multiply-add): bit for bit.
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, v0)


@pytest.mark.parametrize("tokens", [1, 2, 3, 64, 257, 4096])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (40, 8)])
def test_qk_norm_rotary_is_bit_identical_to_the_norms_then_the_rotation(
    tokens: int, heads: tuple[int, int]
) -> None:
    # Qwen3-0.6B's heads, Qwen3-8B's and 14B's. Greedy parity with transformers on random
    # weights breaks at one flipped bit, so the fused kernel must give exactly what the norm
    # kernel (fused multiply-adds allowed) and the rotary kernel (none) give; a one-token step of
    # fewer than 16 KV heads runs them (the norm kernel's tile follows the row count there).
    from pagoda.ops.triton_qk_norm_rotary import qk_norm_rotary_triton

    args, (want_q, want_k) = _qk_norm_rotary_case(tokens, heads)
    got_q, got_k = qk_norm_rotary_triton(*args)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def _qk_norm_rotary_case(tokens: int, heads: tuple[int, int]) -> tuple[tuple, tuple]:
    """``qk_norm_rotary_triton``'s arguments at Qwen3-0.6B's head size with ``heads`` (query, KV)
    heads, q and k views of one qkv projection, and what the separate kernels give for them."""
    from pagoda.ops.triton_norm import rms_norm_triton
    from pagoda.ops.triton_rotary import rotary_embedding_triton

    a = _arch("qwen3-0.6b")
    a.num_attention_heads, a.num_key_value_heads = heads
    rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
    rope = rope.cuda()
    q, k, _ = _qkv_views(tokens, a)
    wq = (1 + 0.3 * _rand(a.head_dim, seed=7).float()).to(BF16)
    wk = (1 + 0.3 * _rand(a.head_dim, seed=8).float()).to(BF16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    positions = torch.randint(0, a.max_position_embeddings, (tokens,), generator=gen, device="cuda")
    want = rotary_embedding_triton(
        positions, rms_norm_triton(q, wq, 1e-6), rms_norm_triton(k, wk, 1e-6), rope.cos, rope.sin
    )
    return (positions, q, k, wq, wk, 1e-6, rope.cos, rope.sin), want


@pytest.mark.parametrize(
    "variant",
    [
        {"halves": h, "tokens_per_program": t, "num_warps": None}
        for h in ("reload", "swap", "split")
        for t in (1, 2, 4)
    ]
    + [{"halves": h, "tokens_per_program": 2, "num_warps": 4} for h in ("reload", "swap")],
    ids=lambda v: "-".join(str(x) for x in v.values()),
)
def test_qk_norm_rotary_variants_are_bit_identical_at_32768_tokens(variant: dict) -> None:
    # Each variant that benchmarks/qk_norm_rotary.py times, at its size, against the separate
    # kernels: the interpreter cannot tell the order of a sum or a fused multiply-add, a GPU can.
    from pagoda.ops.triton_qk_norm_rotary import qk_norm_rotary_triton

    args, (want_q, want_k) = _qk_norm_rotary_case(32768, (16, 8))
    got_q, got_k = qk_norm_rotary_triton(*args, **variant)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_kernels_replay_from_a_cuda_graph_on_new_inputs() -> None:
    from pagoda.ops.triton_activation import silu_and_mul_triton
    from pagoda.ops.triton_norm import rms_norm_triton
    from pagoda.ops.triton_rotary import rotary_embedding_triton

    a = _arch("qwen3-0.6b")
    rope = RotaryEmbedding(a.head_dim, 4096, a.rope_theta, a.rope_scaling).cuda()
    n = 64
    x, res, weight = _rand(n, a.hidden_size), _rand(n, a.hidden_size, seed=1), _rand(a.hidden_size)
    gate_up = _rand(n, 2 * a.intermediate_size, seed=2)
    q, k, _ = _qkv_views(n, a)
    positions = torch.arange(n, device="cuda")

    def step():
        out, new_res = rms_norm_triton(x, weight, 1e-6, res)
        return (
            out,
            new_res,
            silu_and_mul_triton(gate_up),
            rotary_embedding_triton(positions, q, k, rope.cos, rope.sin),
        )

    step()  # compile and load the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res, act, _ = step()
    for t, seed in ((x, 10), (res, 11), (gate_up, 12), (q, 13), (k, 14)):
        t.copy_(_rand(*t.shape, seed=seed))
    positions.copy_(torch.randperm(4096, device="cuda")[:n])
    want_out, want_res = reference.rms_norm(x, weight, 1e-6, res)
    want_act = reference.silu_and_mul(gate_up)
    want_q, want_k = reference.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(new_res, want_res) and torch.equal(q, want_q) and torch.equal(k, want_k)
    _close(out, want_out)
    _close(act, want_act)


@pytest.fixture
def fused_ops_restored():
    yield
    ops.set_fused_ops(True)


def _engine(model_dir: Path, fused: bool) -> LLM:
    ops.set_fused_ops(fused)
    # NOTE: where the configuration has the switch, the engine sets it from there.
    key = {"fused_ops": fused} if "fused_ops" in ModelConfig.model_fields else {}
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=1024,
        kv_cache_memory_bytes=2 << 30,
        **key,
    )
    scale_random_weights(llm, 0.02)
    return llm


# Long prompts: a first step of over 4,096 rows, where Qwen3's qkv kernel runs and stores the
# keys and values in the cache itself (the decode steps after it read them there).
@pytest.mark.parametrize(
    ("name", "lengths"),
    [(m, (8, 300)) for m in MODELS] + [("qwen3-0.6b", (600, 700))],
    ids=[*MODELS, "qwen3-0.6b-long"],
)
def test_engine_with_fused_ops_matches_torch_ops(
    name: str, lengths: tuple[int, int], tmp_path: Path, fused_ops_restored: None
) -> None:
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 100000, int(n)).tolist() for n in rng.integers(*lengths, 8)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def run(llm: LLM, fused: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        ops.set_fused_ops(fused)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [last_logits(llm, p) for p in prompts]

    ref = _engine(tmp_path, False)
    want, want_logits = run(ref, False)
    fused = _engine(tmp_path, True)
    got, got_logits = run(fused, True)  # decode steps replay graphs captured with the kernels
    for g, w in zip(got_logits, want_logits):
        assert ((g - w).norm() / w.norm()).item() < 2e-2  # a prefill's logits, bf16 rounding
    ops.set_fused_ops(False)
    for p, w, g in zip(prompts, want, got):
        check_same_or_near_tie(ref, p, w, g)


def test_linear_add_adds_a_large_steps_projection_into_the_residual_in_place(
    monkeypatch,
) -> None:
    """``residual += x @ W.T`` in cuBLAS's epilogue for a step of at least
    ``RESIDUAL_IN_EPILOGUE_MIN_ROWS`` rows: the sum within two bf16 roundings of float64, the
    bound of projecting then adding apart (on an H200 cuBLAS's epilogue is not one rounding of
    the fp32 sum: an element 0.039 off where one rounding allows 0.032); a smaller step is left
    to the caller, its residual as it was."""
    monkeypatch.setattr(ops, "RESIDUAL_IN_EPILOGUE", True)
    rows = ops.RESIDUAL_IN_EPILOGUE_MIN_ROWS
    x, w = _rand(rows, 2048, seed=1), _rand(1024, 2048, seed=2) / 32
    residual = _rand(rows, 1024, seed=3)
    product = x.double() @ w.double().T
    want = residual.double() + product
    store = residual.data_ptr()
    assert ops.linear_add_(residual, x, w)
    assert residual.data_ptr() == store
    err = (residual.double() - want).abs()
    # (the product rounded, then the sum: half a unit in the last place of each, 2**-8 relative)
    assert (err <= (product.abs() + want.abs()) * 2**-8 + 1e-3).all(), float(err.max())
    small = residual[:100].clone()
    assert not ops.linear_add_(small, x[:100], w)
    assert torch.equal(small, residual[:100])
