"""Loading a checkpoint, named as on disk, into a transformers model built by this impl.

transformers 5 renames some checkpoint keys and fuses others (each expert's projections into one
3-D parameter) when it loads; ``save_pretrained`` writes the original names back. The same
conversion mapping that ``from_pretrained`` uses renames and converts here
(``get_model_conversion_mapping``); the values are copied into the parameters in place, so
tied weights and the Pagoda layers' views of the sinks stay what they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from copy import deepcopy
from typing import Any

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from pagoda.loader.sharded import WeightSlice, as_slice
from pagoda_models_transformers.tp_plan import Shard

#: Checkpoint tensors that are not weights (buffers transformers computes itself).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _copy(
    target: torch.Tensor,
    name: str,
    source: str,
    weight: torch.Tensor | WeightSlice,
    shard: Shard | None,
) -> None:
    value = as_slice(weight).full() if shard is None else shard.take(weight, repr(source))
    if tuple(target.shape) != tuple(value.shape):
        raise ValueError(
            f"checkpoint weight {source!r} ({name}) has shape {tuple(value.shape)}, the model "
            f"expects {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(value)


class _Unsplit:
    """``model`` as a conversion sees it: a split parameter with its whole shape (transformers'
    ``Split`` sizes the pieces of a fused checkpoint tensor by the parameters they go to)."""

    def __init__(self, model: Any, shards: Mapping[str, Shard]) -> None:
        self._model, self._shards = model, shards

    def get_parameter(self, name: str) -> torch.Tensor:
        param = self._model.get_parameter(name)
        shard = self._shards.get(name)
        if shard is None:
            return param
        shape = list(param.shape)
        shape[shard.dim] = shard.full
        return torch.empty(shape, dtype=param.dtype, device="meta")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def load_hf_weights(
    model: Any,
    weights: Iterable[tuple[str, torch.Tensor | WeightSlice]],
    shards: Mapping[str, Shard] | None = None,
) -> set[str]:
    """Copy ``weights`` (checkpoint names) into ``model`` (a transformers ``PreTrainedModel``);
    of a parameter in ``shards`` (split over tensor-parallel ranks), only this rank's part, read
    alone from a lazy slice where no conversion needs the whole. Returns the names of the state
    set. Raises naming a weight with no home, one of the wrong shape, or a parameter or
    persistent buffer left unset."""
    shards = shards or {}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    state = model.state_dict(keep_vars=True)
    prefix = model.base_model_prefix
    pending: dict[str, WeightConverter] = {}
    loaded: set[str] = set()
    for name, weight in weights:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        target, pattern = rename_source_key(name, renamings, converters, prefix, state)
        if target not in state and name in state:
            target, pattern = name, None
        if target not in state:
            raise ValueError(
                f"checkpoint weight {name!r} has no parameter in {type(model).__name__}"
                + (f" (renamed {target!r})" if target != name else "")
            )
        if pattern is None:
            _copy(state[target], target, name, weight, shards.get(target))
            loaded.add(target)
            continue
        converter = pending.get(target)
        if converter is None:
            converter = pending[target] = deepcopy(by_pattern[pattern])
        converter.add_tensor(target, name, pattern, as_slice(weight).full())
    seen = _Unsplit(model, shards) if shards else model
    for first, converter in pending.items():
        for target, value in converter.convert(first, model=seen, config=model.config).items():
            value = value[0] if isinstance(value, list) else value
            if target not in state:
                raise ValueError(f"converted weight {target!r} has no parameter in the model")
            _copy(state[target], target, first, value, shards.get(target))
            loaded.add(target)
    # Tied weights are one tensor under several names: set once, set for all.
    done = {id(state[n]) for n in loaded}
    missing = sorted(n for n, t in state.items() if id(t) not in done)
    if missing:
        raise ValueError(
            f"checkpoint lacks weights for {len(missing)} parameters: {', '.join(missing[:8])}"
        )
    return loaded
