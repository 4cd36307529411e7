"""Pagoda's attention conformance kit on the FlashInfer backend (needs CUDA and flashinfer)."""

from __future__ import annotations

import pytest
import torch

from pagoda.testing import AttentionBackendConformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class TestFlashInferConformance(AttentionBackendConformance):
    backend = "flashinfer"
    device = "cuda"
    dtypes = (torch.bfloat16, torch.float16)
