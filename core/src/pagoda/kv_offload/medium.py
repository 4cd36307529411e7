"""Where a worker keeps offloaded blocks and how it copies them: the medium's interface.

The scheduler's side speaks of pool slots only (``KVTransfers``); a medium gives the slots
memory and moves blocks between them and the device's KV cache. The core's medium, ``cpu``
(``pagoda.kv_offload.cpu``), keeps them in (pinned) host memory; a plugin registers others
(a local disk, another host) through ``register_offload_mediums``, chosen with
``cache.offload_medium``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from pagoda.config import CacheConfig
from pagoda.distributed import get_tp_size
from pagoda.kv_offload.sizing import num_cpu_blocks
from pagoda.models.shape import ModelShape
from pagoda.plugins import get_registry
from pagoda.plugins.errors import PluginError
from pagoda.step import KVTransfers


class OffloadMedium(ABC):
    """One worker's part of the offload pool. Built once per worker, after its KV cache."""

    def __init__(self, kv_caches: list[torch.Tensor], block_dim: int, num_blocks: int) -> None:
        """``kv_caches``: this worker's cache tensors, one per layer, whose dimension
        ``block_dim`` counts blocks; ``num_blocks``: the pool's slots. ``self.layers`` holds each
        layer's cache as a view with blocks first (``layers[l][block_id]`` is one block)."""
        if not kv_caches:
            raise ValueError("KV offload needs the KV cache allocated first")
        self.layers = [kv.movedim(block_dim, 0) for kv in kv_caches]
        self.num_blocks = num_blocks

    @abstractmethod
    def submit(self, transfers: KVTransfers) -> None:
        """Start one step's job and return without waiting for it: stores (device block
        ``store_gpu[i]`` into slot ``store_cpu[i]``), then loads (slot ``load_cpu[i]`` into
        device block ``load_gpu[i]``). Called by the model runner once per step that carries
        transfers, before that step's forward is queued. A CUDA medium makes the step's stream
        wait for the job's stores when ``transfers.stores_first`` and for the jobs named in
        ``transfers.wait_jobs``; a store must read what every step queued before it wrote."""

    @abstractmethod
    def poll(self, wait: bool = False) -> list[int]:
        """The ids of submitted jobs whose copies are all done (loaded bytes in the device
        blocks, stored bytes readable from their slots), each reported once; ``wait``: wait
        for every submitted job first. Called when each step's output is read."""

    @property
    @abstractmethod
    def num_in_flight(self) -> int:
        """Jobs submitted and not yet reported done."""


def block_dim(
    shape_of: Callable[..., tuple[int, ...]], block_size: int, num_kv_heads: int, head_size: int
) -> int:
    """Which dimension of a layer's cache tensor counts blocks, asked of the attention
    backend's ``get_kv_cache_shape`` with two block counts."""
    a = shape_of(2, block_size, num_kv_heads, head_size)
    b = shape_of(3, block_size, num_kv_heads, head_size)
    dims = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(dims) != 1:
        raise ValueError(f"cannot tell the block dimension of KV cache shape {tuple(b)}")
    return dims[0]


def build_offload_medium(
    cache: CacheConfig,
    shape: ModelShape,
    kv_caches: list[torch.Tensor],
    kv_cache_shape: Callable[..., tuple[int, ...]],
) -> OffloadMedium | None:
    """The medium over a worker's allocated KV cache (``kv_caches``, one tensor per layer, laid
    out as the attention backend's ``get_kv_cache_shape`` says); None when offload is off."""
    n = num_cpu_blocks(cache, shape, kv_caches[0].dtype, get_tp_size())
    if n == 0:
        return None
    layouts = {(s.num_kv_heads, s.cache_head_size) for s in shape.attention}
    if len(layouts) > 1:
        raise ValueError(
            f"cache.cpu_offload_gb > 0: KV offload moves blocks of layers that share one layout, "
            f"and {shape.architecture}'s layers have {len(layouts)} (KV heads, head size) "
            f"layouts {sorted(layouts)}; set cache.cpu_offload_gb=0"
        )
    ((num_kv_heads, head_size),) = layouts
    try:
        cls = get_registry("offload_mediums").get(cache.offload_medium)
    except PluginError as e:
        raise ValueError(f"cache.offload_medium={cache.offload_medium!r}: {e}") from e
    dim = block_dim(kv_cache_shape, cache.block_size, num_kv_heads, head_size)
    return cls(kv_caches, dim, n)
