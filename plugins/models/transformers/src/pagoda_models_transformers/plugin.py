"""Entry point of the plugin: registers the model impl by name, importing nothing heavy."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_model_impls(register) -> None:
    register("transformers", "pagoda_models_transformers.impl:TransformersModelImpl")
