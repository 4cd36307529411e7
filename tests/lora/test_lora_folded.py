"""The ``folded`` decode kernel in a wrapped layer (``LoRALinear``): every slot's A stacked under
the base weight, one GEMM for the base output and every slot's shrink, then the expand of each
row's own slot. Against the rows reference (``add_lora``'s torch path) for a q | k | v
column-parallel layer and a row-parallel one, after a slot is rewritten and cleared, and two
ranks' row-parallel halves summed; the base weight is a view of the stacked one."""

from __future__ import annotations

import pytest
import torch

from pagoda.lora import layers
from pagoda.lora.layers import LoRAContext, LoRALinear
from pagoda.lora.peft import AdapterWeights
from pagoda.models import parallel_layers
from pagoda.models.parallel_layers import ColumnParallelLinear, RowParallelLinear, split_evenly
from pagoda.ops import linear
from pagoda.ops import lora as lora_ops

K, SIZES, SLOTS, MAX_RANK = 16, {"q_proj": 12, "k_proj": 6, "v_proj": 6}, 3, 4
# Rows of a decode step (a graph's padding rows after them: -1): two slots, rows without one.
ROWS = [0, -1, 2, 1, 0, -1, 1]


@pytest.fixture(autouse=True)
def _folded(monkeypatch) -> None:
    """The folded kernel selected whatever the environment says, and no rows step of a layer
    that folds reaching ``add_lora`` (its rows go through the stacked weight)."""
    monkeypatch.setattr(lora_ops, "DECODE_KERNEL", "folded")


def _adapter(seed: int, rank: int, shapes: dict[str, tuple[int, int]]) -> AdapterWeights:
    """Layer 0's ``shapes`` (projection -> (inputs, outputs)) with random A and B."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        (0, name): (torch.randn(rank, k, generator=g), torch.randn(n, rank, generator=g))
        for name, (k, n) in shapes.items()
    }
    return AdapterWeights(None, rank, weights)  # type: ignore[arg-type]


def _batch(rows: list[int]) -> lora_ops.LoRABatch:
    slots = torch.tensor(rows + [-1, -1], dtype=torch.int32)
    zeros = torch.zeros(1, dtype=torch.int32)
    return lora_ops.LoRABatch(slots, zeros, zeros, 1, [], use_rows=True)


def _qkv(bias: bool = True) -> tuple[LoRALinear, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    base = ColumnParallelLinear(K, [split_evenly(n, s) for n, s in SIZES.items()], bias=bias)
    weight = base.weight.detach().clone()
    b = None if base.bias is None else base.bias.detach().clone()
    layer = LoRALinear(base, 0, tuple(SIZES), LoRAContext(), SLOTS, MAX_RANK)
    return layer, weight, b


def _want(layer: LoRALinear, x: torch.Tensor, batch: lora_ops.LoRABatch) -> torch.Tensor:
    """The base output plus each row's adapter, by the rows reference (``bgmv``'s torch path)."""
    base = layer.base
    y = linear(x, base.weight, None if layer.row_parallel else base.bias)
    lora_ops.add_lora(x, layer.lora_a, layer.lora_b, batch, y, layer.bounds, kernel="bgmv")
    return y if base.bias is None or not layer.row_parallel else y + base.bias


def _run(layer: LoRALinear, x: torch.Tensor, batch, monkeypatch) -> torch.Tensor:
    def unfolded(*args, **kw):
        raise AssertionError("a folding layer's rows step reached add_lora")

    with monkeypatch.context() as m:
        m.setattr(layers, "add_lora", unfolded)
        layer.context.batch = batch
        try:
            return layer(x)
        finally:
            layer.context.batch = None


def test_the_base_weight_is_a_view_of_the_stacked_weight() -> None:
    """Held once: the base weight, then every slot's A, in one buffer; a step without adapters
    (batch None) is the base output bit for bit."""
    layer, weight, bias = _qkv()
    n = sum(SIZES.values())
    assert layer.folded.shape == (n + SLOTS * 3 * MAX_RANK, K)
    assert layer.base.weight.data_ptr() == layer.folded.data_ptr()
    assert layer.base.weight.is_contiguous() and torch.equal(layer.base.weight, weight)
    assert layer.lora_a.data_ptr() == layer.folded[n:].data_ptr()
    x = torch.randn(5, K)
    assert torch.equal(layer(x), linear(x, weight, bias))  # batch None: the base path alone


def test_folded_rows_match_the_reference_through_slot_rewrites_and_clears(monkeypatch) -> None:
    """q | k | v with a bias, three slots (one adapter on all three slices, one on q and v at a
    lower rank, one on k), rows on no slot among them; then slot 1 rewritten (the stacked
    weight must hold its new A) and cleared."""
    layer, weight, bias = _qkv()
    shapes = {name: (K, size) for name, size in SIZES.items()}
    layer.set_slot(0, _adapter(1, 4, shapes))
    layer.set_slot(1, _adapter(2, 2, {k: shapes[k] for k in ("q_proj", "v_proj")}))
    layer.set_slot(2, _adapter(3, 3, {"k_proj": shapes["k_proj"]}))
    x = torch.randn(len(ROWS), K, generator=torch.Generator().manual_seed(9))
    batch = _batch(ROWS)
    base = linear(x, weight, bias)

    got = _run(layer, x, batch, monkeypatch)
    want = _want(layer, x, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    none = torch.tensor(ROWS) < 0
    torch.testing.assert_close(got[none], base[none], atol=1e-5, rtol=1e-5)
    assert (got[~none] - base[~none]).abs().amax(dim=1).gt(1e-3).all()  # every adapter row moved
    # Row 3 (slot 1) by hand: q and v moved by B (A x), k not (slot 1 has no k).
    a_q, b_q = _adapter(2, 2, {"q_proj": shapes["q_proj"]}).weights[(0, "q_proj")]
    torch.testing.assert_close(got[3, :12], base[3, :12] + b_q @ (a_q @ x[3]), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[3, 12:18], base[3, 12:18], atol=1e-5, rtol=0)

    layer.set_slot(1, _adapter(4, 4, shapes))  # another adapter in slot 1: all three slices
    n, stride = sum(SIZES.values()), layer.slot_stride
    new_a = _adapter(4, 4, shapes).weights[(0, "k_proj")][0]
    assert torch.equal(layer.folded[n + stride + MAX_RANK : n + stride + 2 * MAX_RANK], new_a)
    got = _run(layer, x, batch, monkeypatch)
    torch.testing.assert_close(got, _want(layer, x, batch), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[3, 12:18], base[3, 12:18])

    layer.set_slot(1, None)  # cleared: slot 1's rows are the base model's
    got = _run(layer, x, batch, monkeypatch)
    slot1 = torch.tensor(ROWS) == 1
    torch.testing.assert_close(got[slot1], base[slot1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, _want(layer, x, batch), atol=1e-5, rtol=1e-5)


def test_row_parallel_folded_rows_and_two_ranks_halves_sum_to_the_whole(monkeypatch) -> None:
    """o: one rank's layer against the reference (its bias after the reduce); then the same
    weights split over two ranks' input columns: each rank's folded step (its columns of A: a
    partial shrink, expanded by the whole B) summed is the one rank's output, B (A x)."""
    k, n = 24, 16
    torch.manual_seed(1)
    whole = RowParallelLinear(k, n, bias=True)
    w, bias = whole.weight.detach().clone(), whole.bias.detach().clone()
    layer = LoRALinear(whole, 0, ("o_proj",), LoRAContext(), SLOTS, MAX_RANK)
    adapters = [_adapter(5 + s, 4 - s, {"o_proj": (k, n)}) for s in range(SLOTS)]
    for s, adapter in enumerate(adapters):
        layer.set_slot(s, adapter)
    x = torch.randn(len(ROWS), k, generator=torch.Generator().manual_seed(8))
    batch = _batch(ROWS)
    got = _run(layer, x, batch, monkeypatch)
    torch.testing.assert_close(got, _want(layer, x, batch), atol=1e-5, rtol=1e-5)
    assert layer.base.weight.data_ptr() == layer.folded.data_ptr()

    halves = []
    for rank in range(2):
        with monkeypatch.context() as m:
            m.setattr(parallel_layers, "get_tp_size", lambda: 2)
            m.setattr(parallel_layers, "get_tp_rank", lambda r=rank: r)
            part = RowParallelLinear(k, n, bias=False)
        with torch.no_grad():
            part.weight.copy_(w[:, rank * k // 2 : (rank + 1) * k // 2])
        m_layer = LoRALinear(part, 0, ("o_proj",), LoRAContext(), SLOTS, MAX_RANK)
        for s, adapter in enumerate(adapters):
            m_layer.set_slot(s, adapter)
        with monkeypatch.context() as m:
            m.setattr(layers, "get_tp_size", lambda: 2)  # (the reduce of a dense copy)
            halves.append(_run(m_layer, x[:, rank * k // 2 : (rank + 1) * k // 2], batch, m))
    torch.testing.assert_close(halves[0] + halves[1] + bias, got, atol=1e-5, rtol=1e-5)


def test_a_quantized_base_keeps_a_apart_and_runs_bgmv(monkeypatch) -> None:
    """A base with a quantization method: no stacked weight, the rows step through add_lora."""
    layer, _, _ = _qkv(bias=False)
    base = ColumnParallelLinear(K, [split_evenly(n, s) for n, s in SIZES.items()], bias=False)
    base.quant_method = object()  # (only its presence matters to the wrapper)
    held = base.weight
    quant = LoRALinear(base, 0, tuple(SIZES), LoRAContext(), SLOTS, MAX_RANK)
    assert quant.folded is None and not quant.can_fold and base.weight is held
    assert quant.lora_a.shape == layer.lora_a.shape
    calls = []
    monkeypatch.setattr(layers, "add_lora", lambda *a, **kw: calls.append(kw))
    quant.context.batch = _batch(ROWS)
    quant(torch.randn(len(ROWS), K))
    assert len(calls) == 1
