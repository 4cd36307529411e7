"""Entry point of the plugin: registers the backend by name and its settings, without importing
FlashInfer."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_attention_backends(register) -> None:
    register("flashinfer", "pagoda_attention_flashinfer.backend:FlashInferBackend")


@hookimpl
def register_plugin_settings(register) -> None:
    register("flashinfer", "pagoda_attention_flashinfer.settings:FlashInferSettings")
