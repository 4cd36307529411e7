"""Plugin settings: the configuration's ``plugins.<name>.<key>`` values, validated by the pydantic
model each plugin registers through ``register_plugin_settings``.

They come from the same sources as the core's keys: a file (``plugins: {name: {key: value}}``),
the environment (``PAGODA_PLUGINS__<NAME>__<KEY>``), flags (``--plugin-setting NAME.KEY=VALUE``)
and explicit arguments (``LLM(plugins={name: {key: value}})``). The plugin registry is consulted
only when some value is given, or when a plugin asks for its settings.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

SECTION = "plugins"
ENV_PREFIX = "PAGODA_PLUGINS__"


def _hint(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
    from pagoda.config.model import ConfigError

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


def _registry() -> Any:
    from pagoda.plugins import get_registry

    return get_registry("plugin_settings")


def _model(name: str) -> type[BaseModel]:
    from pagoda.config.model import ConfigError

    registry = _registry()
    if name not in registry:
        known = ", ".join(registry.names()) or "none"
        raise ConfigError(
            f"invalid configuration:\n  {SECTION}.{name}: no installed plugin registers settings"
            f" under this name{_hint(name, registry.names())}; plugins with settings: {known}"
        )
    return registry.get(name)


def validate(
    values: dict[str, dict[str, Any]], sources: dict[str, str]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Check every plugin's values against its model: ``(values, errors)``, each error naming
    the key and its source."""
    from pagoda.config.model import ConfigError

    if not values:
        return {}, []
    registry = _registry()
    errors = []
    for name, given in values.items():
        where = sources.get(f"{SECTION}.{name}.{next(iter(given), '')}", "?")
        try:
            model = _model(name)
        except ConfigError as e:
            errors.append(str(e).split("\n  ", 1)[1] + f" [from {where}]")
            continue
        known = list(model.model_fields)
        for key in given:
            if key not in model.model_fields:
                errors.append(
                    f"{SECTION}.{name}.{key}: unknown key{_hint(key, known)}; keys of "
                    f"{SECTION}.{name}: {', '.join(known) or 'none'} "
                    f"[from {sources.get(f'{SECTION}.{name}.{key}', '?')}]"
                )
        try:
            model.model_validate({k: v for k, v in given.items() if k in model.model_fields})
        except ValidationError as e:
            for err in e.errors():
                key = str(err["loc"][0]) if err["loc"] else ""
                dotted = f"{SECTION}.{name}.{key}"
                errors.append(
                    f"{dotted}: {err['msg']} (got {err['input']!r}) "
                    f"[from {sources.get(dotted, 'default')}]"
                )
    del registry
    return values, errors


def settings_of(name: str, values: dict[str, Any]) -> BaseModel:
    """Plugin ``name``'s settings model built from ``values`` (its defaults for the rest)."""
    return _model(name).model_validate(values)


def registered_rows(
    values: dict[str, dict[str, Any]], sources: dict[str, str]
) -> list[tuple[str, Any, str]]:
    """(``plugins.name.key``, value, source) for every key of every registered settings model."""
    rows = []
    registry = _registry()
    for name in registry.names():
        try:
            settings = settings_of(name, values.get(name, {}))
        except Exception:  # noqa: BLE001 - a plugin that fails shows in `pagoda plugins`
            continue
        for key in type(settings).model_fields:
            dotted = f"{SECTION}.{name}.{key}"
            value = getattr(settings, key)
            if isinstance(value, BaseModel):
                value = value.model_dump()
            rows.append((dotted, value, sources.get(dotted, "default")))
    return rows
