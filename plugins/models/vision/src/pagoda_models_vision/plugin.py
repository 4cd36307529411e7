"""Entry point of the plugin: registers the architectures, importing nothing heavy (the model
module is named, not imported)."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_models(register) -> None:
    register(
        "Qwen2_5_VLForConditionalGeneration",
        "pagoda_models_vision.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    )
