"""Pagoda's attention conformance kit on the FlashInfer backend (needs CUDA and flashinfer).

Besides the plain cases, the kit's feature cases run for each spec field the backend's
``unsupported`` accepts (sliding window, logit soft-cap, sinks, bidirectional) and skip, naming
the field, for the others (a value head size of its own, chunks)."""

from __future__ import annotations

import os

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
    # bfloat16, the engine's dtype on a GPU, shares its kernels with the engine tests of the tier;
    # float16 is a second set of JIT-compiled modules (minutes on a machine with no compile
    # cache), checked where PAGODA_TEST_ALL_DTYPES=1.
    dtypes = (
        (torch.bfloat16, torch.float16)
        if os.environ.get("PAGODA_TEST_ALL_DTYPES") == "1"
        else (torch.bfloat16,)
    )
