"""Entry point of the plugin: registers the backend by name and its settings, importing neither
Triton nor torch."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_attention_backends(register) -> None:
    register("triton", "pagoda_attention_triton.backend:TritonAttentionBackend")


@hookimpl
def register_plugin_settings(register) -> None:
    register("triton", "pagoda_attention_triton.settings:TritonSettings")
