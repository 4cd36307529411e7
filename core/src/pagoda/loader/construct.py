"""Building a model's modules without initialising weights that loading overwrites anyway."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# torch.nn.init's fills that module constructors call (Linear, Embedding, ...).
_INIT_FNS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
    "constant_",
    "zeros_",
    "ones_",
)


def _skip(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextmanager
def skip_weight_init() -> Iterator[None]:
    """Within this block, ``torch.nn.init``'s fills do nothing: constructors only allocate
    (``torch.empty``), so a model whose every weight is loaded or filled next costs no random
    initialisation. Buffers computed in constructors (rotary tables) are built as usual."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FNS}
    try:
        for name in _INIT_FNS:
            setattr(nn.init, name, _skip)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_model(
    model_cls: Callable[..., nn.Module],
    *args: Any,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """``model_cls(*args)`` on ``device`` in ``dtype``, its parameters allocated but not
    initialised: the caller loads every weight (``load_weights`` refuses a checkpoint that leaves
    one unset) or fills them (``init_dummy_``)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with skip_weight_init(), torch.device(device):
            return model_cls(*args)
    finally:
        torch.set_default_dtype(prev)
