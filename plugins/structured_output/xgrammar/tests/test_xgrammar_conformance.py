"""The xgrammar backend against the core's grammar-backend conformance kit."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from pagoda.testing import GrammarBackendConformance  # noqa: E402


class TestXGrammarConformance(GrammarBackendConformance):
    backend = "xgrammar"
