"""Conformance kits and helpers for testing Pagoda plugins, ours or a third party's.

- :class:`AttentionBackendConformance`: subclass it in a pytest module to run an attention
  backend against the float64 reference over random paged layouts (needs pytest).
- :func:`check_attention_backend`, :func:`attention_cases`: the same without pytest.
- :class:`SpeculativeProposerConformance`: subclass it in a pytest module to check a
  speculative proposer against the contract of ``pagoda.spec_decode`` (needs pytest).
- :func:`check_proposer_case`, :func:`proposer_cases`, :func:`check_proposes_on_host`: the same
  without pytest.
- :class:`GrammarBackendConformance`: subclass it in a pytest module to check a grammar backend
  (structured output) against the contract of ``pagoda.structured_output.backend``.
- :func:`grammar_cases` and the ``check_*`` functions of ``pagoda.testing.grammar``: the same
  without pytest.
- :class:`ModelImplSuite`: subclass it in a pytest module to check a model impl on tiny configs:
  the declared attention specs, logits however the steps cut a request or pack several, against
  a reference when one is given, and tensor-parallel refusals (needs pytest).
- :func:`check_model_impl`, :func:`build_impl_model`, :func:`run_steps` and the ``check_*``
  functions of ``pagoda.testing.model_impl``: the same without pytest.
- :class:`QuantizationMethodConformance`: subclass it in a pytest module to check a
  quantization method's linears against float64 (needs pytest).
- :func:`check_linear_method`, :func:`fp8_checkpoint`, :func:`quantize_dequantize` of
  ``pagoda.testing.quantization``: the same without pytest, and FP8 checkpoints in the layouts
  Hugging Face publishes.
- :func:`plugin_registered`: register a plugin object for the duration of a ``with`` block.

Floor: faces. Nothing in the core imports it.
"""

from __future__ import annotations

from typing import Any

from pagoda.plugins.local import plugin_registered
from pagoda.testing.attention import (
    DEFAULT_TOLERANCES,
    AttentionCase,
    attention_cases,
    check_attention_backend,
    reference_attention,
    run_attention_case,
)
from pagoda.testing.grammar import GrammarCase, grammar_cases
from pagoda.testing.model_impl import (
    ModelReference,
    PagedRunner,
    build_impl_model,
    check_model_impl,
    run_steps,
)
from pagoda.testing.quantization import (
    FP8_TOLERANCE,
    check_linear_method,
    fp8_checkpoint,
    quantize_dequantize,
)
from pagoda.testing.spec_decode import (
    ProposerCase,
    check_proposer_case,
    check_proposes_on_host,
    proposer_cases,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "FP8_TOLERANCE",
    "AttentionBackendConformance",
    "AttentionCase",
    "GrammarBackendConformance",
    "GrammarCase",
    "ModelImplSuite",
    "ModelReference",
    "PagedRunner",
    "build_impl_model",
    "check_model_impl",
    "run_steps",
    "grammar_cases",
    "ProposerCase",
    "SpeculativeProposerConformance",
    "check_proposer_case",
    "check_proposes_on_host",
    "proposer_cases",
    "attention_cases",
    "check_attention_backend",
    "plugin_registered",
    "QuantizationMethodConformance",
    "check_linear_method",
    "fp8_checkpoint",
    "quantize_dequantize",
    "reference_attention",
    "run_attention_case",
]


def __getattr__(name: str) -> Any:
    if name == "AttentionBackendConformance":  # imports pytest
        # NOTE: the suites import pytest: only for a test that asks for one.
        from pagoda.testing.attention_suite import AttentionBackendConformance

        return AttentionBackendConformance
    if name == "GrammarBackendConformance":  # imports pytest
        # NOTE: the suites import pytest: only for a test that asks for one.
        from pagoda.testing.grammar_suite import GrammarBackendConformance

        return GrammarBackendConformance
    if name == "ModelImplSuite":  # imports pytest
        # NOTE: the suites import pytest: only for a test that asks for one.
        from pagoda.testing.model_impl_suite import ModelImplSuite

        return ModelImplSuite
    if name == "QuantizationMethodConformance":  # imports pytest
        # NOTE: the suites import pytest: only for a test that asks for one.
        from pagoda.testing.quantization_suite import QuantizationMethodConformance

        return QuantizationMethodConformance
    if name == "SpeculativeProposerConformance":  # imports pytest
        # NOTE: the suites import pytest: only for a test that asks for one.
        from pagoda.testing.spec_decode_suite import SpeculativeProposerConformance

        return SpeculativeProposerConformance
    raise AttributeError(f"module 'pagoda.testing' has no attribute {name!r}")


def __dir__() -> list[str]:
    # NOTE: so that pydoc (and tab completion) list the lazily imported kits too.
    return sorted(set(globals()) | set(__all__))
