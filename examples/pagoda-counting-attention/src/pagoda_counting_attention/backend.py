"""The backend: Pagoda's torch-native reference backend, counting steps and layer calls.

``COUNTS["steps"]`` counts ``build_metadata`` calls (one per engine step) and
``COUNTS["forward"]`` the layers' attention calls. With ``PAGODA_COUNTING_REPORT=FILE`` in the
environment, the counts are written to FILE as JSON when the process exits.
"""

from __future__ import annotations

import atexit
import json
import os
from typing import Any

import torch

from pagoda.attention.backend import AttentionImpl, CommonAttentionMetadata
from pagoda.attention.torch_native import TorchNativeBackend, TorchNativeImpl

COUNTS = {"steps": 0, "forward": 0}


class CountingImpl(TorchNativeImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        COUNTS["forward"] += 1
        return super().forward(query, key, value, kv_cache, attn_metadata)


class CountingBackend(TorchNativeBackend):
    name = "counting"
    # Below the reference backend: `attention.backend: auto` never picks it; select it by name.
    priority = -1

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return CountingImpl

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        COUNTS["steps"] += 1
        return super().build_metadata(common)


def _report() -> None:
    path = os.environ.get("PAGODA_COUNTING_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(COUNTS, f)


atexit.register(_report)
