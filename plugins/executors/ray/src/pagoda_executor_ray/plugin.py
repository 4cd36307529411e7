"""Entry point of the plugin: registers the executor by name, importing neither Ray nor torch."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_executors(register) -> None:
    register("ray", "pagoda_executor_ray.executor:RayExecutor")
