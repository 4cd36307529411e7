"""Pagoda's attention conformance kit on the Triton backend: natively on a GPU, and under the
Triton interpreter on the CPU (float32, the kit's small shapes), with the spec's extras the
kernels compute (window, soft-cap, sinks, chunks, bidirectional attention), and negative
controls: a kernel launched without an extra fails that extra's case."""

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
    # An FP8 KV cache on the GPU only: the interpreter's casts to float8_e4m3fn round wrongly
    # (127.0 becomes 64.0, subnormals are lost), where the GPU's are exact.
    kv_cache_dtypes = None if _CUDA else ()


# The extras the kernels compute, each with the `paged_attention` argument that carries it and
# the value that leaves it out.
EXTRAS = {
    "causal": True,
    "sliding_window": None,
    "logit_softcap": None,
    "sinks": None,
    "chunk_size": None,
}


def test_unsupported_accepts_the_extras_the_kernels_compute_and_names_the_others() -> None:
    plain = AttentionSpec(8, 2, 64, 0.125)
    every = replace(
        plain, causal=False, sliding_window=7, logit_softcap=2.0, sinks=True, chunk_size=12
    )
    assert TritonAttentionBackend.unsupported(plain) is None
    assert TritonAttentionBackend.unsupported(every) is None
    assert TritonAttentionBackend.unsupported(replace(plain, causal=False)) is None
    assert TritonAttentionBackend.unsupported(replace(every, value_head_size=32)) == (
        "value_head_size"
    )


@pytest.mark.parametrize("feature", EXTRAS)
def test_a_kernel_that_drops_an_extra_fails_its_case(
    feature: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the layer asks for the extra, the kernel is launched without it (its
    argument forced to None; a bidirectional layer's launched causal), and the kit's case for
    it fails. float32 on either device, where the tolerance is far below what the extra
    changes."""
    real = kernels.paged_attention
    off = EXTRAS[feature]
    monkeypatch.setattr(
        kernels, "paged_attention", lambda *a, **kw: real(*a, **{**kw, feature: off})
    )
    case = next(
        c for c in attention_cases() if c.scenario == "mixed" and c.spec.features() == (feature,)
    )
    device = torch.device(TestTritonConformance.device)
    with pytest.raises(AssertionError, match=re.escape(case.name)):
        check_attention_backend(TritonAttentionBackend, case, device, torch.float32)


# Bidirectional with a window (keys on both sides: |i - j| < w) or chunks (the whole chunk), which
# the kit has no case of: its mixed scenario (decodes, a chunked prefill over its context and a
# new prompt in one step) with both fields set.
@pytest.mark.parametrize("local", [{"sliding_window": 7}, {"chunk_size": 12}], ids=str)
def test_bidirectional_windows_and_chunks_pass_the_kit_and_fail_without_either(
    local: dict,
) -> None:
    """The kit's bidirectional case with a window (or chunks) too passes, and fails both the
    reference without the window or chunks (the kit's plain bidirectional rule) and the causal
    one with them: a kernel that ignored either field would not pass."""
    base = next(
        c for c in attention_cases() if c.scenario == "mixed" and c.spec.features() == ("causal",)
    )
    case = replace(base, **local)
    device = torch.device(TestTritonConformance.device)
    check_attention_backend(TritonAttentionBackend, case, device, torch.float32)
    for dropped in (base.spec, replace(case.spec, causal=True)):
        with pytest.raises(AssertionError, match=re.escape(case.name)):
            check_attention_backend(
                TritonAttentionBackend, case, device, torch.float32, reference_spec=dropped
            )
