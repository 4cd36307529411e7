"""Choosing the attention backend: by name, or ``auto``, the best one that supports the model."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from pagoda.attention import jit
from pagoda.attention.backend import AttentionBackend
from pagoda.attention.spec import AttentionSpec
from pagoda.distributed import get_tp_rank
from pagoda.plugins import PluginLoadError, PluginSelectionError, get_registry, select

logger = logging.getLogger(__name__)


def select_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    block_size: int = 16,
    specs: Sequence[AttentionSpec] = (),
    kv_cache_dtype: torch.dtype | None = None,
) -> type[AttentionBackend]:
    """The backend class named ``name`` (``attention.backend``), checked to support ``device``,
    ``dtype``, ``head_size``, ``block_size``, every layer's spec (``specs[i]`` is layer
    ``i``'s) and a KV cache of ``kv_cache_dtype`` (None or ``dtype``: the model's);
    ``auto`` picks the highest ``priority`` among those that do and whose kernels are
    compiled (see :mod:`pagoda.attention.jit`). The error when none does names what a layer
    needs that the backends lack."""
    cache_dtype = None if kv_cache_dtype in (None, dtype) else kv_cache_dtype
    if name != "auto" and cache_dtype is not None:
        _check_kv_cache_dtype(name, cache_dtype, device, dtype, head_size, block_size, specs)
    backend = _select(name, device, dtype, head_size, block_size, specs, cache_dtype)
    logger.info("attention: %s (attention.backend %s)", backend.name, name)
    return backend


def _select(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    specs: Sequence[AttentionSpec],
    cache_dtype: torch.dtype | None = None,
) -> type[AttentionBackend]:
    distinct = list(dict.fromkeys(specs))

    def supports(b: Any) -> bool:
        return (
            b.supports(device, dtype, head_size)
            and b.supports_block_size(block_size)
            and all(b.unsupported(s) is None for s in distinct)
            and (cache_dtype is None or b.supports_kv_cache_dtype(cache_dtype))
        )

    needs = (
        f"device={device.type}, dtype={str(dtype).removeprefix('torch.')}, "
        f"head_size={head_size}, block_size={block_size}{_layer_needs(specs)}"
    )
    if cache_dtype is not None:
        needs += f", kv_cache_dtype={_dtype_name(cache_dtype)}"
    chosen = select(
        "attention_backends", name, supports=supports, needs=needs, check=_check_backend
    )
    if chosen.is_compiled(device, dtype, head_size):
        return chosen
    argv = chosen.compile_command(device, dtype, head_size)
    what = f"{str(dtype).removeprefix('torch.')}, head size {head_size}, on {device}"
    if name != "auto":
        if argv:
            jit.compile_now(chosen, what, argv)
        return chosen
    try:
        ready = select(
            "attention_backends",
            "auto",
            supports=lambda b: (
                b is not chosen and supports(b) and b.is_compiled(device, dtype, head_size)
            ),
            needs=needs,
            check=_check_backend,
        )
    except PluginSelectionError:  # nothing else runs here: compile before the first step
        if argv:
            jit.compile_now(chosen, what, argv)
        return chosen
    if argv:
        logger.info(
            "attention: %s's kernels for %s are not compiled yet; starting on %s and compiling "
            "%s in the background",
            chosen.name,
            what,
            ready.name,
            chosen.name,
        )
        if get_tp_rank() == 0:  # NOTE: one compile per machine, not one per tensor-parallel rank
            jit.compile_in_background(chosen, what, argv)
    return ready


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_kv_cache_dtype(
    name: str,
    cache_dtype: torch.dtype,
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    specs: Sequence[AttentionSpec],
) -> None:
    """A backend named by the user that cannot read the KV cache's dtype: one line that says so
    and names the backends that can (for the rest of the engine's needs)."""
    backend = get_registry("attention_backends").get(name)
    _check_backend(name, backend)
    if backend.supports_kv_cache_dtype(cache_dtype):
        return
    registry = get_registry("attention_backends")
    able = []
    for other in registry.names():
        try:
            b = registry.get(other)
        except PluginLoadError:
            continue
        if (
            other != name
            and isinstance(b, type)
            and issubclass(b, AttentionBackend)
            and b.supports_kv_cache_dtype(cache_dtype)
            and b.supports(device, dtype, head_size)
            and b.supports_block_size(block_size)
            and all(b.unsupported(s) is None for s in dict.fromkeys(specs))
        ):
            able.append(other)
    raise PluginSelectionError(
        f"attention backend {name!r} cannot read a KV cache of {_dtype_name(cache_dtype)} "
        f"(cache.kv_cache_dtype); backends that can here: {', '.join(able) or 'none'}"
    )


def _layer_needs(specs: Sequence[AttentionSpec]) -> str:
    """``", sliding_window (layers 0, 2)"``: each spec feature and the layers that need it."""
    layers: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        for feature in spec.features():
            layers.setdefault(feature, []).append(i)
    return "".join(
        f", {f} (layer{'s' if len(ls) > 1 else ''} {', '.join(map(str, ls))})"
        for f, ls in layers.items()
    )


def _check_backend(name: str, target: Any) -> None:
    if not (isinstance(target, type) and issubclass(target, AttentionBackend)):
        plugin = get_registry("attention_backends").registration(name).plugin
        raise PluginLoadError(
            f"attention backend {name!r} from plugin {plugin.label} is {target!r}, not a "
            "subclass of pagoda.attention.backend.AttentionBackend"
        )
