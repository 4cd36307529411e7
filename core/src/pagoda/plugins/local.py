"""Plugins registered from code, in this process: tests, notebooks, applications embedding Pagoda.

A module is registered under its own name and added to ``PAGODA_PLUGIN_MODULES``, so worker
processes started afterwards load it too (they inherit the environment). Any other object (a
class instance in a test) exists in this process only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from pagoda.plugins.collect import collect
from pagoda.plugins.errors import PluginError
from pagoda.plugins.manager import (
    _lock,
    add_plugin,
    env_modules,
    load_plugins,
    set_env_modules,
)
from pagoda.plugins.registry import PluginRecord


def register_plugin(plugin: Any, name: str | None = None) -> PluginRecord:
    """Register ``plugin`` (a module or an object with ``@pagoda.hookimpl`` methods) with the
    checks of discovery; raise :class:`PluginLoadError` if it fails."""
    with _lock:
        state = load_plugins()
        module = plugin.__name__ if isinstance(plugin, ModuleType) else None
        if module is not None and module != "__main__":
            if name not in (None, module):
                raise PluginError(f"a module plugin is named after its module ({module!r})")
            rec = add_plugin(state, plugin, module)
            set_env_modules([*env_modules(), module])
            return rec
        rec = add_plugin(state, plugin, name or type(plugin).__name__)
        state.local.append((plugin, rec.name))
        return rec


def unregister_plugin(name: str) -> None:
    """Undo :func:`register_plugin`."""
    with _lock:
        state = load_plugins()
        rec = next((r for r in state.records if r.name == name), None)
        if rec is None or rec.distribution is not None or rec.name == "pagoda":
            raise PluginError(f"no plugin {name!r} was registered in this process")
        if rec.plugin is not None and state.pm.is_registered(rec.plugin):
            state.pm.unregister(rec.plugin)
        state.records.remove(rec)
        state.local = [(p, n) for p, n in state.local if n != name]
        state.registries = collect(state)
        set_env_modules([m for m in env_modules() if m != name])


@contextmanager
def plugin_registered(plugin: Any, name: str | None = None) -> Iterator[PluginRecord]:
    """Register a plugin for the duration of a ``with`` block (tests)."""
    rec = register_plugin(plugin, name)
    try:
        yield rec
    finally:
        unregister_plugin(rec.name)
