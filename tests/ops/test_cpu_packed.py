"""``pagoda.ops.linear`` on a CPU: a product of a few rows (a speculative verification step, a
decode step of a few requests) runs through oneDNN with the weight packed once; it equals
``F.linear`` to float32 rounding, follows a weight changed in place, stays within its memory
bound, and leaves one row, many rows and autograd to ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import ops
from pagoda.ops import cpu_packed

pytestmark = pytest.mark.skipif(not cpu_packed._AVAILABLE, reason="needs oneDNN on x86-64")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(cpu_packed, "_packed", cpu_packed.WeakIdKeyDictionary())
    calls = []
    real = cpu_packed._product

    def spy(x, packed, bias):  # (count the products it ran, by rows)
        calls.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_packed, "_product", spy)
    yield calls


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(384, 96, generator=gen), torch.randn(384, generator=gen)


@pytest.mark.parametrize("rows", [4, 9, 16, 40, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_few_rows_go_through_the_packed_weight_and_equal_f_linear(
    _fresh, rows: int, with_bias: bool
) -> None:
    w, b = _weights()
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = ops.linear(x, w, b if with_bias else None)
    want = F.linear(x.double(), w.double(), b.double() if with_bias else None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert _fresh == [rows] and len(cpu_packed._packed) == 1


@pytest.mark.parametrize("rows", [1, 3, 65, 300])
def test_one_row_and_many_rows_stay_with_f_linear(_fresh, rows: int) -> None:
    w, b = _weights()
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    assert _fresh == [] and len(cpu_packed._packed) == 0


def test_a_weight_changed_in_place_is_packed_again(_fresh) -> None:
    w, _ = _weights()
    x = torch.randn(4, 96)
    with torch.inference_mode():
        first = ops.linear(x, w)
        w.mul_(2.0)  # (a reload, an update of the weights)
        second = ops.linear(x, w)
    torch.testing.assert_close(second, 2.0 * first, rtol=1e-5, atol=1e-4)
    assert _fresh == [4, 4]


def test_past_the_memory_bound_new_weights_stay_with_f_linear(_fresh, monkeypatch) -> None:
    w1, _ = _weights(1)
    w2, _ = _weights(2)
    monkeypatch.setattr(cpu_packed, "MAX_BYTES", w1.numel() * 4)  # room for one copy
    x = torch.randn(5, 96)
    with torch.inference_mode():
        ops.linear(x, w1)
        assert torch.equal(ops.linear(x, w2), F.linear(x, w2))
        ops.linear(x, w1)  # the first stays packed
    assert _fresh == [5, 5] and len(cpu_packed._packed) == 1


def test_autograd_other_dtypes_and_the_switch_leave_it_to_f_linear(_fresh, monkeypatch) -> None:
    w, _ = _weights()
    x = torch.randn(4, 96, requires_grad=True)
    ops.linear(x, w).sum().backward()  # (autograd on: a packed weight could not be saved)
    assert x.grad is not None
    with torch.inference_mode():
        ops.linear(x.detach().double(), w.double())
        monkeypatch.setattr(cpu_packed, "ENABLED", False)
        ops.linear(x.detach(), w)
    assert _fresh == []
