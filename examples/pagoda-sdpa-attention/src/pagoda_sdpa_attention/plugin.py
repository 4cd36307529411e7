"""The module the ``pagoda`` entry point names: it registers the backend lazily, by name."""

from __future__ import annotations

import pagoda

PAGODA_PLUGIN_API = 1


@pagoda.hookimpl
def register_attention_backends(register):
    register("sdpa", "pagoda_sdpa_attention.backend:PagedSdpaBackend")
