"""How many KV blocks the CPU pool holds: ``cache.cpu_offload_gb`` over one block's bytes."""

from __future__ import annotations

import torch

from pagoda.config import CacheConfig
from pagoda.models.shape import ModelShape


def block_bytes_per_rank(cache: CacheConfig, shape: ModelShape, dtype: torch.dtype) -> int:
    """Bytes of one KV block (keys and values, every layer) on one tensor-parallel rank."""
    return cache.block_size * shape.kv_bytes_per_token(dtype.itemsize)


def num_cpu_blocks(cache: CacheConfig, shape: ModelShape, dtype: torch.dtype, tp_size: int) -> int:
    """Blocks of the CPU pool (0: offload is off). ``cpu_offload_gb`` is summed over the ranks,
    each of which keeps its own part of every block (``shape`` is one rank's)."""
    if cache.cpu_offload_gb <= 0:
        return 0
    per_block = block_bytes_per_rank(cache, shape, dtype) * tp_size
    n = int(cache.cpu_offload_gb * 2**30) // per_block
    if n < 1:
        raise ValueError(
            f"cache.cpu_offload_gb={cache.cpu_offload_gb} holds no KV block of {per_block} bytes;"
            " raise it, or set 0 to turn KV offload off"
        )
    return n
