"""Reading a tensor-parallel rank's part of a checkpoint, and never the whole weight.

GGUF files reach here too: the loader converts them once into a safetensors folder (cached), and
each rank reads its slices of that.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagoda.loader.weights import safetensors_files


class WeightSlice:
    """A checkpoint tensor read only as far as asked (``narrow``); wraps a tensor in memory too,
    so that model code loads both the same way."""

    __slots__ = ("_src",)

    def __init__(self, source: Any) -> None:
        self._src = source  # a torch.Tensor, or a safetensors slice (read on indexing)

    @property
    def shape(self) -> tuple[int, ...]:
        if isinstance(self._src, torch.Tensor):
            return tuple(self._src.shape)
        return tuple(self._src.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if isinstance(self._src, torch.Tensor):
            return self._src.narrow(dim, start, length)
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._src[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._src if isinstance(self._src, torch.Tensor) else self._src[...]


def as_slice(w: torch.Tensor | WeightSlice) -> WeightSlice:
    return w if isinstance(w, WeightSlice) else WeightSlice(w)


def iter_safetensors_slices(folder: str | Path) -> Iterator[tuple[str, WeightSlice]]:
    """(Hugging Face name, lazy slice) for every tensor of the folder's safetensors files; a
    slice stays readable until the next one is yielded."""
    # NOTE: safetensors loads only where weights are read.
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, WeightSlice(f.get_slice(name))
