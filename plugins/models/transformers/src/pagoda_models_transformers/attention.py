"""The attention functions that transformers' modules call through ``ALL_ATTENTION_FUNCTIONS``.

``pagoda``: the real one. A transformers attention module hands it query, key and value as
``[1, heads, tokens, head_size]`` (the flat batch of a step is one row); it reshapes them to the
``[tokens, heads * head_size]`` that :class:`pagoda.attention.layer.Attention` takes, and the
output back to the ``[1, tokens, heads, head_size]`` that transformers expects. Everything else
(the step's metadata, the window, the soft-cap, the sinks) comes from the Pagoda layer and the
forward context, never from the keyword arguments, which some models do not pass through.

``pagoda_probe``: records each call (module, shapes, keyword arguments) of a forward pass on the
meta device, from which the impl derives every layer's :class:`AttentionSpec`.

Neither name has a mask function in ``AttentionMaskInterface``: transformers then builds no mask
at all (``masking_utils`` returns None for an implementation without one), so nothing of size
``tokens x tokens`` is made, and no position is read back to the host to detect packing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

PAGODA = "pagoda"
PROBE = "pagoda_probe"

#: The attribute of a transformers attention module that holds its Pagoda layer (set with
#: ``object.__setattr__``, so that the layer is a submodule of the wrapper only).
LAYER_ATTR = "_pagoda_attention"


@dataclass
class ProbeCall:
    """One call of the probe: the module and what it passed."""

    module: torch.nn.Module
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    kwargs: dict[str, Any]


_probe_calls: list[ProbeCall] | None = None


def pagoda_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    layer = module.__dict__.get(LAYER_ATTR)
    if layer is None:
        raise RuntimeError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no Pagoda "
            "attention layer bound: was the model built by the transformers model impl?"
        )
    n = query.shape[2]
    q = query[0].transpose(0, 1).reshape(n, -1)
    k = key[0].transpose(0, 1).reshape(n, -1)
    v = value[0].transpose(0, 1).reshape(n, -1)
    out = layer(q, k, v)
    return out.view(1, n, layer.num_heads, layer.v_head_size), None


def probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if _probe_calls is not None:
        call = ProbeCall(module, tuple(query.shape), tuple(key.shape), tuple(value.shape), kwargs)
        _probe_calls.append(call)
    b, h, n, _ = query.shape
    return query.new_zeros(b, n, h, value.shape[-1]), None


def record_attention(model: Any) -> list[ProbeCall]:
    """The attention calls of ``model`` (built on the meta device with the probe's attention,
    ``PROBE``) in a forward of its base model on two tokens."""
    global _probe_calls
    ids = torch.zeros(1, 2, dtype=torch.long, device="meta")
    _probe_calls = calls = []
    try:
        with torch.no_grad():
            model.base_model(input_ids=ids, position_ids=ids, use_cache=False)
    finally:
        _probe_calls = None
    return calls


AttentionInterface.register(PAGODA, pagoda_attention)
AttentionInterface.register(PROBE, probe_attention)
