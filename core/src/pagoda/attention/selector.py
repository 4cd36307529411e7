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
) -> type[AttentionBackend]:
    """The backend class named ``name`` (``attention.backend``), checked to support ``device``,
    ``dtype``, ``head_size``, ``block_size`` and every layer's spec (``specs[i]`` is layer
    ``i``'s); ``auto`` picks the highest ``priority`` among those that do and whose kernels are
    compiled (see :mod:`pagoda.attention.jit`). The error when none does names what a layer
    needs that the backends lack."""
    backend = _select(name, device, dtype, head_size, block_size, specs)
    logger.info("attention: %s (attention.backend %s)", backend.name, name)
    return backend


def _select(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    specs: Sequence[AttentionSpec],
) -> type[AttentionBackend]:
    distinct = list(dict.fromkeys(specs))

    def supports(b: Any) -> bool:
        return (
            b.supports(device, dtype, head_size)
            and b.supports_block_size(block_size)
            and all(b.unsupported(s) is None for s in distinct)
        )

    needs = (
        f"device={device.type}, dtype={str(dtype).removeprefix('torch.')}, "
        f"head_size={head_size}, block_size={block_size}{_layer_needs(specs)}"
    )
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
