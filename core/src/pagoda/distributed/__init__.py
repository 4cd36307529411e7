"""Tensor parallelism: the rank's place in its group, the collectives the model needs, and the
channel between an executor and its worker processes (msgpack over ZMQ, never pickle)."""

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
