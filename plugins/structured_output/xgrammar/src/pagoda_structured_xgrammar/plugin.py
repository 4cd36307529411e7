"""The plugin's entry point: registers the backend by name, importing no xgrammar, no torch."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_grammar_backends(register) -> None:
    register("xgrammar", "pagoda_structured_xgrammar.backend:XGrammarBackend")
