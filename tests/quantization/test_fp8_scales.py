"""FP8 scales are the same bits on every device: ``amax * (1 / 448)`` in float32, one product
rounded to nearest (:func:`pagoda.ops.fp8_format.scale_of`), which a CPU, CUDA and the Triton
kernel all compute alike. ``amax / 448`` is not: CUDA divides by a scalar as a product with its
reciprocal, the CPU divides, and the two differ in the last bit for about half the values. An
FP8 checkpoint written on a CPU then held scales one bit off a GPU's online quantization of the
same weights (the H200 run of tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is first compiled

from pagoda.ops.fp8_format import (  # noqa: E402
    FP8_INV_MAX,
    FP8_MAX,
    MIN_SCALE,
    quantize_rows,
    quantize_tensor,
    scale_of,
)
from pagoda.testing.quantization import fp8_checkpoint  # noqa: E402


def _amax(n: int = 100_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, generator=g) * 10.0 ** torch.randint(-4, 3, (n,), generator=g)


def _one_product(amax: torch.Tensor) -> torch.Tensor:
    """``amax * float32(1/448)`` rounded once to float32: the float64 product of two float32
    values is exact (48 bits of mantissa), so its rounding to float32 is the float32 product's."""
    return (amax.double() * FP8_INV_MAX).float().clamp(min=MIN_SCALE)


def test_a_scale_is_one_float32_product_not_a_division() -> None:
    amax = _amax()
    assert FP8_INV_MAX == float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))
    want = _one_product(amax)
    rows = torch.stack([amax, -amax / 2], dim=-1)  # each row's amax is `amax`
    assert torch.equal(scale_of(amax), want)
    assert torch.equal(quantize_rows(rows)[1].view(-1), want)
    assert torch.equal(quantize_tensor(amax[:1])[1], want[:1])
    # What the old `amax / 448` gave on a CPU: a correctly rounded quotient, which CUDA's
    # product with the reciprocal misses in about half the cases. The definition must not be it.
    assert ((amax / FP8_MAX).clamp(min=MIN_SCALE) != want).float().mean() > 0.2


def test_an_all_zero_row_keeps_the_smallest_scale() -> None:
    q, scale = quantize_rows(torch.zeros(2, 8))
    assert torch.equal(scale, torch.full((2, 1), MIN_SCALE)) and (q.float() == 0).all()


def test_the_checkpoint_writer_computes_the_online_scales() -> None:
    """:func:`pagoda.testing.quantization.fp8_checkpoint` and the online path share
    :func:`quantize_rows` (and so :func:`scale_of`): the scales it writes are the products."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g) * 0.05
    tensors, _ = fp8_checkpoint({"model.layers.0.self_attn.q_proj.weight": w})
    scale = tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    assert torch.equal(scale, _one_product(w.abs().amax(dim=-1, keepdim=True)))
    per_tensor, _ = fp8_checkpoint({"model.layers.0.self_attn.q_proj.weight": w}, strategy="tensor")
    assert torch.equal(
        per_tensor["model.layers.0.self_attn.q_proj.weight_scale"],
        _one_product(w.abs().amax())[None],
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_computes_the_cpus_scales() -> None:
    amax = _amax()
    assert torch.equal(scale_of(amax.cuda()).cpu(), scale_of(amax))


@pytest.mark.skipif(find_spec("triton") is None, reason="needs triton")
def test_the_triton_kernels_scales_are_the_torch_codes_bits() -> None:
    """On a CPU under the Triton interpreter (its FP8 casts round wrongly: the values are not
    compared here; tests/gpu compares them), natively on a GPU."""
    from pagoda.ops.triton_fp8 import quantize_tokens_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 256, generator=g) * 3).to(torch.bfloat16)
    x[:16] *= 10.0 ** torch.randint(-3, 3, (16, 1), generator=g).to(torch.bfloat16)
    x[7] = 0
    _, scale = quantize_tokens_triton(x.to(device))
    assert torch.equal(scale.cpu(), quantize_rows(x)[1])
