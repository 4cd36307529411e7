"""Selecting one registered thing by name, or ``auto``: the best that supports the request."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from pagoda.plugins.errors import PluginError, PluginSelectionError
from pagoda.plugins.manager import get_registry


def select(
    kind: str,
    name: str,
    *,
    supports: Callable[[Any], bool] | None = None,
    needs: str = "",
    check: Callable[[str, Any], None] | None = None,
) -> Any:
    """Return the target registered as ``name`` in registry ``kind``.

    ``auto`` picks, among the targets that import, whose ``requires`` libraries (module names)
    are installed and for which ``supports(target)`` is true, the one with the highest
    ``priority`` attribute (ties: the first name in order). ``needs`` says
    what ``supports`` asks, for error messages (``"device=cpu, dtype=float32"``). ``check(name,
    target)`` may raise if a target is not the right kind of object.
    """
    registry = get_registry(kind)
    if name != "auto":
        target = registry.get(name)
        if check is not None:
            check(name, target)
        missing = _missing(target)
        if missing:
            others = [n for n in _usable(registry, supports, check)[0] if n != name]
            raise PluginSelectionError(
                f"{registry.noun} {name!r} needs {missing}, which is not installed; ones that "
                f"run here: {', '.join(others) or 'none'}"
            )
        if supports is not None and not supports(target):
            others = [n for n in _usable(registry, supports, check)[0] if n != name]
            raise PluginSelectionError(
                f"{registry.noun} {name!r} does not support {needs}; ones that do: "
                f"{', '.join(others) or 'none'}"
            )
        return target
    usable, why_not = _usable(registry, supports, check)
    if not usable:
        lines = [f"  {n}: {why}" for n, why in why_not.items()]
        lines += [f"  plugin {r.label}: {r.status} ({r.reason})" for r in registry.unavailable]
        detail = "\n" + "\n".join(lines) if lines else " (none is registered)"
        raise PluginSelectionError(
            f"no {registry.noun} supports {needs or 'this engine'}; install a plugin that "
            f"provides one, or name one explicitly.{detail}"
        )
    best = max(usable.items(), key=lambda item: getattr(item[1], "priority", 0))
    return best[1]


def _usable(
    registry: Any,
    supports: Callable[[Any], bool] | None,
    check: Callable[[str, Any], None] | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    usable: dict[str, Any] = {}
    why_not: dict[str, str] = {}
    for n in registry.names():
        try:
            target = registry.get(n)
            if check is not None:
                check(n, target)
        except PluginError as e:
            why_not[n] = str(e).splitlines()[0]
            continue
        missing = _missing(target)
        if missing:
            why_not[n] = f"needs {missing}, which is not installed"
        elif supports is None or supports(target):
            usable[n] = target
        else:
            why_not[n] = "does not support it"
    return usable, why_not


def _missing(target: Any) -> str:
    """The libraries of ``target.requires`` (module names) that cannot be imported here, as
    text ("" when none): a plugin may import its kernel library only when it runs."""
    names = [m for m in getattr(target, "requires", ()) or () if not _installed(m)]
    return ", ".join(repr(m) for m in names)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a broken spec
        return False
