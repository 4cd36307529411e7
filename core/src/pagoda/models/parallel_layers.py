"""Tensor-parallel layers, Megatron's split: each rank holds a slice of every large weight.

- Column-parallel linear: the output rows are split; each rank computes its part of the output
  and keeps it (q/k/v by heads, gate/up by shard), so attention and SiLU-and-multiply run on the
  rank's heads and columns alone.
- Row-parallel linear: the input columns are split; each rank's partial product is summed over
  the ranks (one all-reduce), after which every rank holds the whole output.
- Vocabulary-parallel embedding and LM head: the vocabulary is split; the embedding sums the
  rows found on each rank, the LM head gathers every rank's logits.

Each layer loads its slice straight from the checkpoint tensor (``load_weight``), reading only
its part of a safetensors file. With one rank these are the plain layers: no communication.

A linear built with a quantization method's :class:`~pagoda.quantization.LinearMethod`
(``quant``) holds the weights the method creates, hands it every checkpoint tensor but the bias
with the place its part lands (:class:`~pagoda.quantization.LinearSlice`), and computes through
it; the bias stays the layer's own, in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from pagoda.loader.sharded import WeightSlice, as_slice
from pagoda.ops import linear
from pagoda.quantization.method import LinearMethod, LinearSlice
from pagoda.utils import cdiv


def _check(what: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"checkpoint weight {what} has shape {got}, the model expects {want}")


def _copy(param: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(src)


def copy_weight(param: torch.Tensor, name: str, weight: torch.Tensor | WeightSlice) -> None:
    """Copy the whole checkpoint tensor ``weight`` (or lazy slice, read whole) named ``name``
    into the unsplit ``param``; another shape is an error that names both."""
    full = as_slice(weight).full()
    _check(repr(name), tuple(full.shape), tuple(param.shape))
    _copy(param, full)


@dataclass(frozen=True, slots=True)
class Part:
    """One projection of a column-parallel layer: ``size`` output rows in the checkpoint, of
    which this rank holds ``local`` from ``start``."""

    name: str
    size: int
    start: int
    local: int


def split_evenly(name: str, size: int) -> Part:
    """``size`` rows split over the ranks in order (``size`` divides evenly: checked at start)."""
    local = size // get_tp_size()
    return Part(name, size, get_tp_rank() * local, local)


def _init_linear(
    layer: nn.Linear, in_features: int, out_features: int, bias: bool, quant: LinearMethod | None
) -> None:
    """``nn.Linear``'s own weights, or (``quant``) the method's and a bias of the model's dtype."""
    if quant is None:
        nn.Linear.__init__(layer, in_features, out_features, bias=bias)
        layer.quant_method = None
        return
    # NOTE: on the meta device: the method's weights replace it, nothing is allocated for it.
    nn.Linear.__init__(layer, in_features, out_features, bias=False, device="meta")
    layer.quant_method = quant
    del layer.weight
    quant.create_weights(layer, in_features, out_features, torch.get_default_dtype())
    if bias:
        layer.bias = nn.Parameter(torch.empty(out_features))


class ColumnParallelLinear(nn.Linear):
    """One or several projections of one input (q/k/v, gate/up) in one matmul, each projection's
    output rows split over the ranks; the output stays split."""

    def __init__(
        self, in_features: int, parts: list[Part], bias: bool, quant: LinearMethod | None = None
    ) -> None:
        _init_linear(self, in_features, sum(p.local for p in parts), bias, quant)
        self.parts: dict[str, tuple[int, Part]] = {}
        off = 0
        for p in parts:
            self.parts[p.name] = (off, p)
            off += p.local

    def load_weight(
        self, param_name: str, w: torch.Tensor | WeightSlice, shard: str | None = None
    ) -> None:
        off, part = self.parts[shard or ""]
        w = as_slice(w)
        if self.quant_method is not None and param_name != "bias":
            where = LinearSlice(
                shard or "", off, part.start, part.local, part.size, 0, self.in_features,
                self.in_features,
            )  # fmt: skip
            if param_name == "weight":
                _check(f"{shard}.weight" if shard else "weight", w.shape,
                       (part.size, self.in_features))  # fmt: skip
            self.quant_method.load_weight(self, param_name, w, where)
            return
        label = f"{shard}.{param_name}" if shard else param_name
        param = getattr(self, param_name)
        _check(label, w.shape, (part.size, *param.shape[1:]))
        _copy(param[off : off + part.local], w.narrow(0, part.start, part.local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """``in_features`` (the checkpoint's) split over the ranks; the partial products are summed
    over the ranks, so every rank gets the whole output."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, quant: LinearMethod | None = None
    ) -> None:
        self.in_total = in_features
        self.in_start = get_tp_rank() * (in_features // get_tp_size())
        _init_linear(self, in_features // get_tp_size(), out_features, bias, quant)

    def load_weight(
        self, param_name: str, w: torch.Tensor | WeightSlice, shard: str | None = None
    ) -> None:
        w = as_slice(w)
        if param_name == "bias":
            _check("bias", w.shape, (self.out_features,))
            _copy(self.bias, w.full())
            return
        if self.quant_method is not None:
            if param_name == "weight":
                _check(param_name, w.shape, (self.out_features, self.in_total))
            n = self.out_features
            where = LinearSlice(
                shard or "", 0, 0, n, n, self.in_start, self.in_features, self.in_total
            )
            self.quant_method.load_weight(self, param_name, w, where)
            return
        _check(param_name, w.shape, (self.out_features, self.in_total))
        _copy(self.weight, w.narrow(1, self.in_start, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = all_reduce(self.quant_method.apply(self, x, None))
        else:
            y = all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows split over the ranks (the last rank's padded with zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = cdiv(vocab_size, get_tp_size())
        self.start = get_tp_rank() * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)  # rows from the checkpoint
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size))

    def load_weight(
        self, param_name: str, w: torch.Tensor | WeightSlice, shard: str | None = None
    ) -> None:
        w = as_slice(w)
        _check(param_name, w.shape, (self.vocab_size, self.weight.shape[1]))
        n = self.end - self.start
        _copy(self.weight[:n], w.narrow(0, self.start, n))
        if n < self.per_rank:
            with torch.no_grad():
                self.weight[n:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        x = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, its vocabulary split like the embedding (so the two may share one
    weight); ``forward`` returns every rank's logits gathered: ``[tokens, vocab_size]``."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = all_gather_last_dim(linear(hidden, self.weight))
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
