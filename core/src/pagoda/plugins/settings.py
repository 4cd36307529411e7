"""Plugin settings checked against the pydantic model each plugin registers
(``register_plugin_settings``), beside the registry that holds those models.

The configuration (a lower floor) gathers the ``plugins.<name>.<key>`` values and their sources;
this module is the :class:`pagoda.config.plugin_settings.PluginSettingsChecker` it uses. The
registry is consulted only when some value is given, or when a plugin asks for its settings.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from pagoda.config.errors import ConfigError
from pagoda.config.plugin_settings import SECTION
from pagoda.plugins.errors import UnknownNameError
from pagoda.plugins.manager import get_registry

if TYPE_CHECKING:
    from pydantic import BaseModel


def _hint(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class RegistrySettings:
    """Plugin settings checked against the ``plugin_settings`` registry."""

    def _model(self, name: str) -> type[BaseModel]:
        registry = get_registry("plugin_settings")
        if name not in registry:
            known = ", ".join(registry.names()) or "none"
            raise ConfigError(
                f"invalid configuration:\n  {SECTION}.{name}: no installed plugin registers "
                f"settings under this name{_hint(name, registry.names())}; plugins with "
                f"settings: {known}"
            )
        return registry.get(name)

    def validate(
        self, values: dict[str, dict[str, Any]], sources: dict[str, str]
    ) -> tuple[dict[str, dict[str, Any]], list[str]]:
        # NOTE: pydantic loads where a setting is checked; plugin discovery does not pay for it.
        from pydantic import ValidationError

        errors = []
        for name, given in values.items():
            where = sources.get(f"{SECTION}.{name}.{next(iter(given), '')}", "?")
            try:
                model = self._model(name)
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
        return values, errors

    def settings_of(self, name: str, values: dict[str, Any]) -> BaseModel:
        return self._model(name).model_validate(values)

    def registered_rows(
        self, values: dict[str, dict[str, Any]], sources: dict[str, str]
    ) -> list[tuple[str, Any, str]]:
        rows = []
        for name in get_registry("plugin_settings").names():
            try:
                settings = self.settings_of(name, values.get(name, {}))
            except Exception:  # noqa: BLE001 - a plugin that fails shows in `pagoda plugins`
                continue
            for key in type(settings).model_fields:
                dotted = f"{SECTION}.{name}.{key}"
                value = getattr(settings, key)
                if hasattr(value, "model_dump"):  # a nested pydantic model
                    value = value.model_dump()
                rows.append((dotted, value, sources.get(dotted, "default")))
        return rows

    def unknown_name(self, kind: str, name: str) -> str | None:
        try:
            get_registry(kind).registration(name)
        except UnknownNameError as e:
            return str(e).splitlines()[0]
        except Exception:  # noqa: BLE001 - a failed or duplicate provider errs when selected
            return None
        return None
