"""At start, before any worker: whether the model and the features asked for split into
``parallel.pipeline_parallel_size`` stages, and how (``parallel.pipeline_layer_partition``)."""

from __future__ import annotations

from typing import Any

from pagoda.config import EngineConfig
from pagoda.distributed import split_layers
from pagoda.models.shape import ModelShape
from pagoda.plugins import get_registry


def check_pipeline_parallel(
    config: EngineConfig, shape: ModelShape, model_impl: str, pooling: bool
) -> list[tuple[int, int]]:
    """Each stage's decoder layers, ``[start, end)``; raises ValueError, one line naming the
    keys, for a split or a feature that pipeline parallelism cannot serve. ``pooling``: the
    model serves pooling requests."""
    parallel = config.parallel
    pp = parallel.pipeline_parallel_size
    if pp == 1:
        if parallel.pipeline_layer_partition not in (None, [shape.num_hidden_layers]):
            raise ValueError(
                f"parallel.pipeline_layer_partition={parallel.pipeline_layer_partition} is "
                "given, but parallel.pipeline_parallel_size=1"
            )
        return [(0, shape.num_hidden_layers)]
    key = f"parallel.pipeline_parallel_size={pp}"
    model_cls: Any = get_registry("model_impls").get(model_impl).model_class(shape)
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ValueError(
            f"{key}: {shape.architecture} as served by model.impl={model_impl!r} "
            f"({getattr(model_cls, '__name__', model_cls)}) does not split into pipeline "
            "stages; use model.impl=native for the Llama family, or "
            "parallel.pipeline_parallel_size=1"
        )
    refused = {
        "speculative.method": config.speculative.method is not None,
        "cache.cpu_offload_gb": config.cache.cpu_offload_gb > 0,
        "a pooling model (task embed/classify/score)": pooling,
        "model.batch_invariant": config.model.batch_invariant,
    }
    for what, on in refused.items():
        if on:
            raise ValueError(f"{key} does not work with {what} yet; turn one of them off")
    return split_layers(shape.num_hidden_layers, pp, parallel.pipeline_layer_partition)
