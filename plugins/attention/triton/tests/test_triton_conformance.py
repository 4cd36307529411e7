"""Pagoda's attention conformance kit on the Triton backend: natively on a GPU, and under the
Triton interpreter on the CPU (float32, the kit's small shapes)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first compiled

from pagoda.testing import AttentionBackendConformance  # noqa: E402

_CUDA = torch.cuda.is_available()
_ALL_DTYPES = os.environ.get("PAGODA_TEST_ALL_DTYPES") == "1"
pytestmark = pytest.mark.gpu  # on CUDA where there is one, else on the CPU


@pytest.fixture(autouse=True, scope="module")
def _allow_the_interpreter_for_these_tests() -> Iterator[None]:
    """On a CPU the backend supports nothing unless asked for; these tests ask, then stop."""
    os.environ["PAGODA_TRITON_ON_CPU"] = "1"
    try:
        yield
    finally:
        del os.environ["PAGODA_TRITON_ON_CPU"]


class TestTritonConformance(AttentionBackendConformance):
    backend = "triton"  # selected by name, through the installed entry point
    device = "cuda" if _CUDA else "cpu"
    # On a GPU: bfloat16, the engine's dtype there; float16 and float32 compile the kernels
    # again for every case's shapes (minutes without a compile cache), checked where
    # PAGODA_TEST_ALL_DTYPES=1. On the CPU the interpreter runs float32.
    dtypes = (
        ((torch.bfloat16, torch.float16, torch.float32) if _ALL_DTYPES else (torch.bfloat16,))
        if _CUDA
        else (torch.float32,)
    )
