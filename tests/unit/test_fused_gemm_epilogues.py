"""The GEMMs with fused epilogues (`pagoda.ops.triton_gated_gemm`, `triton_qkv_norm_rotary`)
against float64 arithmetic on the same inputs: under Triton's interpreter on a CPU (float16: the
interpreter's tensor descriptors do not take bfloat16), on a Hopper GPU where there is one. The
GPU tier checks bfloat16 at real shapes (`tests/gpu/test_fused_ops_gpu.py`). Also compiled for
sm_90 without a GPU: their default launches fit a Hopper block's shared memory."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined

pytestmark = [
    pytest.mark.skipif(find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
        reason="the kernels load through Hopper's tensor descriptors",
    ),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16 = torch.float16


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(F16).to(DEVICE)


def test_gate_up_silu_kernel_matches_float64() -> None:
    from pagoda.ops.triton_gated_gemm import gate_up_silu_triton

    m, k, inter = 200, 128, 256  # a last row tile cut short; two tiles a program
    x, w = _rand(m, k, seed=0), _rand(2 * inter, k, seed=1, scale=k**-0.5)
    y = x.double() @ w.double().T
    want = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
    got = gate_up_silu_triton(x, w).double()
    assert got.shape == (m, inter)
    assert ((got - want).abs() <= want.abs() * 2**-10 + 2e-3).all()


def _norm_rotate(h: torch.Tensor, w: torch.Tensor, eps: float, cos, sin) -> torch.Tensor:
    """Per-head RMSNorm with ``w`` then the neox rotation, in float64: h [M, heads, D]."""
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    h1, h2 = h.chunk(2, dim=-1)
    return torch.cat((h1 * cos - h2 * sin, h2 * cos + h1 * sin), dim=-1)


def _qkv_inputs(m: int, k: int, heads: int, d: int, seed: int):
    """A step's rows ``x`` [m, k], a qkv weight of ``heads`` heads of ``d``, the q and k norms'
    weights (different: a kernel giving k's heads q's weight fails) and a rotary table."""
    from pagoda.models.layers import RotaryEmbedding

    x, w = _rand(m, k, seed=seed), _rand(heads * d, k, seed=seed + 1, scale=k**-0.5)
    wq = (1 + _rand(d, seed=seed + 2, scale=0.5)).to(F16)
    wk = (0.5 + _rand(d, seed=seed + 3, scale=0.5)).to(F16)
    return x, w, wq, wk, RotaryEmbedding(d, 4096, 10000.0).to(DEVICE)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_qkv_norm_rotary_kernel_matches_float64(head_dim: int) -> None:
    """q and k heads normalised with their own weights and rotated at each row's position, v
    heads as projected. The two norms' weights differ (a kernel giving k's heads q's weight, or
    none, fails), and the positions are far apart (a kernel that skipped the rotation fails)."""
    from pagoda.ops.triton_qkv_norm_rotary import qkv_norm_rotary_triton

    m, k, qh, kvh, eps = 200, 128, 4, 2, 1e-6
    heads = qh + 2 * kvh
    x, w, wq, wk, rot = _qkv_inputs(m, k, heads, head_dim, seed=2)
    pos = torch.randint(0, 4096, (m,), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    got = qkv_norm_rotary_triton(x, w, qh, kvh, head_dim, wq, wk, eps, pos, rot.cos, rot.sin)
    assert got.shape == (m, heads * head_dim) and got.dtype == F16
    y = (x.double() @ w.double().T).view(m, heads, head_dim)
    cos = rot.cos[pos].double().unsqueeze(1)
    sin = rot.sin[pos].double().unsqueeze(1)
    want = torch.cat(
        (
            _norm_rotate(y[:, :qh], wq, eps, cos, sin),
            _norm_rotate(y[:, qh : qh + kvh], wk, eps, cos, sin),
            y[:, qh + kvh :],
        ),
        dim=1,
    ).view(m, -1)
    # Rounded to fp16 after the projection, after the norm and after the weight, then once more.
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 4e-3).all()


@pytest.mark.parametrize("wide", [False, True], ids=["32-bit", "64-bit"])
def test_qkv_norm_rotary_stores_keys_and_values_as_the_cache_write_does(
    wide: bool, monkeypatch
) -> None:
    """With a KV cache, each row's key and value heads also land in its slot (blocks taken out
    of order, a padded row's slot -1 writing nothing), bit for bit what ``write_kv_cache``
    stores from the projection's keys and values; the projection's output is unchanged. Slots'
    offsets are 32-bit below ``WIDE_PLANE`` elements a plane, 64-bit from it on."""
    from pagoda.attention.backend import write_kv_cache
    from pagoda.ops import triton_qkv_norm_rotary as fused
    from pagoda.ops.triton_qkv_norm_rotary import qkv_norm_rotary_triton

    if wide:
        monkeypatch.setattr(fused, "WIDE_PLANE", 0)

    m, k, qh, kvh, d, eps, page = 200, 128, 4, 2, 64, 1e-6, 16
    heads = qh + 2 * kvh
    x, w, wq, wk, rot = _qkv_inputs(m, k, heads, d, seed=7)
    gen = torch.Generator().manual_seed(11)
    pos = torch.randint(0, 4096, (m,), generator=gen).to(DEVICE)
    blocks = torch.randperm(40, generator=gen)[: -(-m // page)]
    slots = (blocks[:, None] * page + torch.arange(page)).reshape(-1)[:m].to(DEVICE)
    slots[[3, m - 1]] = -1
    cache = torch.full((2, 40, page, kvh, d), -7.0, dtype=F16, device=DEVICE)
    want_cache = cache.clone()
    args = (x, w, qh, kvh, d, wq, wk, eps, pos, rot.cos, rot.sin)
    plain = qkv_norm_rotary_triton(*args)
    got = qkv_norm_rotary_triton(*args, kv_cache=cache, slot_mapping=slots)
    assert torch.equal(got, plain)
    _, key, value = plain.split([qh * d, kvh * d, kvh * d], dim=1)
    kept = slots >= 0  # (the torch write takes real slots only)
    n = int(kept.sum())
    key, value = key[kept].reshape(n, kvh, d), value[kept].reshape(n, kvh, d)
    write_kv_cache(key, value, want_cache, slots[kept], n)
    assert torch.equal(cache, want_cache)
    assert (cache.view(2, -1, kvh, d)[:, blocks[-1] * page + page - 1] == -7.0).all()  # slot -1
    # Keys and values alone (no q heads: the weight's k and v rows), as a model's last layer
    # runs them when it reads a few rows: the same columns and the same cache.
    kv_cache = torch.full_like(cache, -7.0)
    kv_args = (x, w[qh * d :], 0, kvh, d, wq, wk, eps, pos, rot.cos, rot.sin)
    kv = qkv_norm_rotary_triton(*kv_args, kv_cache=kv_cache, slot_mapping=slots)
    assert torch.equal(kv, plain[:, qh * d :])
    assert torch.equal(kv_cache, want_cache)
    wrong = torch.zeros(2, 40, page, kvh, d, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        qkv_norm_rotary_triton(*args, kv_cache=wrong, slot_mapping=slots)


@pytest.mark.parametrize("heads_per_tile", [1, 2])
def test_qkv_norm_rotary_persistent_programs_match_a_program_a_tile(
    heads_per_tile: int, monkeypatch
) -> None:
    """Persistent (the interpreter's two programs taking the tiles in turn) or a program a tile,
    at one head a tile or two: the same output and cache, bit for bit. A program that skipped
    its later tiles, or took a tile twice at another's place, would leave rows unwritten or
    wrong."""
    from pagoda.ops import triton_qkv_norm_rotary as fused
    from pagoda.ops.triton_qkv_norm_rotary import qkv_norm_rotary_triton

    m, k, qh, kvh, d, eps, page = 300, 128, 4, 2, 32, 1e-6, 16
    heads = qh + 2 * kvh
    x, w, wq, wk, rot = _qkv_inputs(m, k, heads, d, seed=13)
    gen = torch.Generator().manual_seed(17)
    pos = torch.randint(0, 4096, (m,), generator=gen).to(DEVICE)
    slots = torch.randperm(40 * page, generator=gen)[:m].to(DEVICE)
    args = (x, w, qh, kvh, d, wq, wk, eps, pos, rot.cos, rot.sin)
    launch = (64, 32, 2, 2, 4)  # 5 row tiles x 4 or 8 column tiles: many tiles a program
    got = {}
    for persistent in (True, False):
        monkeypatch.setattr(fused, "PERSISTENT", persistent)
        cache = torch.full((2, 40, page, kvh, d), -7.0, dtype=F16, device=DEVICE)
        out = qkv_norm_rotary_triton(
            *args, launch=launch, kv_cache=cache, slot_mapping=slots,
            heads_per_program=heads_per_tile,
        )  # fmt: skip
        got[persistent] = (out, cache)
    assert fused.heads_per_tile(qh, kvh, d, heads_per_tile) == heads_per_tile
    assert torch.equal(got[True][0], got[False][0])
    assert torch.equal(got[True][1], got[False][1])
    assert not (got[True][1] == -7.0).all()  # (the cache was written)


def test_qkv_norm_rotary_refuses_a_weight_of_other_heads() -> None:
    from pagoda.ops.triton_qkv_norm_rotary import qkv_norm_rotary_triton

    x, w = _rand(16, 64, seed=0), _rand(7 * 64, 64, seed=1)
    ones = torch.ones(64, dtype=F16, device=DEVICE)
    pos = torch.zeros(16, dtype=torch.long, device=DEVICE)
    table = torch.zeros(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="8 heads of 64 need 512"):
        qkv_norm_rotary_triton(x, w, 4, 2, 64, ones, ones, 1e-6, pos, table, table)


# Compiled for sm_90 in a process of its own: the tests above run the kernels under Triton's
# interpreter, which replaces the compiler in the process that sets it.
_SM90_COMPILE = r"""
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda.ops import triton_gated_gemm as gg, triton_qkv_norm_rotary as fq

def shared(fn, sig, const, warps, stages):
    # (shared memory, bytes of register spills a thread, scalar 16-bit global stores) of the
    # kernel compiled for sm_90
    import re, subprocess, tempfile
    import triton.backends.nvidia.compiler as nvidia

    names = fn.arg_names
    signature = {n: "constexpr" if n in const else sig[n] for n in names}
    constexprs = {(names.index(n),): v for n, v in const.items()}
    source = ASTSource(fn, signature, constexprs)
    options = {"num_warps": warps, "num_stages": stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    ptxas = nvidia.get_ptxas(90).path
    report = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                            capture_output=True, text=True, check=True).stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
    # global stores of one 16-bit element each (a KV store the compiler could not vectorise)
    scalar_stores = len(re.findall(r"\bst\.global\.b16\b", kernel.asm["ptx"]))
    return kernel.metadata.shared, spills, scalar_stores

bm, bn, bk, gm, stages, warps = gg.LAUNCH
gate_up = shared(
    gg._gate_up_silu_kernel,
    {"x_desc": f"tensordesc<bf16[{bm},{bk}]>", "w_desc": f"tensordesc<bf16[2,{bn},{bk}]>",
     "out_desc": f"tensordesc<bf16[{bm},{bn}]>", "M": "i32", "N": "i32", "K": "i32",
     "programs": "i32"},
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "DTYPE": tl.bfloat16},
    warps, stages,
)
bm, bk, gm, stages, warps = fq.LAUNCH
d = 128  # Qwen3's heads: 16 of q, 8 of k and v
n = fq.heads_per_tile(16, 8, d) * d
qkv = shared(
    fq._qkv_norm_rotary_kernel,
    {"x_desc": f"tensordesc<bf16[{bm},{bk}]>", "w_desc": f"tensordesc<bf16[{n},{bk}]>",
     "out_desc": f"tensordesc<bf16[{bm},{n}]>", "pos_ptr": "*i64", "wq_ptr": "*bf16",
     "wk_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "stride_cos": "i32",
     "M": "i32", "K": "i32", "q_heads": "i32", "k_heads": "i32", "heads": "i32",
     "eps": "fp32", "cache_ptr": "*bf16", "slot_ptr": "*i64", "plane": "i64",
     "programs": "i32"},
    {"BLOCK_M": bm, "HEADS": n // d, "HALF": d // 2, "BLOCK_K": bk, "GROUP_M": gm,
     "DTYPE": tl.bfloat16, "EXACT": True, "STORE_KV": True, "WIDE": False,
     "ALIGNED": True},
    warps, stages,
)
print(json.dumps({"gate_up": gate_up, "qkv": qkv}))
"""


def test_default_launches_fit_hoppers_shared_memory() -> None:
    """Each kernel compiled for sm_90 at its default launch (bf16, Qwen3's heads) asks for no
    more shared memory than a Hopper block may have (227 KB): a launch that does not fit fails
    only when a GPU first runs it (a persistent qkv kernel asked for 278 KB). Nor does it spill
    registers to local memory, as the qkv kernel did with 64-bit offsets for its KV store, or
    store its KV cache an element at a time."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE], capture_output=True, text=True, env=env
    )
    if run.returncode != 0 and "ptxas" in run.stderr.lower() and "not found" in run.stderr:
        pytest.skip("Triton's CUDA toolchain (ptxas) is not installed")
    assert run.returncode == 0, run.stderr[-2000:]
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    for kernel, (size, spills, scalar_stores) in compiled.items():
        assert 0 < size <= 232448, (kernel, size)
        # (the qkv kernel's KV store once spilled: 64-bit offsets of every element of a tile)
        assert spills == 0, (kernel, spills)
        # (and stored its tile in the cache an element at a time, 256 stores a thread, until
        # told that a head's row starts aligned)
        assert scalar_stores == 0, (kernel, scalar_stores)
