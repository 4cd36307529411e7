"""KV offload: prefix-cached KV blocks that the device evicts live on in a CPU pool, and a
prefix lookup that misses on the device but hits the pool loads them back.

The scheduler's side (:class:`OffloadManager`, no torch) decides what to store, load and drop
(the policy, :class:`OffloadPolicy`, registered by name); the workers' side, an
:class:`OffloadMedium` (registered by name; the core's is ``cpu``), holds the pool's memory and
copies. Configuration: ``cache.cpu_offload_gb``, ``cache.offload_policy``,
``cache.offload_store``, ``cache.offload_medium``, ``cache.offload_overlap``; the plugin guide
(docs/plugins.md) has the contract.

Floor: contracts and features. Imports config, the plugin kernel and the leaves; it sees the KV
cache manager only through the ``BlockSource`` Protocol it declares (``manager.py``).
"""

from __future__ import annotations

from pagoda.kv_offload.manager import OffloadManager, OffloadStats
from pagoda.kv_offload.medium import OffloadMedium
from pagoda.kv_offload.policy import LRUPolicy, OffloadPolicy, build_policy
from pagoda.kv_offload.sizing import num_cpu_blocks
from pagoda.plugins import get_registry
from pagoda.plugins.errors import PluginError
from pagoda.step import KVTransfers

__all__ = [
    "KVTransfers",
    "LRUPolicy",
    "OffloadMedium",
    "OffloadManager",
    "OffloadPolicy",
    "OffloadStats",
    "build_offload_manager",
    "build_policy",
]


def build_offload_manager(config, info) -> OffloadManager | None:  # noqa: ANN001
    """The engine's offload manager, or None when ``cache.cpu_offload_gb`` is 0."""
    cache = config.cache
    n = num_cpu_blocks(cache, info.shape, info.dtype, config.parallel.tensor_parallel_size)
    if n == 0:
        return None
    if not cache.enable_prefix_caching:
        raise ValueError(
            "cache.cpu_offload_gb > 0 needs cache.enable_prefix_caching: the CPU pool keeps"
            " prefix-cached blocks by their hash"
        )
    try:  # built in the workers; its name is checked here, before anything loads
        get_registry("offload_mediums").registration(cache.offload_medium)
    except PluginError as e:
        raise ValueError(f"cache.offload_medium={cache.offload_medium!r}: {e}") from e
    policy = build_policy(cache.offload_policy, n)
    return OffloadManager(
        n,
        cache.block_size,
        policy,
        store_full=cache.offload_store == "full",
        overlap=cache.offload_overlap,
    )
