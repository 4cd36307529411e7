"""The model's linears with the batched LoRA path: each wrapped layer holds every device slot's
A and B (zeros where a slot's adapter does not target it) and adds the low-rank product of
each token's adapter to the base output.

Under tensor parallelism the LoRA weights are split like the base weight: a column-parallel
layer (q/k/v, gate/up) keeps A whole and this rank's rows of each projection's B; a row-parallel
layer (o, down) keeps this rank's columns of A and B whole, and its partial product joins the
base's before the one all-reduce (the sum over ranks of ``B (A_r x_r)`` is ``B (A x)``).

The step's slots come from a shared ``LoRAContext``, set by the runner before each forward
(``batch`` None: no adapter in the step, the base path alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from pagoda.distributed import all_reduce
from pagoda.lora.peft import AdapterWeights
from pagoda.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from pagoda.ops import linear
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
        # NOTE: buffers, not parameters: the checkpoint loader never sees them.
        self.register_buffer("lora_a", torch.zeros(num_slots, n * max_rank, w.shape[1], **kw))
        self.register_buffer("lora_b", torch.zeros(num_slots, w.shape[0], max_rank, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, batch = self.base, self.context.batch
        if self.row_parallel:
            y = linear(x, base.weight)
            if batch is not None:
                add_lora(x, self.lora_a, self.lora_b, batch, y)
            y = all_reduce(y)
            return y if base.bias is None else y + base.bias
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
