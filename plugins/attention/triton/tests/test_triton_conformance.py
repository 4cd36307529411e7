"""Pagoda's attention conformance kit on the Triton backend: natively on a GPU, and under the
Triton interpreter on the CPU (float32, the kit's small shapes), with the spec's extras the
kernels compute (window, soft-cap, sinks, chunks), and negative controls: a kernel launched
without an extra fails that extra's case."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first compiled

pytest.importorskip("triton")

from pagoda_attention_triton import kernels  # noqa: E402
from pagoda_attention_triton.backend import TritonAttentionBackend  # noqa: E402

from pagoda.attention.spec import AttentionSpec  # noqa: E402
from pagoda.testing import AttentionBackendConformance  # noqa: E402
from pagoda.testing.attention import attention_cases, check_attention_backend  # noqa: E402

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


# The extras the kernels compute, each with the `paged_attention` argument that carries it.
EXTRAS = ("sliding_window", "logit_softcap", "sinks", "chunk_size")


def test_unsupported_accepts_the_extras_the_kernels_compute_and_names_the_others() -> None:
    plain = AttentionSpec(8, 2, 64, 0.125)
    every = replace(plain, sliding_window=7, logit_softcap=2.0, sinks=True, chunk_size=12)
    assert TritonAttentionBackend.unsupported(plain) is None
    assert TritonAttentionBackend.unsupported(every) is None
    assert TritonAttentionBackend.unsupported(replace(every, causal=False)) == "causal"
    assert TritonAttentionBackend.unsupported(replace(every, value_head_size=32)) == (
        "value_head_size"
    )


@pytest.mark.parametrize("feature", EXTRAS)
def test_a_kernel_that_drops_an_extra_fails_its_case(
    feature: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the layer asks for the extra, the kernel is launched without it (its
    argument forced to None), and the kit's case for it fails. float32 on either device, where
    the tolerance is far below what the extra changes."""
    real = kernels.paged_attention
    monkeypatch.setattr(
        kernels, "paged_attention", lambda *a, **kw: real(*a, **{**kw, feature: None})
    )
    case = next(
        c for c in attention_cases() if c.scenario == "mixed" and c.spec.features() == (feature,)
    )
    device = torch.device(TestTritonConformance.device)
    with pytest.raises(AssertionError, match=re.escape(case.name)):
        check_attention_backend(TritonAttentionBackend, case, device, torch.float32)
