"""Tensor and pipeline parallelism's parallel state: the rank's place in its group and stage,
its shard shapes and layers, the collectives and the stage-to-stage sends the model needs.

Floor: leaves. It imports only other leaves (the loader's architecture config); the worker
processes and their channel are the executor's (``pagoda.executor``).
"""

from __future__ import annotations

from pagoda.distributed.parallel_state import (
    TPShape,
    all_gather_last_dim,
    all_reduce,
    check_tensor_parallel,
    destroy_parallel,
    get_pp_rank,
    get_pp_size,
    get_tp_rank,
    get_tp_size,
    init_parallel,
    is_first_stage,
    is_last_stage,
    recv_from_prev_stage,
    send_to_next_stage,
    stage_layers,
    tp_shape,
)
from pagoda.distributed.partition import split_layers

__all__ = [
    "TPShape",
    "all_gather_last_dim",
    "all_reduce",
    "check_tensor_parallel",
    "destroy_parallel",
    "get_pp_rank",
    "get_pp_size",
    "get_tp_rank",
    "get_tp_size",
    "init_parallel",
    "is_first_stage",
    "is_last_stage",
    "recv_from_prev_stage",
    "send_to_next_stage",
    "split_layers",
    "stage_layers",
    "tp_shape",
]
