"""The fused Triton kernels of `pagoda.ops` against its torch reference, on small shapes: under the
Triton interpreter on a CPU, natively on a GPU; and when the model takes which path.

NOTE: the interpreter rounds float32 to bfloat16 toward zero where a GPU rounds to nearest, so on a
CPU bfloat16 results are compared within a few bfloat16 steps; float16 and float32 are exact there
wherever the arithmetic is the same (sums, rotations).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib.util import find_spec

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined

import pagoda.ops as ops  # noqa: E402
from pagoda.attention.backend import write_kv_cache  # noqa: E402
from pagoda.models.layers import RotaryEmbedding  # noqa: E402
from pagoda.ops import reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on CUDA where there is one, else on the CPU
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="needs triton")


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let the model run the kernels on CPU tensors (interpreted) for one test, then stop."""
    monkeypatch.setenv("PAGODA_TRITON_ON_CPU", "1")
    ops.set_fused_ops(True)
    yield


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if DEVICE == "cpu" and got.dtype == torch.bfloat16:
        # Up to three roundings toward zero (sum, normalised value, product) of one step each.
        torch.testing.assert_close(got, want, rtol=3 * 2**-7, atol=1e-3)
    elif exact:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, want)
        if got.dtype != torch.float32:
            # Rounded at the same points as torch: only a last-bit difference of a float32
            # intermediate (reduction order, exp) may flip a rounding, which is rare.
            assert (got != want).float().mean().item() <= 0.01


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 1024])
def test_rms_norm_with_residual_matches_torch_and_returns_the_sum(
    dtype: torch.dtype, hidden: int
) -> None:
    from pagoda.ops.triton_norm import rms_norm_triton

    x, res = _rand(5, hidden, dtype=dtype), _rand(5, hidden, dtype=dtype, seed=1)
    weight = _rand(hidden, dtype=dtype, seed=2).abs() + 0.5
    x0, res0 = x.clone(), res.clone()
    out, new_res = rms_norm_triton(x, weight, 1e-6, res)
    want_out, want_res = reference.rms_norm(x, weight, 1e-6, res)
    _same(new_res, want_res, exact=True)
    _same(out, want_out, exact=False)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # the inputs are left alone


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_residual_matches_torch(dtype: torch.dtype) -> None:
    from pagoda.ops.triton_norm import rms_norm_triton

    x, weight = _rand(3, 576, dtype=dtype), _rand(576, dtype=dtype, seed=1)
    _same(rms_norm_triton(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), exact=False)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])  # (ops.rms_norm_fp8's)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_quantized_for_fp8_is_the_stored_norm_quantized(
    dtype: torch.dtype, with_residual: bool
) -> None:
    """The norm kernel's FP8 output (``rms_norm_fp8``) holds what the per-token quantization of
    its stored output holds: the same FP8 values and scales, and the same residual sum."""
    from pagoda.ops.triton_fp8 import quantize_tokens_triton
    from pagoda.ops.triton_norm import rms_norm_fp8_triton, rms_norm_triton

    hidden = 576
    x, res = _rand(7, hidden, dtype=dtype), _rand(7, hidden, dtype=dtype, seed=1)
    x = x * 4  # (some rows' largest values past 448 before scaling)
    weight = _rand(hidden, dtype=dtype, seed=2).abs() + 0.5
    residual = res if with_residual else None
    got = rms_norm_fp8_triton(x, weight, 1e-6, residual)
    want = rms_norm_triton(x, weight, 1e-6, residual)
    if with_residual:
        (got, got_sum), (want, want_sum) = got, want
        assert torch.equal(got_sum, want_sum)
    q, scale = quantize_tokens_triton(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.scale, scale)
    assert torch.equal(got.data.view(torch.uint8), q.view(torch.uint8))


def _qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q, k, v as the attention layer gets them: strided views of one qkv projection output."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = _rand(tokens, q_size + 2 * kv_size, dtype=dtype, seed=3)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return qkv, q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_per_head_rms_norm_on_strided_q_view_matches_torch(
    dtype: torch.dtype, head_dim: int
) -> None:
    from pagoda.ops.triton_norm import rms_norm_triton

    _, q, _, _ = _qkv_views(5, 4, 2, head_dim, dtype)
    assert not q.is_contiguous()
    weight = _rand(head_dim, dtype=dtype, seed=4)
    _same(rms_norm_triton(q, weight, 1e-6), reference.rms_norm(q, weight, 1e-6), exact=False)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [200, 1100])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, inter: int) -> None:
    from pagoda.ops.triton_activation import silu_and_mul_triton

    x = _rand(3, 2 * inter, dtype=dtype) * 4
    _same(silu_and_mul_triton(x), reference.silu_and_mul(x), exact=False)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_rotates_strided_q_and_k_in_place_like_torch(
    dtype: torch.dtype, head_dim: int
) -> None:
    from pagoda.ops.triton_rotary import rotary_embedding_triton

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, scaling).to(DEVICE)
    qkv, q, k, v = _qkv_views(6, 6, 2, head_dim, dtype)
    positions = torch.tensor([4095, 0, 17, 17, 1000, 3], device=DEVICE)  # any order, repeats
    want_q, want_k = reference.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    v0 = v.clone()
    got_q, got_k = rotary_embedding_triton(positions, q, k, rope.cos, rope.sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    _same(got_q, want_q, exact=True)
    _same(got_k, want_k, exact=True)
    assert torch.equal(v, v0)  # the rest of the qkv output is untouched


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim",
    [(7, 6, 2, 64), (3, 16, 8, 128), (1, 16, 8, 128)],  # the last: the separate kernels run
)
def test_qk_norm_rotary_gives_the_bits_of_the_norms_then_the_rotation(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int, fused_on_cpu: None
) -> None:
    from pagoda.ops.triton_qk_norm_rotary import qk_norm_rotary_triton

    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)  # strided views of the projection, as the model has them
    k = k.view(tokens, kv_heads, head_dim)
    wq = (1 + 0.3 * _rand(head_dim, dtype=torch.float32, seed=1)).to(dtype)
    wk = (1 + 0.3 * _rand(head_dim, dtype=torch.float32, seed=2)).to(dtype)
    rot = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    pos = torch.tensor([0, 3, 9, 1, 40, 63, 5][:tokens], device=DEVICE)
    before = qkv.clone()
    got_q, got_k = qk_norm_rotary_triton(pos, q, k, wq, wk, 1e-6, rot.cos, rot.sin)
    assert torch.equal(qkv, before)  # the inputs are left as they were
    assert got_q.is_contiguous() and got_k.is_contiguous()
    # What it replaces, to the bit: the norm kernel on each, then the rotation kernel in place on
    # the norms' outputs (tests/gpu/test_fused_ops_gpu.py checks the same on a GPU, where fused
    # multiply-adds and the order of the sums could tell them apart).
    want_q, want_k = ops.rotary_embedding(
        pos, ops.rms_norm(q, wq, 1e-6), ops.rms_norm(k, wk, 1e-6), rot.cos, rot.sin
    )
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    # And the torch reference within the rounding of a few steps.
    ref_q = reference.rotary_embedding(
        pos, reference.rms_norm(q, wq, 1e-6), reference.rms_norm(k, wk, 1e-6), rot.cos, rot.sin
    )[0]
    torch.testing.assert_close(got_q.float(), ref_q.float(), rtol=0.05, atol=0.05)


# Every variant of the fused kernel (its keywords); the interpreter ignores warps, a GPU does not
# (tests/gpu/test_fused_ops_gpu.py).
QK_VARIANTS = [
    {"halves": h, "tokens_per_program": t, "num_warps": None}
    for h in ("reload", "swap", "split")
    for t in (1, 2, 4)
] + [{"halves": "swap", "tokens_per_program": 2, "num_warps": 4}]


class _LaunchSpy:
    """Stands in for a kernel's launch (a ``JitLaunch``): launches and keeps each launch's
    keywords."""

    def __init__(self, launch) -> None:
        self.launch, self.launches = launch, []

    def __call__(self, grid, *args, **kwargs):
        self.launches.append(kwargs)
        return self.launch(grid, *args, **kwargs)


@needs_triton
@pytest.mark.parametrize("head_dim", [128, 64, 96])  # 96: no power of two, the halves reload
# (8: whole programs of 1, 2 and 4; 5: whole ones and a partial one of 2 and of 4)
@pytest.mark.parametrize("tokens", [1, 3, 5, 8])
def test_qk_norm_rotary_variants_give_the_bits_of_the_separate_kernels(
    head_dim: int, tokens: int, fused_on_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pagoda.ops.triton_qk_norm_rotary as qk
    from pagoda.ops.triton_norm import launch_shape, rms_norm_triton
    from pagoda.ops.triton_rotary import rotary_embedding_triton

    # Qwen3-0.6B's heads; one token with a full tile of KV heads, so that the fused kernel runs.
    rows = launch_shape(head_dim, 1 << 30)[0]
    heads, kv_heads = (16, 8) if tokens > 1 else (rows, rows)
    dtype = torch.bfloat16
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=tokens)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    wq = (1 + 0.3 * _rand(head_dim, dtype=torch.float32, seed=1)).to(dtype)
    wk = (1 + 0.3 * _rand(head_dim, dtype=torch.float32, seed=2)).to(dtype)
    rot = RotaryEmbedding(head_dim, 128, 10000.0).to(DEVICE)
    pos = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want_q, want_k = rotary_embedding_triton(
        pos, rms_norm_triton(q, wq, 1e-6), rms_norm_triton(k, wk, 1e-6), rot.cos, rot.sin
    )
    before = qkv.clone()
    spy = _LaunchSpy(qk._qk_norm_rotary_kernel_launch)
    monkeypatch.setattr(qk, "_qk_norm_rotary_kernel_launch", spy)
    for variant in QK_VARIANTS:
        got_q, got_k = qk.qk_norm_rotary_triton(
            pos, q, k, wq, wk, 1e-6, rot.cos, rot.sin, **variant
        )
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), variant
        # The variant asked for ran, but for halves that a padded row cannot give.
        launch = spy.launches[-1]
        want_halves = variant["halves"] if head_dim in (64, 128) else "reload"
        assert qk.halves_used(head_dim, variant["halves"]) == want_halves
        assert launch["HALVES"] == qk.HALVES[want_halves], variant
        assert launch["TOKENS"] == variant["tokens_per_program"]
    assert len(spy.launches) == len(QK_VARIANTS)
    assert torch.equal(qkv, before)


def test_qk_norm_rotary_refuses_more_warps_than_the_norm_kernel() -> None:
    from pagoda.ops.triton_qk_norm_rotary import qk_norm_rotary_triton

    # More warps lay a row out over other lanes and registers: another order of its sum.
    q, k = torch.zeros(32, 16, 128), torch.zeros(32, 8, 128)
    table, w, pos = torch.zeros(8, 64), torch.ones(128), torch.zeros(32, dtype=torch.long)
    for bad in ({"num_warps": 16}, {"num_warps": 3}, {"tokens_per_program": 0}):
        with pytest.raises(ValueError):
            qk_norm_rotary_triton(pos, q, k, w, w, 1e-6, table, table, **bad)
    with pytest.raises(ValueError, match="halves"):
        qk_norm_rotary_triton(pos, q, k, w, w, 1e-6, table, table, halves="both")


def _draw_case(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    temperature = 0.3 + 1.2 * torch.rand(rows, generator=gen)
    uniform = torch.rand(rows, generator=gen, dtype=torch.float64)
    return logits.to(DEVICE), temperature.to(DEVICE), uniform.to(DEVICE)


def _sampler_draw(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor):
    from pagoda.sample.ops import sample_from_probs

    probs = (logits.float() / temperature.unsqueeze(1)).softmax(dim=-1)
    return sample_from_probs(probs, uniform)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 4096 + 300])
def test_fused_draw_picks_the_sampler_token_for_each_row(dtype: torch.dtype, vocab: int) -> None:
    from pagoda.ops.triton_sample import sample_from_logits_triton

    # A vocabulary that ends inside a bucket, and one over several loop tiles.
    logits, temperature, uniform = _draw_case(24, vocab, dtype)
    got = sample_from_logits_triton(logits, temperature, uniform)
    want = _sampler_draw(logits, temperature, uniform)
    assert got.dtype == torch.int64
    # The same inverse-CDF draw: only a uniform within float rounding of a boundary between two
    # tokens could tell the two apart, which these rows do not have.
    assert torch.equal(got, want)
    # Rows are independent: drawn alone, each row gets the same token.
    for i in (0, 7, 23):
        one = sample_from_logits_triton(
            logits[i : i + 1], temperature[i : i + 1], uniform[i : i + 1]
        )
        assert one.item() == got[i].item()


@needs_triton
def test_fused_draw_never_picks_a_token_of_zero_probability() -> None:
    from pagoda.ops.triton_sample import sample_from_logits_triton

    vocab = 700
    logits = torch.full((4, vocab), float("-inf"))
    allowed = [[5, 130, 131], [699], [0, 256], [127, 128, 600]]
    for r, ids in enumerate(allowed):
        logits[r, ids] = torch.tensor([1.0, 2.0, 0.5][: len(ids)])
    logits = logits.to(DEVICE)
    temperature = torch.full((4,), 0.7, device=DEVICE)
    # u = 0 takes each row's first allowed token, u just below 1 its last.
    for u, pick in ((0.0, 0), (1.0 - 2.0**-53, -1)):
        uniform = torch.full((4,), u, dtype=torch.float64, device=DEVICE)
        got = sample_from_logits_triton(logits, temperature, uniform).tolist()
        assert got == [ids[pick] for ids in allowed]


@needs_triton
def test_sampler_takes_the_fused_draw_for_temperature_alone(
    fused_on_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pagoda.ops.triton_sample as ts
    from pagoda.sample.metadata import SamplingMetadata
    from pagoda.sample.sampler import Sampler

    calls = []
    real = ts.sample_from_logits_triton
    monkeypatch.setattr(ts, "sample_from_logits_triton", lambda *a: calls.append(1) or real(*a))
    logits, temperature, uniform = _draw_case(6, 1000, torch.float32, seed=1)
    want = _sampler_draw(logits, temperature, uniform)

    def md(**kw):
        return SamplingMetadata(False, True, temperature=temperature, uniform=uniform, **kw)

    out = Sampler()(logits.clone(), md())
    assert calls == [1] and torch.equal(out.sampled, want)
    # Anything that acts on the logits (top-p here) or wants logprobs takes the sampler's path.
    top_p = torch.ones(6, device=DEVICE)
    Sampler()(logits.clone(), md(top_p=top_p))
    Sampler()(logits.clone(), md(max_num_logprobs=2))
    assert calls == [1]


def _kv_write_case(dtype: torch.dtype, value_dim: int = 64):
    """Keys and values as strided views of a qkv projection (as the model has them), a cache of
    random bytes, and slots: shuffled, one padded token (-1), two more slots than tokens."""
    tokens, heads, kv_heads, dim, blocks, page = 9, 4, 2, 64, 6, 4
    gen = torch.Generator().manual_seed(0)
    width = (heads + kv_heads) * dim + kv_heads * value_dim
    qkv = (torch.randn(tokens, width, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * value_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, value_dim)
    slots = torch.randperm(blocks * page, generator=gen)[: tokens + 2]
    slots[3] = -1
    cache = torch.randn(2, blocks, page, kv_heads, dim, generator=gen).to(DEVICE)
    cache = cache.to(torch.bfloat16).view(torch.uint8).view(cache.shape + (2,))  # random bytes
    cache = cache[..., 0].contiguous().view(dtype) if dtype.itemsize == 1 else cache.view(dtype)
    return k, v, cache.view(2, blocks, page, kv_heads, dim), slots.to(DEVICE), tokens - 2


@needs_triton
@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        pytest.param(
            torch.float8_e4m3fn,
            marks=pytest.mark.skipif(
                DEVICE == "cpu",
                reason="the interpreter's casts to FP8 do not round to nearest (126.875 -> 64)",
            ),
        ),
    ],
)
def test_kv_cache_write_is_one_kernel_storing_the_bytes_of_the_two_copies(
    dtype: torch.dtype, fused_on_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pagoda.ops.triton_kv_write as kv_write

    k, v, cache, slots, n = _kv_write_case(dtype)
    scales = {}
    if dtype == torch.float8_e4m3fn:
        scales = dict(
            k_scale=torch.tensor([0.05], device=DEVICE), v_scale=torch.tensor([0.02], device=DEVICE)
        )
    want = cache.clone()
    unpadded = slots[:n] >= 0  # (the torch copies have no padded slot: leave those rows out)
    try:
        ops.set_fused_ops(False)
        write_kv_cache(
            k[:n][unpadded], v[:n][unpadded], want, slots[:n][unpadded], int(unpadded.sum()),
            **scales,
        )  # fmt: skip
    finally:
        ops.set_fused_ops(True)
    launches = []
    kernel = kv_write.write_kv_triton
    monkeypatch.setattr(
        kv_write, "write_kv_triton", lambda *a, **kw: launches.append(kernel(*a, **kw))
    )
    kc, vc = write_kv_cache(k, v, cache, slots, n, **scales)
    assert len(launches) == 1
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert kc.data_ptr() == cache[0].data_ptr() and vc.data_ptr() == cache[1].data_ptr()


def test_kv_cache_write_copies_where_the_kernel_cannot_address_the_cache(
    fused_on_cpu: None,
) -> None:
    """Values narrower than the cache's heads, an FP8 cache without scales: the two copies."""
    k, v, cache, _, _ = _kv_write_case(torch.bfloat16)
    assert ops.kv_write_fused(k, v, cache, None, None)
    k, v, cache, _, _ = _kv_write_case(torch.bfloat16, value_dim=32)
    assert not ops.kv_write_fused(k, v, cache, None, None)
    k, v, cache, _, _ = _kv_write_case(torch.float8_e4m3fn)
    assert not ops.kv_write_fused(k, v, cache, None, None)
    scale = torch.tensor([1.0], device=DEVICE)
    assert ops.kv_write_fused(k, v, cache, scale, scale)


def test_cpu_tensors_take_the_torch_path_unless_the_interpreter_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.zeros(2, 8)
    monkeypatch.delenv("PAGODA_TRITON_ON_CPU", raising=False)
    assert not ops._use_triton(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PAGODA_TRITON_ON_CPU", "1")
    assert ops._use_triton(x) == (find_spec("triton") is not None)
    monkeypatch.setattr(ops, "_have_triton", lambda: False)  # triton is optional
    assert not ops._use_triton(x)


def test_set_fused_ops_false_selects_the_torch_path(fused_on_cpu: None) -> None:
    x = torch.zeros(2, 8)
    try:
        ops.set_fused_ops(False)
        assert not ops.fused_ops_enabled() and not ops._use_triton(x)
    finally:
        ops.set_fused_ops(True)
    assert ops.fused_ops_enabled()


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the model's calls of each kernel (the dispatch imports them at each call)."""
    import pagoda.ops.triton_activation as act
    import pagoda.ops.triton_norm as norm
    import pagoda.ops.triton_qk_norm_rotary as qk
    import pagoda.ops.triton_rotary as rot

    calls = {"rms_norm": 0, "silu_and_mul": 0, "rotary": 0, "qk_norm_rotary": 0}
    for module, attr, key in [
        (norm, "rms_norm_triton", "rms_norm"),
        (act, "silu_and_mul_triton", "silu_and_mul"),
        (rot, "rotary_embedding_triton", "rotary"),
        (qk, "qk_norm_rotary_triton", "qk_norm_rotary"),
    ]:
        fn = getattr(module, attr)

        def counted(*args, _fn=fn, _key=key):
            calls[_key] += 1
            return _fn(*args)

        monkeypatch.setattr(module, attr, counted)
    return calls


@needs_triton
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_model_forward_with_fused_ops_matches_torch_path(
    name: str, fused_on_cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if DEVICE != "cpu":
        pytest.skip("the GPU tier compares whole models at real shapes")
    from pagoda.attention.backend import CommonAttentionMetadata
    from pagoda.attention.layer import Attention, set_forward_context
    from pagoda.attention.torch_native import TorchNativeBackend
    from pagoda.loader import ModelArchConfig
    from pagoda.models.llama import LlamaForCausalLM

    arch = "Qwen3ForCausalLM" if name == "qwen3" else "LlamaForCausalLM"
    cfg = ModelArchConfig.from_hf_config(
        dict(
            architectures=[arch],
            vocab_size=64,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            hidden_act="silu",
        )
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, TorchNativeBackend).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.2)
    n, block, blocks = 9, 4, [2, 1, 3]
    shape = TorchNativeBackend.get_kv_cache_shape(4, block, 2, 16)
    common = CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=n,
        max_query_len=n,
        max_seq_len=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=torch.tensor([blocks[i // block] * block + i % block for i in range(n)]),
        query_start_loc_cpu=np.array([0, n]),
        seq_lens_cpu=np.array([n]),
        block_size=block,
    )
    ids, pos = torch.randint(0, 64, (n,)), torch.arange(n)

    def forward() -> torch.Tensor:
        for m in model.modules():
            if isinstance(m, Attention):
                m.kv_cache = torch.zeros(shape)
        with torch.inference_mode(), set_forward_context(TorchNativeBackend.build_metadata(common)):
            return model(ids, pos)

    calls = _count_kernel_calls(monkeypatch)
    fused = forward()
    # Two layers: their input and post-attention norms and the final one; Qwen3's q/k norms and
    # rotation through the fused op a layer, Llama's rotation alone. At this model's head size of
    # 16 the norm kernel tiles 128 rows, more than 9 tokens' heads: the fused op runs the separate
    # kernels, as its bits must be theirs (two norms and a rotation a layer).
    qwen3 = name == "qwen3"
    assert calls == {
        "rms_norm": 5 + 4 * qwen3,
        "silu_and_mul": 2,
        "rotary": 2,
        "qk_norm_rotary": 2 * qwen3,
    }
    ops.set_fused_ops(False)
    try:
        want = forward()
    finally:
        ops.set_fused_ops(True)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
