"""A transformers model split over the ranks of Pagoda's tensor-parallel group by its own plan
(:mod:`pagoda_models_transformers.tp_plan`): built with its parameters on the meta device, each
replaced by this rank's part, and the planned modules' forwards made to communicate. The same
split on the meta device, where the collectives give only their outputs' shapes, gives each
rank's attention specs from transformers' own forward."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention.spec import AttentionSpec
from pagoda.distributed import all_gather_last_dim, all_reduce
from pagoda_models_transformers import attention
from pagoda_models_transformers.probe import (
    Probed,
    Refusal,
    build_config,
    build_hf_model,
    probe,
)
from pagoda_models_transformers.probe import _spec as spec_of
from pagoda_models_transformers.tp_plan import (
    EMBEDDING,
    GATHER_OUT,
    GIVEN_IN,
    REDUCE_OUT,
    SPLIT_IN,
    Layout,
    Planned,
    Shard,
    check_modules,
    check_size,
    resolve,
)


def _reduce(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_meta else all_reduce(x)


def _gather(x: torch.Tensor, size: int) -> torch.Tensor:
    # NOTE: on the meta device (reading specs) only the shape of the gathered output matters.
    return x.repeat(*[1] * (x.ndim - 1), size) if x.is_meta else all_gather_last_dim(x)


def _rowwise_forward(module: nn.Linear, start: int | None) -> Callable[[torch.Tensor], Any]:
    """Partial products summed over the ranks, then the bias once; ``start``: the rank's first
    input feature, where the whole input is given."""
    width = module.weight.shape[-1]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if start is not None:
            x = x[..., start : start + width]
        y = _reduce(F.linear(x, module.weight))
        return y if module.bias is None else y + module.bias

    return forward


def _gathered_forward(module: nn.Module, full: int, size: int) -> Callable[..., Any]:
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = _gather(original(*args, **kwargs), size)
        return out if out.shape[-1] == full else out[..., :full]

    return forward


def _reduced_forward(module: nn.Module) -> Callable[..., Any]:
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _reduce(original(*args, **kwargs))

    return forward


def _embedding_forward(module: nn.Embedding, shard: Shard) -> Callable[[torch.Tensor], Any]:
    original = module.forward
    start, n = shard.ranges[0]

    def forward(ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < start) | (ids >= start + n)
        rows = original((ids - start).masked_fill(outside, 0))
        return _reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))

    return forward


def _install_forwards(planned: Planned, shards: dict[str, Shard], rank: int, size: int) -> None:
    for mname, (style, module) in planned.modules.items():
        if style in SPLIT_IN | GIVEN_IN:
            width = module.weight.shape[-1]
            module.forward = _rowwise_forward(module, rank * width if style in GIVEN_IN else None)
        elif style in GATHER_OUT:
            module.forward = _gathered_forward(module, shards[f"{mname}.weight"].full, size)
        elif style in REDUCE_OUT:
            module.forward = _reduced_forward(module)
        elif style == EMBEDDING:
            module.forward = _embedding_forward(module, shards[f"{mname}.weight"])
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        elif isinstance(module, nn.Embedding):
            # NOTE: the padding row matters only to gradients, and is not this rank's row.
            module.num_embeddings, module.padding_idx = module.weight.shape[0], None


def _materialise(model: nn.Module, shards: dict[str, Shard], device: torch.device) -> None:
    """Every parameter (on the meta device) replaced by an uninitialised tensor of this rank's
    shape on ``device``; tied parameters stay one."""
    done: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        new = done.get(id(param))
        if new is None:
            shape = list(param.shape)
            if name in shards:
                shape[shards[name].dim] = shards[name].local
            data = torch.empty(shape, dtype=param.dtype, device=device)
            new = done[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
        owner, _, pname = name.rpartition(".")
        model.get_submodule(owner)._parameters[pname] = new


def _by_name(model: nn.Module, shards: dict[str, Shard | None]) -> dict[str, Shard]:
    """The split parameters' shards under every name (a tied parameter has several); raises
    :class:`Refusal` where a tied parameter's names are split otherwise."""
    seen: dict[int, tuple[str, Shard | None]] = {}
    out: dict[str, Shard] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shard = shards.get(name)
        first, was = seen.setdefault(id(param), (name, shard))
        if was != shard:
            raise Refusal(f"{name} is tied to {first}, which the plan splits otherwise")
        if shard is not None:
            out[name] = shard
    return out


def shard_model(
    model: Any,
    attention_modules: tuple[str, ...],
    specs: tuple[AttentionSpec, ...],
    rank: int,
    size: int,
    device: torch.device,
) -> dict[str, Shard]:
    """Split ``model`` (its parameters on the meta device) by its plan for ``rank`` of ``size``:
    its parameters become this rank's, uninitialised, on ``device``, and the planned modules'
    forwards communicate. ``specs``: the attention modules' specs with every head. Returns the
    shard of each split parameter under each of its names, by which its weight is loaded.
    Raises :class:`Refusal` (a ValueError) for a plan it cannot apply, ValueError naming the
    sizes that fit for a ``size`` that does not divide the model."""
    planned = resolve(model)
    heads = {a: (s.num_heads, s.num_kv_heads) for a, s in zip(attention_modules, specs)}
    layout = Layout(planned, heads)
    check_size(model, planned, layout, size)
    planned_shards = {name: layout.shard(name, rank, size) for name in planned.params}
    check_modules(model, planned, planned_shards)
    shards = _by_name(model, planned_shards)
    _materialise(model, shards, device)
    _install_forwards(planned, shards, rank, size)
    return shards


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within this block, modules put the parameters they register on the meta device (each is
    made where it is created, then dropped) and keep their buffers (rotary tables) where they
    make them: a model is split before its weights take memory."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_sharded(
    model_cls: type,
    config: Any,
    attention_modules: tuple[str, ...],
    specs: tuple[AttentionSpec, ...],
    rank: int,
    size: int,
    experts: str | None,
) -> tuple[Any, dict[str, Shard]]:
    """``model_cls`` built from ``config`` (attending through Pagoda) and split for ``rank`` of
    ``size``, its parameters uninitialised on the current default device; and the shards by which
    its weights load."""
    device = torch.get_default_device()
    with parameters_on_meta():
        model = build_hf_model(
            model_cls, config, attention.PAGODA, torch.get_default_dtype(), experts=experts
        )
    return model, shard_model(model, attention_modules, specs, rank, size, device)


def probe_sharded(hf_config: dict[str, Any], architecture: str, size: int) -> Probed:
    """:func:`probe`'s answer for one of ``size`` ranks: its attention modules' specs with that
    rank's heads, read from transformers' forward of the model split on the meta device. Raises
    ValueError naming the sizes that fit, :class:`Refusal` for a model without a plan this impl
    can apply. Cached per config and size."""
    return _probe_sharded(json.dumps(hf_config, sort_keys=True, default=str), architecture, size)


@functools.lru_cache(maxsize=16)
def _probe_sharded(config_json: str, architecture: str, size: int) -> Probed:
    hf_config = json.loads(config_json)
    full = probe(hf_config, architecture)
    name = full.model_class.__name__
    with torch.device("meta"):
        model = build_hf_model(
            full.model_class,
            build_config(hf_config),
            attention.PROBE,
            torch.float32,
            experts="batched_mm",
        )
    shard_model(model, full.module_names, full.specs, 0, size, torch.device("meta"))
    try:
        calls = attention.record_attention(model)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise Refusal(
            f"{name} split over {size} ranks by its plan does not run ({type(e).__name__}: "
            f"{first}): only tensor_parallel_size=1 fits"
        ) from e
    modules = {id(m): n for n, m in model.named_modules()}
    names = tuple(modules[id(c.module)] for c in calls)
    if names != full.module_names:
        raise Refusal(f"{name} split over {size} ranks calls other attention modules")
    specs = tuple(spec_of(c, i) for i, c in enumerate(calls))
    return dataclasses.replace(full, specs=specs)
