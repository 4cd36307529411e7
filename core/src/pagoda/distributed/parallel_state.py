"""This process's place among the engine's ranks: its tensor-parallel group and rank, its
pipeline stage and the stage's layers, and the collectives and stage-to-stage sends the model
needs.

A worker calls :func:`init_parallel` once, before it builds the model; the model's parallel
layers read :func:`get_tp_rank` and :func:`get_tp_size` when they are built and call
:func:`all_reduce` and :func:`all_gather_last_dim` in the forward pass; a model split into
pipeline stages reads :func:`stage_layers`, and the runner moves a stage's output on with
:func:`send_to_next_stage` / :func:`recv_from_prev_stage`. Without it (one rank) the sizes are 1,
the collectives return their input and the one stage holds every layer.

Ranks are numbered stage by stage (vLLM's layout): rank = stage * tensor_parallel_size + tp_rank;
the ranks of a stage form its tensor-parallel group, and each rank sends to the rank of the same
tp_rank in the next stage.
"""

from __future__ import annotations

import datetime
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagoda.loader.arch import ModelArchConfig

_rank = 0  # tensor-parallel rank
_size = 1  # tensor-parallel size
_group: dist.ProcessGroup | None = None  # this stage's tensor-parallel group (None: the world)
_pp_rank = 0
_pp_size = 1
_layers: tuple[int, int] | None = None  # this stage's decoder layers, [start, end)
_global_rank = 0
_sends: deque[tuple[dist.Work, torch.Tensor]] = deque()  # stage outputs still being sent
# NOTE: named all_gather_single in newer torch, all_gather_into_tensor (deprecated) before.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_parallel(
    rank: int,
    tensor_parallel_size: int,
    init_method: str,
    backend: str,
    device: torch.device,
    *,
    pipeline_parallel_size: int = 1,
    stage_layers: tuple[int, int] | None = None,
) -> None:
    """Join the group of ``tensor_parallel_size * pipeline_parallel_size`` ranks at
    ``init_method`` (``tcp://host:port``) as ``rank``: ``backend`` is ``nccl`` on GPUs, ``gloo``
    on CPUs. ``stage_layers`` is this rank's stage's ``[start, end)`` of the decoder layers
    (``pagoda.distributed.partition.split_layers``), needed with more than one stage."""
    global _rank, _size, _group, _pp_rank, _pp_size, _layers, _global_rank
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if pp > 1 and stage_layers is None:
        raise ValueError("a pipeline stage needs its layers (stage_layers)")
    world = tp * pp
    group = None
    if world > 1:
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world,
            rank=rank,
            timeout=datetime.timedelta(minutes=30),
        )
        if pp > 1:
            # NOTE: every rank creates every stage's group, in the same order.
            for stage in range(pp):
                g = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
                if stage == rank // tp:
                    group = g
        # NOTE: the first collective sets the communicator up: here, not inside a graph capture.
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    _global_rank = rank
    _rank, _size, _group = rank % tp, tp, group
    _pp_rank, _pp_size = rank // tp, pp
    _layers = stage_layers if pp > 1 else None


def destroy_parallel() -> None:
    global _rank, _size, _group, _pp_rank, _pp_size, _layers, _global_rank
    while _sends:
        _sends.popleft()[0].wait()
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _group, _pp_rank, _pp_size, _layers, _global_rank = 0, 1, None, 0, 1, None, 0


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _size


def get_pp_rank() -> int:
    return _pp_rank


def get_pp_size() -> int:
    return _pp_size


def is_first_stage() -> bool:
    return _pp_rank == 0


def is_last_stage() -> bool:
    return _pp_rank == _pp_size - 1


def stage_layers(num_layers: int) -> tuple[int, int]:
    """This stage's decoder layers of a model of ``num_layers``, ``[start, end)``."""
    if _layers is None:
        return 0, num_layers
    if _layers[1] > num_layers:
        raise ValueError(f"stage layers {_layers} do not fit a model of {num_layers} layers")
    return _layers


def send_to_next_stage(x: torch.Tensor) -> None:
    """Send this stage's output to the same tensor-parallel rank of the next stage, without
    waiting for it to be received (the tensor is kept until it is)."""
    while _sends and _sends[0][0].is_completed():
        _sends.popleft()
    x = x.contiguous()
    _sends.append((dist.isend(x, dst=_global_rank + _size), x))


def recv_from_prev_stage(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The previous stage's output for this step (the stages send their steps in order)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=_global_rank - _size)
    return x


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks of the tensor-parallel group, in place (what follows a
    row-parallel layer)."""
    if _size > 1:
        dist.all_reduce(x, group=_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order."""
    if _size == 1:
        return x
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((_size * rows.shape[0], rows.shape[1]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, rows, group=_group)
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
