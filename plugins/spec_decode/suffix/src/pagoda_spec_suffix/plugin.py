"""Entry point of the plugin: registers the proposer and its settings by name, importing
nothing heavy."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_spec_proposers(register) -> None:
    register("suffix", "pagoda_spec_suffix.proposer:SuffixProposer")


@hookimpl
def register_plugin_settings(register) -> None:
    register("suffix", "pagoda_spec_suffix.settings:SuffixSettings")
