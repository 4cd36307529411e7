"""The model's linears with the batched LoRA path: each wrapped layer holds every device slot's
A and B (zeros where a slot's adapter does not target it) and adds the low-rank product of
each token's adapter to the base output.

Under tensor parallelism the LoRA weights are split like the base weight: a column-parallel
layer (q/k/v, gate/up) keeps A whole and this rank's rows of each projection's B; a row-parallel
layer (o, down) keeps this rank's columns of A and B whole, and its partial product joins the
base's before the one all-reduce (the sum over ranks of ``B (A_r x_r)`` is ``B (A x)``).

A layer stacks every slot's A under its base weight in one buffer (``folded``; the base weight
and ``lora_a`` are views of it, so nothing is held twice): a rows step of the ``folded`` decode
kernel (:mod:`pagoda.ops.lora`) runs one GEMM for the base output and every slot's shrink, then
the expand alone. A row-parallel layer's stacked A is this rank's columns, so its GEMM gives the
partial shrink, and ``B (A_r x_r)`` still joins the base before the all-reduce.

The step's slots come from a shared ``LoRAContext``, set by the runner before each forward
(``batch`` None: no adapter in the step, the base path alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from pagoda.distributed import all_reduce, get_tp_size
from pagoda.lora.peft import AdapterWeights
from pagoda.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from pagoda.ops import linear
from pagoda.ops import lora as lora_ops
from pagoda.ops.lora import LoRABatch, add_lora

#: A wrapped layer's name (the last part of its module path) -> the checkpoint projections it
#: merges, in the order of its output columns.
MERGED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class LoRAContext:
    """The step's adapter slots, read by every wrapped layer (None: none this step)."""

    batch: LoRABatch | None = None


class _Slice(NamedTuple):
    """One projection of a wrapped layer: its rows ``offset .. offset + local`` of this rank's
    output are the checkpoint's rows ``start .. start + local``."""

    name: str
    offset: int
    local: int
    start: int


class LoRALinear(nn.Module):
    """A column- or row-parallel linear of layer ``layer`` with ``num_slots`` adapter slots of
    rank ``max_rank``."""

    def __init__(
        self,
        base: ColumnParallelLinear | RowParallelLinear,
        layer: int,
        projections: tuple[str, ...],
        context: LoRAContext,
        num_slots: int,
        max_rank: int,
    ) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.context = context
        self.max_rank = max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        w = base.weight
        if self.row_parallel:
            self.slices = [_Slice(projections[0], 0, base.out_features, 0)]
        else:
            self.slices = [
                _Slice(name, base.parts[name][0], base.parts[name][1].local,
                       base.parts[name][1].start)
                for name in projections
            ]  # fmt: skip
        n = len(self.slices)
        # Where each slice after the first starts in the output (``pagoda.ops.lora.expand``).
        self.bounds = tuple(s.offset for s in self.slices[1:])
        kw = {"dtype": w.dtype, "device": w.device}
        out_rows, in_cols = w.shape
        # The rows a slot's A takes in the stacked weight: its slices' ranks in turn.
        self.slot_stride = n * max_rank
        # A quantized base (FP8 weights and their scales) or any weight that is not a plain
        # float matrix cannot take float rows of A under it: such a layer keeps A apart and
        # runs ``bgmv`` (``add_lora``'s answer to ``folded``).
        # NOTE: the engine refuses LoRA over quantized linears today; this keeps the layer
        # right if that changes.
        self.can_fold = getattr(base, "quant_method", None) is None and w.dtype.is_floating_point
        # NOTE: buffers, not parameters: the checkpoint loader never sees them. The layer is
        # wrapped after loading, so the stacked buffer starts from the loaded weight.
        if self.can_fold:
            folded = torch.empty(out_rows + num_slots * self.slot_stride, in_cols, **kw)
            with torch.no_grad():
                folded[:out_rows].copy_(w)
                folded[out_rows:].zero_()
            # NOTE: not in the state dict (it holds the base weight again); the views below
            # share its storage only while no ``.to()`` moves the module, done before wrapping.
            self.register_buffer("folded", folded, persistent=False)
            # The base weight becomes a view of the stacked buffer's first rows, freeing its
            # own storage: the model holds the weight once, and every path (the segments', a
            # step without adapters, the other kernels) reads the same bytes.
            base.weight.data = folded[:out_rows]
            if not base.weight.is_contiguous():  # (a view of whole leading rows: always)
                raise RuntimeError("the base weight's view of the stacked weight is strided")
            self.register_buffer(
                "lora_a", folded[out_rows:].view(num_slots, self.slot_stride, in_cols)
            )
            # A column-parallel bias (row-parallel layers add theirs after the all-reduce),
            # zeros for the shrink columns: the folded GEMM adds it as the base GEMM does.
            bias = None
            if base.bias is not None and not self.row_parallel:
                bias = torch.zeros(folded.shape[0], dtype=base.bias.dtype, device=w.device)
                bias[:out_rows].copy_(base.bias.detach())
            self.register_buffer("folded_bias", bias, persistent=False)
        else:
            self.register_buffer("folded", None)
            self.register_buffer("folded_bias", None)
            self.register_buffer("lora_a", torch.zeros(num_slots, self.slot_stride, in_cols, **kw))
        self.register_buffer("lora_b", torch.zeros(num_slots, out_rows, max_rank, **kw))

    def _folds(self, batch: LoRABatch | None) -> bool:
        """Whether this step runs the ``folded`` kernel here (read at each call, so that the
        kernel a CUDA graph captures is the one selected then)."""
        return (
            batch is not None
            and batch.use_rows
            and self.can_fold
            and lora_ops.DECODE_KERNEL == "folded"
        )

    def _folded(self, x: torch.Tensor, batch: LoRABatch, bias: torch.Tensor | None) -> torch.Tensor:
        """One GEMM over the stacked weight (the base output, then every slot's shrink), the
        expand added into the base columns; returns those columns, a view whose rows are
        strided by the stacked width (its last dimension stays unit-stride). No copy: the
        consumers take a row stride as they took the split of q | k | v, which was strided
        already (the split and the heads' reshape are views; the rotary, norm and attention
        kernels read strides), ``silu_and_mul`` reads the row stride of gate | up, ``rms_norm``
        (with the residual's sum, after o and down) too. Only the all-reduce of a row-parallel
        layer over several ranks wants a dense tensor (``forward``)."""
        n = self.base.weight.shape[0]
        y = linear(x, self.folded, bias)
        lora_ops.expand_folded(y, n, self.lora_b, batch, self.bounds, self.slot_stride)
        return y[:, :n]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, batch = self.base, self.context.batch
        if self.row_parallel:
            if self._folds(batch):
                y = self._folded(x, batch, None)
                # NOTE: the collective reduces dense tensors only; a single rank's is a no-op.
                if get_tp_size() > 1:
                    y = y.contiguous()
            else:
                y = linear(x, base.weight)
                if batch is not None:
                    add_lora(x, self.lora_a, self.lora_b, batch, y)
            y = all_reduce(y)
            return y if base.bias is None else y + base.bias
        if self._folds(batch):
            return self._folded(x, batch, self.folded_bias)
        y = linear(x, base.weight, base.bias)
        if batch is not None:
            add_lora(x, self.lora_a, self.lora_b, batch, y, self.bounds)
        return y

    @torch.no_grad()
    def set_slot(self, slot: int, adapter: AdapterWeights | None) -> None:
        """Write ``adapter``'s weights of this layer into ``slot`` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if adapter is None:
            return
        r, big_r = adapter.rank, self.max_rank
        for i, (name, off, local, start) in enumerate(self.slices):
            pair = adapter.weights.get((self.layer, name))
            if pair is None:
                continue
            a, b = pair
            if self.row_parallel:  # this rank's input columns of A, all of B
                a = a.narrow(1, self.base.in_start, self.base.in_features)
            else:  # all of A, this rank's rows of the projection's B
                b = b.narrow(0, start, local)
            self.lora_a[slot, i * big_r : i * big_r + r].copy_(a)
            self.lora_b[slot, off : off + local, :r].copy_(b)


def wrap_model(
    model: nn.Module, context: LoRAContext, num_slots: int, max_rank: int
) -> list[LoRALinear]:
    """Replace the model's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` (of the
    layers this process holds) by ``LoRALinear`` wrappers; returns them."""
    wrapped: list[LoRALinear] = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in MERGED or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        parts = name.split(".")
        if "layers" not in parts:
            continue
        layer = int(parts[parts.index("layers") + 1])
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        lora = LoRALinear(module, layer, MERGED[leaf], context, num_slots, max_rank)
        setattr(parent, leaf, lora)
        wrapped.append(lora)
    if not wrapped:
        raise ValueError(f"{type(model).__name__} has no linear layers LoRA can wrap")
    return wrapped
