"""Plugin discovery: once per process, each plugin in isolation, into registries.

Order: the core's own plugin (``pagoda.builtin_plugin``), then the ``pagoda`` entry points of the
installed distributions (by name), then the modules listed in ``PAGODA_PLUGIN_MODULES``. Each is
imported, checked (plugin API version, hook names, hook signatures) and registered on its own: one
that fails is recorded with its distribution, version and traceback, and the rest load. Nothing
here imports torch or a kernel library: registry targets stay lazy strings until selected.

Environment: ``PAGODA_PLUGINS`` (comma-separated entry-point or distribution names: load only
these), ``PAGODA_DISABLE_PLUGINS`` (never load these), ``PAGODA_PLUGIN_MODULES`` (importable
modules loaded as plugins too; ``register_plugin`` adds to it so that worker processes started
afterwards load the same plugins).
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any

import pluggy

from pagoda.plugins import hookspecs
from pagoda.plugins.collect import collect
from pagoda.plugins.errors import PluginAPIVersionError, PluginError, PluginLoadError
from pagoda.plugins.registry import PluginRecord, PluginState, Registry
from pagoda.version import __version__

logger = logging.getLogger("pagoda.plugins")

ENV_ALLOW = "PAGODA_PLUGINS"
ENV_DENY = "PAGODA_DISABLE_PLUGINS"
ENV_MODULES = "PAGODA_PLUGIN_MODULES"
BUILTIN = "pagoda"
_HOOK_NAMES = (*hookspecs.REGISTRY_HOOKS.values(), *hookspecs.SEAM_HOOKS)


_lock = threading.RLock()
_state: PluginState | None = None


def load_plugins() -> PluginState:
    """Discover and load plugins, once per process; later calls return the same state."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _discover()
    return _state


def reload_plugins() -> PluginState:
    """Discover again (after the environment or the installed plugins changed), keeping the
    plugin objects registered in this process."""
    global _state
    with _lock:
        local = _state.local if _state is not None else []
        _state = None
        state = load_plugins()
        for plugin, name in local:
            add_plugin(state, plugin, name)
            state.local.append((plugin, name))
        return state


def get_plugin_manager() -> pluggy.PluginManager:
    return load_plugins().pm


def get_registry(kind: str) -> Registry:
    """The registry of ``kind``: one of ``hookspecs.REGISTRY_HOOKS``."""
    registries = load_plugins().registries
    if kind not in registries:
        raise KeyError(f"unknown registry {kind!r}; registries: {', '.join(registries)}")
    return registries[kind]


def plugin_records() -> list[PluginRecord]:
    """Every plugin discovery saw, loaded or not, in load order."""
    return list(load_plugins().records)


# ---- discovery ----------------------------------------------------------------------------------


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _matches(rec: PluginRecord, names: set[str]) -> set[str]:
    keys = {_norm(rec.name), _norm(rec.source)}
    if rec.distribution:
        keys.add(_norm(rec.distribution))
    return {n for n in names if _norm(n) in keys}


def _discover() -> PluginState:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    allow, deny = _env_names(ENV_ALLOW), _env_names(ENV_DENY) or set()
    builtin = _builtin_record()
    if _matches(builtin, deny):
        raise PluginError(f"{ENV_DENY} names {BUILTIN!r}, the core's own plugin; it always loads")
    found: list[tuple[PluginRecord, Callable[[], Any]]] = [
        (builtin, lambda: importlib.import_module(builtin.source))
    ]
    for ep in sorted(metadata.entry_points(group=hookspecs.PROJECT), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        # (each of a distribution's name and version parses its METADATA file again: read once)
        meta = dist.metadata if dist else None
        rec = PluginRecord(
            ep.name,
            None if meta is None else meta["Name"],
            None if meta is None else meta["Version"],
            ep.value,
        )
        found.append((rec, ep.load))
    for mod in dict.fromkeys(env_modules()):
        rec = PluginRecord(mod, None, None, mod)
        found.append((rec, lambda m=mod: importlib.import_module(m)))

    records = [rec for rec, _ in found]
    seen_allow: set[str] = set()
    seen_deny: set[str] = set()
    for rec, loader in found:
        denied = _matches(rec, deny)
        allowed = _matches(rec, allow) if allow is not None else set()
        seen_deny |= denied
        seen_allow |= allowed
        # The core's plugin and modules named in PAGODA_PLUGIN_MODULES are asked for explicitly.
        explicit = rec is builtin or rec.distribution is None
        if denied:
            rec.status, rec.reason = "disabled", f"disabled by {ENV_DENY}"
        elif allow is not None and not allowed and not explicit:
            rec.status, rec.reason = "disabled", f"not listed in {ENV_ALLOW}"
        else:
            _load(pm, rec, loader, records)
    for var, given, seen in ((ENV_ALLOW, allow or set(), seen_allow), (ENV_DENY, deny, seen_deny)):
        missing = sorted(given - seen)
        if missing:
            installed = ", ".join(r.name for r in records if r is not builtin) or "none"
            raise PluginError(
                f"{var} names {', '.join(map(repr, missing))}, which matches no installed plugin; "
                f"installed plugins: {installed}"
            )
    state = PluginState(pm, records, {})
    state.registries = collect(state)
    for rec in records:
        if rec.status == "failed":
            logger.warning(
                "plugin %s failed to load: %s (`pagoda plugins` shows the traceback)",
                rec.label,
                rec.reason,
            )
    for registry in state.registries.values():
        for name in registry.conflicts:
            logger.warning("%s", registry.conflict_message(name))
    return state


def _builtin_record() -> PluginRecord:
    try:
        version = metadata.version("pagoda-core")
    except metadata.PackageNotFoundError:  # running from a source tree
        version = __version__
    return PluginRecord(BUILTIN, "pagoda-core", version, "pagoda.builtin_plugin")


def _load(
    pm: pluggy.PluginManager,
    rec: PluginRecord,
    loader: Callable[[], Any],
    records: list[PluginRecord],
) -> None:
    """Import, check and register one plugin; on any error record it and leave pm as it was."""
    plugin = None
    try:
        taken = [r for r in records if r is not rec and r.name == rec.name and r.status == "loaded"]
        if taken:
            raise PluginError(
                f"plugin name {rec.name!r} is already taken by {taken[0].label}; rename the "
                "entry point"
            )
        plugin = loader()
        rec.plugin = plugin
        _check_api_version(plugin, rec)
        _check_hook_names(pm, plugin, rec)
        pm.register(plugin, name=rec.name)
    except Exception as e:
        if plugin is not None and pm.is_registered(plugin):
            pm.unregister(plugin)
        rec.fail(e)
        return
    rec.status, rec.reason = "loaded", None
    rec.hooks = sorted(
        hc.name for hc in pm.get_hookcallers(plugin) or () if hc.name in hookspecs.SEAM_HOOKS
    )


def _check_api_version(plugin: Any, rec: PluginRecord) -> None:
    want = hookspecs.PLUGIN_API_VERSION
    declared = getattr(plugin, "PAGODA_PLUGIN_API", None)
    if declared is None:
        raise PluginAPIVersionError(
            f"plugin {rec.label} does not say which plugin API it was written for: add "
            f"`PAGODA_PLUGIN_API = {want}` to {rec.source}"
        )
    if type(declared) is not int or declared != want:
        raise PluginAPIVersionError(
            f"plugin {rec.label} was written for Pagoda plugin API {declared!r}, but this "
            f"pagoda-core provides plugin API {want}: install a version of "
            f"{rec.distribution or rec.source} written for API {want}, or a pagoda-core that "
            f"provides API {declared!r}"
        )


def _check_hook_names(pm: pluggy.PluginManager, plugin: Any, rec: PluginRecord) -> None:
    """A misspelled hook, or a hook function left unmarked, would never be called: refuse it."""
    for attr in dir(plugin):
        opts = pm.parse_hookimpl_opts(plugin, attr)
        if opts is None:
            if attr in _HOOK_NAMES and callable(getattr(plugin, attr, None)):
                raise PluginError(
                    f"plugin {rec.label} defines {attr}() without @pagoda.hookimpl, so Pagoda "
                    "would never call it: mark it with @pagoda.hookimpl"
                )
            continue
        hook = opts.get("specname") or attr
        if hook not in _HOOK_NAMES:
            close = difflib.get_close_matches(hook, _HOOK_NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginError(
                f"plugin {rec.label} implements {hook!r}, which is not a Pagoda hook{hint}; "
                f"the hooks are: {', '.join(_HOOK_NAMES)}"
            )


def add_plugin(state: PluginState, plugin: Any, name: str) -> PluginRecord:
    """Load one more plugin object into ``state``, with the checks of discovery; raise if it
    fails, leaving ``state`` as it was."""
    rec = PluginRecord(name, None, None, getattr(plugin, "__name__", None) or repr(plugin))
    _load(state.pm, rec, lambda: plugin, state.records)
    if rec.status == "loaded":
        state.records.append(rec)
        state.registries = collect(state)
        if rec.status != "loaded":  # its registry hooks raised
            state.records.remove(rec)
            state.registries = collect(state)
    if rec.status != "loaded":
        msg = f"plugin {name!r} failed to load: {rec.reason}\n{rec.traceback}"
        raise PluginLoadError(msg) from rec.exception
    return rec


def env_modules() -> list[str]:
    """The modules named in ``PAGODA_PLUGIN_MODULES``."""
    return [m.strip() for m in os.environ.get(ENV_MODULES, "").split(",") if m.strip()]


def set_env_modules(modules: list[str]) -> None:
    modules = list(dict.fromkeys(modules))
    if modules:
        os.environ[ENV_MODULES] = ",".join(modules)
    else:
        os.environ.pop(ENV_MODULES, None)
