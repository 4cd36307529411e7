"""Products of a few rows on a CPU, through oneDNN with each weight packed once.

``F.linear`` on a CPU runs MKL's sgemm, which from 4 rows on takes a product of a few rows about
as a row at a time: on a 2-core EPYC (one thread), SmolLM2-135M's linears (30 layers and the LM
head, weights read from memory) at 2, 3, 4, 9, 32 and 64 rows took 39, 44, 68, 111, 120 and 171
ms; oneDNN's inner product over a weight packed in its own blocked layout took 45, 51, 51, 66,
98 and 155 ms. In the engine, greedy decoding on a CPU at batch 2, 3, 4, 8, 16, 32 and 64 took
1.22, 1.16, 0.82, 0.77, 0.83, 0.91 and 0.85 times as long through the packed weights. A few rows
are a speculative verification step (``k + 1`` rows a request), a decode step of a few dozen
requests, a short prompt, so :func:`linear` takes those (``MIN_ROWS`` to ``MAX_ROWS`` rows,
float32, outside autograd) this way; the rest stays with ``F.linear``.

The packed copy of a weight is made at its first such product and kept beside it: the weights
take up to twice their memory, at most ``MAX_BYTES`` of packed copies in all (past that, the
weights not yet packed stay with ``F.linear``). A weight changed in place (``_version``) is
packed again; a weight that is freed takes its copy with it.
"""

from __future__ import annotations

import platform

import torch
from torch.utils.weak import WeakIdKeyDictionary

MIN_ROWS, MAX_ROWS = 4, 64
MAX_BYTES = 4 << 30
# Set to False to leave every product to ``F.linear``.
ENABLED = True

# weight -> (its _version when packed, the packed copy)
_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and platform.machine().lower() in ("x86_64", "amd64")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


_AVAILABLE = _available()


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _bytes() -> int:
    return sum(w.numel() * w.element_size() for _, w in _packed.values())


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` through oneDNN where it pays (see the module's note); None
    where it does not apply, for the caller to run ``F.linear``."""
    if not (
        ENABLED
        and _AVAILABLE
        and x.device.type == "cpu"
        and x.dim() == 2
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_grad_enabled()
    ):
        return None
    entry = _packed.get(weight)
    if entry is None or entry[0] != weight._version:
        size = weight.numel() * weight.element_size()
        if entry is None and _bytes() + size > MAX_BYTES:
            return None
        entry = (weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8))
        _packed[weight] = entry
    return _product(x.contiguous(), entry[1], bias)
