"""This process's rank in the tensor-parallel group, and the group's collectives.

A worker calls :func:`init_tensor_parallel` once, before it builds the model; the model's
parallel layers read :func:`get_tp_rank` and :func:`get_tp_size` when they are built and call
:func:`all_reduce` and :func:`all_gather_last_dim` in the forward pass. Without it (one rank) the
size is 1 and the collectives return their input.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagoda.loader.arch import ModelArchConfig

_rank = 0
_size = 1
# NOTE: named all_gather_single in newer torch, all_gather_into_tensor (deprecated) before.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_tensor_parallel(
    rank: int, size: int, init_method: str, backend: str, device: torch.device
) -> None:
    """Join the group of ``size`` ranks at ``init_method`` (``tcp://host:port``) as ``rank``:
    ``backend`` is ``nccl`` on GPUs, ``gloo`` on CPUs."""
    global _rank, _size
    if size > 1:
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=size,
            rank=rank,
            timeout=datetime.timedelta(minutes=30),
        )
        # NOTE: the first collective sets the communicator up: here, not inside a graph capture.
        dist.all_reduce(torch.zeros(1, device=device))
    _rank, _size = rank, size


def destroy_tensor_parallel() -> None:
    global _rank, _size
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size = 0, 1


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (what follows a row-parallel layer)."""
    if _size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order."""
    if _size == 1:
        return x
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((_size * rows.shape[0], rows.shape[1]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, rows)
    out = out.view(_size, rows.shape[0], rows.shape[1]).transpose(0, 1)
    return out.reshape(*x.shape[:-1], _size * x.shape[-1])


@dataclass(frozen=True, slots=True)
class TPShape:
    """How a model's heads fall on one rank."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 where ranks share a replicated head)
    kv_head_start: int  # the first of them in the checkpoint
    kv_replicas: int  # ranks that hold each KV head (1: split, not replicated)


def check_tensor_parallel(arch: ModelArchConfig, size: int) -> None:
    """Refuse, naming the numbers, a size that does not split the model evenly."""
    problems = []
    if arch.num_attention_heads % size:
        problems.append(f"{arch.num_attention_heads} attention heads")
    kv = arch.num_key_value_heads
    if kv % size and size % kv:
        problems.append(
            f"{kv} KV heads (the size must divide them, or be a multiple of them so that each "
            "is replicated)"
        )
    if arch.intermediate_size % size:
        problems.append(f"an MLP of intermediate size {arch.intermediate_size}")
    if problems:
        raise ValueError(
            f"parallel.tensor_parallel_size={size} does not divide {arch.architecture}'s "
            + " nor ".join(problems)
            + f"; sizes that fit: {', '.join(map(str, _fitting_sizes(arch)))}"
        )


def _fitting_sizes(arch: ModelArchConfig) -> list[int]:
    out = []
    for n in range(1, arch.num_attention_heads + 1):
        kv = arch.num_key_value_heads
        if (
            arch.num_attention_heads % n == 0
            and (kv % n == 0 or n % kv == 0)
            and arch.intermediate_size % n == 0
        ):
            out.append(n)
    return out


def tp_shape(arch: ModelArchConfig, rank: int | None = None, size: int | None = None) -> TPShape:
    """Heads on ``rank`` of ``size`` (default: this process's)."""
    rank = _rank if rank is None else rank
    size = _size if size is None else size
    check_tensor_parallel(arch, size)
    kv = arch.num_key_value_heads
    if kv >= size:
        per = kv // size
        return TPShape(arch.num_attention_heads // size, per, rank * per, 1)
    replicas = size // kv
    return TPShape(arch.num_attention_heads // size, 1, rank // replicas, replicas)
