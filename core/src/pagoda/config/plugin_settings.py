"""Plugin settings: the configuration's ``plugins.<name>.<key>`` values.

They come from the same sources as the core's keys: a file (``plugins: {name: {key: value}}``),
the environment (``PAGODA_PLUGINS__<NAME>__<KEY>``), flags (``--plugin-setting NAME.KEY=VALUE``)
and explicit arguments (``LLM(plugins={name: {key: value}})``).

The configuration gathers them and keeps their sources; it never asks the plugin registry. The
check against the pydantic model each plugin registers (``register_plugin_settings``) is the
plugin kernel's (``pagoda.plugins.settings``), which installs itself here as the
:class:`PluginSettingsChecker` when ``pagoda.plugins`` is imported (``import pagoda`` does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pagoda.config.errors import ConfigError

if TYPE_CHECKING:
    from pydantic import BaseModel

SECTION = "plugins"
ENV_PREFIX = "PAGODA_PLUGINS__"

#: Keys that select a registered thing by name -> the registry that must hold the name. A name
#: no plugin registers is a configuration error at load (``auto`` and None select none).
SELECTIONS: dict[str, str] = {
    "speculative.method": "spec_proposers",
    "structured_output.backend": "grammar_backends",
}


class PluginSettingsChecker(Protocol):
    """Checks the ``plugins`` section against the settings models that plugins register."""

    def validate(
        self, values: dict[str, dict[str, Any]], sources: dict[str, str]
    ) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """``(values, errors)``: each error names the key and its source."""
        ...

    def settings_of(self, name: str, values: dict[str, Any]) -> BaseModel:
        """Plugin ``name``'s settings model built from ``values`` (its defaults for the rest)."""
        ...

    def registered_rows(
        self, values: dict[str, dict[str, Any]], sources: dict[str, str]
    ) -> list[tuple[str, Any, str]]:
        """(``plugins.name.key``, value, source) for every key of every registered model."""
        ...

    def unknown_name(self, kind: str, name: str) -> str | None:
        """None if some plugin registers ``name`` in registry ``kind``; else one line saying so
        and naming the available ones."""
        ...


_checker: PluginSettingsChecker | None = None


def install_checker(checker: PluginSettingsChecker) -> None:
    """Set what checks plugin settings (the plugin kernel calls this once, on import)."""
    global _checker
    _checker = checker


def checker() -> PluginSettingsChecker:
    if _checker is None:
        raise ConfigError(
            "invalid configuration:\n  plugins: plugin settings need the plugin registry; "
            "import pagoda (or pagoda.plugins) before loading a configuration"
        )
    return _checker


def env_values(environ: Mapping[str, str] | None = None) -> tuple[dict, dict, list[str]]:
    """``PAGODA_PLUGINS__<NAME>__<KEY>`` variables: values ``{name: {key: text}}``, origins by
    path, and errors for malformed names."""
    environ = os.environ if environ is None else environ
    values: dict[str, dict[str, Any]] = {}
    origins: dict[tuple[str, ...], str] = {}
    errors = []
    for var, text in environ.items():
        if not var.upper().startswith(ENV_PREFIX):
            continue
        name, _, key = var[len(ENV_PREFIX) :].lower().partition("__")
        if not name or not key or "__" in key:
            errors.append(
                f"{SECTION}: {var} is not PAGODA_PLUGINS__<NAME>__<KEY> [from environment {var}]"
            )
            continue
        values.setdefault(name, {})[key] = text
        origins[(SECTION, name, key)] = f"environment {var}"
    return values, origins, errors


def flag_values(items: list[str]) -> dict[str, tuple[Any, str]]:
    """``--plugin-setting NAME.KEY=VALUE`` flags as ``{"plugins.NAME.KEY": (value, flag)}``."""
    out = {}
    for item in items:
        dotted, eq, value = item.partition("=")
        name, dot, key = dotted.partition(".")
        if not (eq and dot and name and key):
            raise ConfigError(
                f"invalid configuration:\n  --plugin-setting {item!r}: want NAME.KEY=VALUE"
            )
        out[f"{SECTION}.{name}.{key}"] = (value, f"--plugin-setting {item}")
    return out


def validate(
    values: dict[str, dict[str, Any]], sources: dict[str, str]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Check every plugin's values against its model (nothing to check: no registry asked)."""
    if not values:
        return {}, []
    return checker().validate(values, sources)


def selection_errors(selected: dict[str, Any], sources: dict[str, str]) -> list[str]:
    """An error per key of :data:`SELECTIONS` in ``selected`` (key -> value) whose name no
    plugin registers, naming the key's source and the available names."""
    errors = []
    for key, kind in SELECTIONS.items():
        name = selected.get(key)
        if name is None or name == "auto":
            continue
        why = checker().unknown_name(kind, name)
        if why is not None:
            errors.append(f"{key}: {why} [from {sources.get(key, 'default')}]")
    return errors


def registered_rows(
    values: dict[str, dict[str, Any]], sources: dict[str, str]
) -> list[tuple[str, Any, str]]:
    return checker().registered_rows(values, sources)
