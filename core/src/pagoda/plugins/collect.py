"""Building the registries: every loaded plugin's registration hooks, called and checked.

A plugin whose registration hook raises fails as a whole: it is unregistered, and the names it
registered before raising point at its error, as do the names a plugin that failed after its
import would have registered (found best effort, by calling its registration hooks).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import pluggy

from pagoda.plugins import hookspecs
from pagoda.plugins.registry import PluginRecord, PluginState, Registration, Registry


def collect(state: PluginState) -> dict[str, Registry]:
    """Call every loaded plugin's registry hooks and build the registries.

    A plugin whose registry hook raises fails as a whole: it is unregistered, and the names it
    registered before raising point at its error.
    """
    regs: dict[str, list[Registration]] = {k: [] for k in hookspecs.REGISTRY_HOOKS}
    failed_names: dict[str, dict[str, PluginRecord]] = {k: {} for k in hookspecs.REGISTRY_HOOKS}
    for rec in state.records:
        rec.registers = {}
        if rec.status not in ("loaded", "failed") or rec.plugin is None:
            continue
        got: list[Registration] = []
        if rec.status == "loaded":
            try:
                _call_registry_hooks(state.pm, rec, got)
            except Exception as e:
                state.pm.unregister(rec.plugin)
                rec.fail(e)
        if rec.status == "failed":
            got += _names_of_failed(state.pm, rec)
            for r in got:
                failed_names[r.kind].setdefault(r.name, rec)
            continue
        for r in got:
            regs[r.kind].append(r)
            rec.registers.setdefault(r.kind, []).append(r.name)
    unavailable = [r for r in state.records if r.status in ("failed", "disabled")]
    return {
        kind: Registry.build(kind, regs[kind], failed_names[kind], unavailable)
        for kind in hookspecs.REGISTRY_HOOKS
    }


def _collector(kind: str, rec: PluginRecord, out: list[Registration]) -> hookspecs.Register:
    noun = kind.replace("_", " ").removesuffix("s")

    def register(name: str, target: str | Callable[..., Any], override: bool = False) -> None:
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"register() needs a non-empty {noun} name; got {name!r}")
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            if not module or not attr:
                raise ValueError(
                    f"the target of {noun} {name!r} is {target!r}; a lazy target looks like "
                    "'package.module:Name'"
                )
        elif not callable(target):
            raise TypeError(
                f"the target of {noun} {name!r} must be a 'package.module:Name' string or a "
                f"class or factory; got {type(target).__name__}"
            )
        out.append(Registration(kind, name, target, rec, bool(override)))

    return register


def _call_registry_hooks(pm: pluggy.PluginManager, rec: PluginRecord, out: list) -> None:
    for kind, hook_name in hookspecs.REGISTRY_HOOKS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin is rec.plugin:
                args = {"register": _collector(kind, rec, out)}
                impl.function(*[args[a] for a in impl.argnames])


def _names_of_failed(pm: pluggy.PluginManager, rec: PluginRecord) -> list[Registration]:
    """What a plugin that failed after import would have registered, best effort: a user who
    selects one of these names gets the plugin's own error instead of 'unknown name'."""
    out: list[Registration] = []
    for attr in dir(rec.plugin):
        opts = pm.parse_hookimpl_opts(rec.plugin, attr)
        hook = (opts or {}).get("specname") or attr
        close = difflib.get_close_matches(hook, hookspecs.REGISTRY_HOOKS.values(), n=1, cutoff=0.9)
        if opts is None or not close:
            continue
        kind = next(k for k, h in hookspecs.REGISTRY_HOOKS.items() if h == close[0])
        try:
            getattr(rec.plugin, attr)(_collector(kind, rec, out))
        except Exception:  # best effort: the plugin's own error is already recorded
            pass
    return out
