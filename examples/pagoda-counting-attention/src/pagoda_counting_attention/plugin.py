"""The module the ``pagoda`` entry point names: hook implementations only.

Pagoda imports it at discovery, so it imports nothing heavy: the backend is registered as a lazy
``"module:Class"`` string and imported only when a user selects ``counting``.
"""

from __future__ import annotations

import pagoda

PAGODA_PLUGIN_API = 1  # the Pagoda plugin API this plugin was written for


@pagoda.hookimpl
def register_attention_backends(register):
    register("counting", "pagoda_counting_attention.backend:CountingBackend")
