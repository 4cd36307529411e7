"""Plugin discovery (entry-point group ``pagoda``) and the registries the hooks fill."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pluggy

from pagoda.plugins import hookspecs
from pagoda.utils import resolve_target


@dataclass
class _Entry:
    target: Any
    plugin: str


@dataclass
class Registry:
    """Names to lazy targets, for one kind of thing (attention backends, executors, ...)."""

    kind: str
    entries: dict[str, _Entry] = field(default_factory=dict)

    def register(self, name: str, target: Any, *, plugin: str, override: bool = False) -> None:
        if name in self.entries and not override:
            raise ValueError(
                f"{self.kind} {name!r} is registered twice: by {self.entries[name].plugin!r} and "
                f"by {plugin!r} (pass override=True to replace it)"
            )
        self.entries[name] = _Entry(target, plugin)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> Any:
        entry = self.entries.get(name)
        if entry is None:
            known = ", ".join(self.names()) or "none"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}")
        return resolve_target(entry.target)


_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None
_registries: dict[str, Registry] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    """Load plugins once per process: the built-in one, then the ``pagoda`` entry points."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT)
            pm.add_hookspecs(hookspecs)
            from pagoda import builtin_plugin

            pm.register(builtin_plugin, name="pagoda")
            pm.load_setuptools_entrypoints(hookspecs.PROJECT)
            pm.check_pending()
            _collect(pm)
            _pm = pm
        return _pm


def _collect(pm: pluggy.PluginManager) -> None:
    _registries.clear()
    for kind, hook_name in hookspecs.all_registry_hooks().items():
        reg = Registry(kind.replace("_", " ").rstrip("s"))
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            plugin = impl.plugin_name

            def register(
                name: str, target: Any, override: bool = False, _p: str = plugin, _r: Registry = reg
            ) -> None:
                _r.register(name, target, plugin=_p, override=override)

            impl.function(register=register)
        _registries[kind] = reg


def get_registry(kind: str) -> Registry:
    get_plugin_manager()
    return _registries[kind]
