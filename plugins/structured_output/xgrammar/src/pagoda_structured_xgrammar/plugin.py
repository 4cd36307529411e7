"""Entry point of the plugin: registers the backend by name, importing neither xgrammar nor torch."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_grammar_backends(register) -> None:
    register("xgrammar", "pagoda_structured_xgrammar.backend:XGrammarBackend")
