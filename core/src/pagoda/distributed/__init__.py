"""Tensor parallelism's parallel state: the rank's place in its group, its shard shapes and the
collectives the model needs.

Floor: leaves. It imports only other leaves (the loader's architecture config); the worker
processes and their channel are the executor's (``pagoda.executor``).
"""

from __future__ import annotations

from pagoda.distributed.parallel_state import (
    TPShape,
    all_gather_last_dim,
    all_reduce,
    check_tensor_parallel,
    destroy_tensor_parallel,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
    tp_shape,
)

__all__ = [
    "TPShape",
    "all_gather_last_dim",
    "all_reduce",
    "check_tensor_parallel",
    "destroy_tensor_parallel",
    "get_tp_rank",
    "get_tp_size",
    "init_tensor_parallel",
    "tp_shape",
]
