"""Entry point of the plugin: registers the executor by name, importing neither torch nor zmq."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_executors(register) -> None:
    register("multiproc", "pagoda_executor_multiproc.executor:MultiprocExecutor")
