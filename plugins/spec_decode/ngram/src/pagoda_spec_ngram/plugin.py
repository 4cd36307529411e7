"""Entry point of the plugin: registers the proposer by name and its settings, importing nothing
heavy."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_spec_proposers(register) -> None:
    register("ngram", "pagoda_spec_ngram.proposer:NgramProposer")


@hookimpl
def register_plugin_settings(register) -> None:
    register("ngram", "pagoda_spec_ngram.settings:NgramSettings")
