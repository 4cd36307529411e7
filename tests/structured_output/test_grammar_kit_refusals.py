"""The grammar-backend kit respects a backend that refuses some kinds of constraint through
``validate``: those kinds are skipped with the backend's reason, the others are checked whole."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from pagoda_structured_xgrammar.backend import XGrammarBackend  # noqa: E402

from pagoda.testing import GrammarBackendConformance  # noqa: E402
from pagoda.testing.grammar import grammar_cases, refusal  # noqa: E402

SUPPORTED = ("json", "regex")


class JsonAndRegexOnly(XGrammarBackend):
    @classmethod
    def validate(cls, params) -> None:
        if params.kind not in SUPPORTED:
            raise ValueError(f"{params.kind} constraints are not supported")
        super().validate(params)


class TestABackendThatRefusesSomeKinds(GrammarBackendConformance):
    backend = JsonAndRegexOnly
    devices = ("cpu",)


def test_refused_kinds_are_named_with_the_backends_reason() -> None:
    why = {c.name: refusal(JsonAndRegexOnly, c) for c in grammar_cases()}
    assert [k for k, w in why.items() if w is None] == list(SUPPORTED)
    assert (
        why["choice"]
        == "JsonAndRegexOnly refuses choice constraints: choice constraints are not supported"
    )
