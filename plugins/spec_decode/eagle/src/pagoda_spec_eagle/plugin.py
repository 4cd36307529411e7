"""Entry point of the plugin: registers the proposers by name, importing nothing heavy."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_spec_proposers(register) -> None:
    register("eagle", "pagoda_spec_eagle.proposer:EagleProposer")
    register("eagle3", "pagoda_spec_eagle.proposer:Eagle3Proposer")
