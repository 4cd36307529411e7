"""Layering the configuration sources, and remembering where each value came from.

Sources, lowest first: defaults, the file, the environment, command-line flags, explicit
arguments. Each source is validated on its own, so a bad value is reported against the source
that holds it even when a higher one overrides it; then they are merged key by key (a value of
``false`` or ``0`` is a value like any other) and validated together.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource

from pagoda.config import plugin_settings
from pagoda.config.errors import ConfigError
from pagoda.config.files import read_config_file
from pagoda.config.model import SECTIONS

#: The configuration class being loaded (``pagoda.config.engine.EngineConfig``).
C = TypeVar("C", bound=BaseSettings)

ENV_PREFIX = "PAGODA_"
ENV_DELIMITER = "__"


@dataclass
class Layer:
    """One source's values (nested ``{section: {key: value}}``) and where each came from."""

    label: str  # "file engine.yaml", "environment", ...
    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[tuple[str, ...], str] = field(default_factory=dict)

    def where(self, path: tuple[str, ...]) -> str:
        for n in range(len(path), 0, -1):
            if path[:n] in self.origins:
                return self.origins[path[:n]]
        return self.label


# Set while EngineConfig.load builds the model from sources it has already layered itself.
LAYERED: ContextVar[bool] = ContextVar("pagoda_config_layered", default=False)


def sections() -> dict[str, type[BaseModel]]:
    return dict(SECTIONS)


def leaf_keys() -> list[str]:
    """Every ``section.key``, in declaration order."""
    return [f"{s}.{k}" for s, model in sections().items() for k in model.model_fields]


# vLLM's flat names where the rule below would give another: ``LLM(model_impl="native")``.
_VLLM_FLAT_NAMES = {("model", "impl"): "model_impl"}


def flat_names() -> dict[str, tuple[str, str]]:
    """Flat (vLLM-style) argument name -> (section, key). A key that exists in one section only
    is its own flat name; one found in several is ``section_key`` (``attention_backend``), except
    ``model.model``, which is ``model``, and vLLM's own names (``model.impl``: ``model_impl``)."""
    count: dict[str, int] = {}
    for model in sections().values():
        for key in model.model_fields:
            count[key] = count.get(key, 0) + 1
    out: dict[str, tuple[str, str]] = {}
    for section, model in sections().items():
        for key in model.model_fields:
            unique = count[key] == 1 or (section, key) == ("model", "model")
            name = key if unique else f"{section}_{key}"
            out[_VLLM_FLAT_NAMES.get((section, key), name)] = (section, key)
    return out


# ---- the layers ---------------------------------------------------------------------------------


def file_layer(path: str | Path) -> Layer:
    data, lines = read_config_file(path)
    layer = Layer(f"file {path}", data)
    for p, line in lines.items():
        layer.origins[p] = f"file {path}, line {line}"
    return layer


def env_layer(cls: type[BaseSettings]) -> Layer:
    environ = os.environ
    _check_env_names(environ)
    values = EnvSettingsSource(cls)()
    layer = Layer("environment", values)
    upper = {k.upper(): k for k in environ}
    for section, value in values.items():
        name = f"{ENV_PREFIX}{section}".upper()
        layer.origins[(section,)] = f"environment {upper.get(name, name)}"
        if isinstance(value, dict):
            for key in value:
                var = f"{ENV_PREFIX}{section}{ENV_DELIMITER}{key}".upper()
                if var in upper:
                    layer.origins[(section, key)] = f"environment {upper[var]}"
    _vllm_alias(layer, upper)
    values, origins, errors = plugin_settings.env_values(environ)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    if values:
        layer.values[plugin_settings.SECTION] = values
        layer.origins.update(origins)
    return layer


def _vllm_alias(layer: Layer, upper: Mapping[str, str]) -> None:
    """vLLM's ``VLLM_BATCH_INVARIANT`` sets ``model.batch_invariant`` unless Pagoda's own
    variable does."""
    # NOTE: pagoda.ops imports torch; the configuration loads without it.
    from pagoda.ops.batch_invariant import ENV_VAR, env_requests_batch_invariant

    if ENV_VAR not in upper or "batch_invariant" in layer.values.get("model", {}):
        return
    layer.values.setdefault("model", {})["batch_invariant"] = env_requests_batch_invariant()
    layer.origins[("model", "batch_invariant")] = f"environment {upper[ENV_VAR]}"


def _check_env_names(environ: Mapping[str, str]) -> None:
    """``PAGODA_SECTION__KEY`` with an unknown section, or ``PAGODA_SECTION_KEY`` (one underscore),
    would otherwise be ignored: both are errors."""
    secs = sections()
    errors = []
    for var in environ:
        upper = var.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        rest = upper[len(ENV_PREFIX) :].lower()
        if ENV_DELIMITER in rest:
            section = rest.split(ENV_DELIMITER, 1)[0]
            if section not in secs and section != plugin_settings.SECTION:
                errors.append(
                    f"{section}: unknown section{_hint(section, secs)}; sections are: "
                    f"{', '.join(secs)} [from environment {var}]"
                )
            continue
        for section, model in secs.items():
            key = rest.removeprefix(f"{section}_")
            if key != rest and key in model.model_fields:
                good = f"{ENV_PREFIX}{section}{ENV_DELIMITER}{key}".upper()
                errors.append(
                    f"{section}.{key}: set as {var}, which Pagoda does not read; write {good} "
                    f"(two underscores between section and key) [from environment {var}]"
                )
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def flags_layer(flags: dict[str, tuple[Any, str]]) -> Layer:
    layer = Layer("command line")
    for dotted, (value, flag) in flags.items():
        section, key = dotted.split(".", 1)
        if section == plugin_settings.SECTION:  # plugins.NAME.KEY
            name, key = key.split(".", 1)
            layer.values.setdefault(section, {}).setdefault(name, {})[key] = value
            layer.origins[(section, name, key)] = f"flag {flag}"
            continue
        layer.values.setdefault(section, {})[key] = value
        layer.origins[(section, key)] = f"flag {flag}"
    return layer


# vLLM's argument names for whole sections: ``LLM(speculative_config={...})``.
_SECTION_ALIASES = {"speculative_config": "speculative"}

# vLLM's argument names for single keys: ``LLM(distributed_executor_backend="mp")``.
_KEY_ALIASES = {
    "distributed_executor_backend": "executor",
    "kv_offloading_size": "cpu_offload_gb",
}


def explicit_layer(overrides: Mapping[str, Any]) -> Layer:
    """Explicit arguments, nested (``cache={"block_size": 8}``) or flat (``block_size=8``)."""
    layer = Layer("argument")
    secs, flat = sections(), flat_names()
    for name, value in overrides.items():
        name = _KEY_ALIASES.get(name, name)
        name = _SECTION_ALIASES.get(name, name)
        if name == plugin_settings.SECTION and isinstance(value, Mapping):
            layer.values[name] = {
                k: dict(v) if isinstance(v, Mapping) else v for k, v in value.items()
            }
            for plugin, keys in value.items():
                for key in keys if isinstance(keys, Mapping) else ():
                    layer.origins[(name, plugin, key)] = (
                        f"argument {name}={{{plugin!r}: {{{key!r}: ...}}}}"
                    )
        elif name in secs and name not in flat and value is None:
            continue  # vLLM's way to say "none": ``LLM(speculative_config=None)``, the defaults
        elif name in secs and isinstance(value, Mapping):
            layer.values.setdefault(name, {}).update(value)
            for key in value:
                layer.origins[(name, key)] = f"argument {name}={{{key!r}: ...}}"
        elif name in flat:
            section, key = flat[name]
            layer.values.setdefault(section, {})[key] = value
            layer.origins[(section, key)] = f"argument {name}"
        elif name in secs:
            raise ConfigError(
                f"invalid configuration:\n  {name}: a section takes a mapping of its keys, got "
                f"{type(value).__name__} {value!r} [from argument {name}]"
            )
        else:
            raise ConfigError(
                f"invalid configuration:\n  {name}: unknown engine argument{_hint(name, flat)}; "
                f"arguments are: {', '.join(sorted(flat))} [from argument {name}]"
            )
    return layer


def _base_layer(config: C) -> Layer:
    """An already-built configuration as a layer: its non-default values, sources kept."""
    layer = Layer("configuration")
    for dotted, source in config._sources.items():
        section, key = dotted.split(".", 1)
        if section == plugin_settings.SECTION:
            name, key = key.split(".", 1)
            value = config._plugin_values[name][key]
            layer.values.setdefault(section, {}).setdefault(name, {})[key] = value
            layer.origins[(section, name, key)] = source
            continue
        layer.values.setdefault(section, {})[key] = getattr(getattr(config, section), key)
        layer.origins[(section, key)] = source
    return layer


# ---- merging and validation ---------------------------------------------------------------------


def load_config(
    cls: type[C],
    config_file: str | Path | None,
    overrides: Mapping[str, Any] | None,
    flags: dict[str, tuple[Any, str]] | None,
) -> C:
    layers = []
    if config_file is not None:
        layers.append(file_layer(config_file))
    layers.append(env_layer(cls))
    if flags:
        layers.append(flags_layer(flags))
    if overrides:
        layers.append(explicit_layer(overrides))
    return build(cls, layers)


def apply_overrides(config: C, overrides: Mapping[str, Any]) -> C:
    return build(type(config), [_base_layer(config), explicit_layer(overrides)])


def build(cls: type[C], layers: list[Layer]) -> C:
    """Validate each layer, merge them (later layers win) and build the configuration."""
    plugin_values, plugin_sources, errors = _take_plugin_values(layers)
    errors = [e for layer in layers for e in _layer_errors(layer)] + errors
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for layer in layers:
        for section, values in layer.values.items():
            for key, value in values.items():
                merged.setdefault(section, {})[key] = value
                sources[f"{section}.{key}"] = layer.where((section, key))
    token = LAYERED.set(True)
    try:
        config = cls(**merged)
    except ValidationError as e:
        raise ConfigError(_cross_field_errors(e, sources)) from None
    finally:
        LAYERED.reset(token)
    # NOTE: a name no plugin registers fails here, at start, in every command and in LLM(...),
    # not later in the engine process or per request.
    selected = {}
    for dotted in plugin_settings.SELECTIONS:
        section, key = dotted.split(".")
        selected[dotted] = getattr(getattr(config, section), key)
    errors = plugin_settings.selection_errors(selected, sources)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    config._sources = {**sources, **plugin_sources}
    config._plugin_values = plugin_values
    for section in SECTIONS:
        getattr(config, section)._plugin_values = plugin_values
    return config


def _take_plugin_values(layers: list[Layer]) -> tuple[dict, dict[str, str], list[str]]:
    """Take the ``plugins`` section out of every layer: the merged values, their sources, and
    the errors of checking them against each plugin's settings model."""
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    errors = []
    section = plugin_settings.SECTION
    for layer in layers:
        raw = layer.values.pop(section, None)
        if raw is None:
            continue
        if not isinstance(raw, Mapping):
            errors.append(
                f"{section}: must be a mapping of plugin names to their settings, got {raw!r} "
                f"[from {layer.where((section,))}]"
            )
            continue
        for name, values in raw.items():
            if not isinstance(values, Mapping):
                errors.append(
                    f"{section}.{name}: must be a mapping of settings, got {values!r} "
                    f"[from {layer.where((section, name))}]"
                )
                continue
            for key, value in values.items():
                merged.setdefault(str(name), {})[str(key)] = value
                sources[f"{section}.{name}.{key}"] = layer.where((section, name, key))
    merged, more = plugin_settings.validate(merged, sources)
    return merged, sources, errors + more


def _layer_errors(layer: Layer) -> list[str]:
    secs = sections()
    errors = []
    for section, values in layer.values.items():
        where = layer.where((section,))
        if section not in secs:
            errors.append(
                f"{section}: unknown section{_hint(section, secs, _flat_hint(section))}; "
                f"sections are: {', '.join(secs)} [from {where}]"
            )
        elif not isinstance(values, Mapping):
            errors.append(
                f"{section}: must be a mapping of keys (like {{{_first_key(section)}: ...}}), "
                f"got {values!r} [from {where}]"
            )
        else:
            try:
                secs[section].model_validate(dict(values))
            except ValidationError as e:
                errors += [_format_error(section, err, layer) for err in e.errors()]
    return errors


def _format_error(section: str, err: Any, layer: Layer) -> str:
    key = str(err["loc"][0]) if err["loc"] else ""
    dotted = f"{section}.{key}"
    where = layer.where((section, key))
    if err["type"] == "extra_forbidden":
        known = sections()[section].model_fields
        return (
            f"{dotted}: unknown key{_hint(key, known)}; keys of {section}: {', '.join(known)} "
            f"[from {where}]"
        )
    return f"{dotted}: {err['msg']} (got {err['input']!r}) [from {where}]"


def _cross_field_errors(e: ValidationError, sources: dict[str, str]) -> str:
    lines = []
    for err in e.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        keys = [k for k in leaf_keys() if re.search(rf"\b{re.escape(k)}\b", msg)]
        origin = "; ".join(f"{k} from {sources.get(k, 'default')}" for k in keys)
        lines.append(f"{msg} [{origin}]" if origin else msg)
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _hint(word: str, choices: Any, extra: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else extra


def _flat_hint(name: str) -> str:
    """A flat argument name used as a section in a file: say which section it belongs to."""
    flat = flat_names().get(name)
    if flat is None:
        return ""
    return f" ({name} belongs under {flat[0]}:, as {flat[0]}.{flat[1]})"


def _first_key(section: str) -> str:
    return next(iter(sections()[section].model_fields))


# ---- the effective configuration ----------------------------------------------------------------


def effective_rows(config: C) -> list[tuple[str, Any, str]]:
    """(``section.key``, value, source) for every key."""
    sources = config.sources
    rows = []
    for dotted in leaf_keys():
        section, key = dotted.split(".", 1)
        rows.append((dotted, getattr(getattr(config, section), key), sources[dotted]))
    # Every installed plugin's settings, with defaults: what a user can set.
    rows += plugin_settings.registered_rows(config._plugin_values, config._sources)
    return rows


def format_effective(config: C, fmt: str = "table") -> str:
    """The effective configuration with the source of each value: ``table``, ``yaml`` (a file
    ``--config`` accepts, sources as comments) or ``json``."""
    rows = effective_rows(config)
    if fmt == "json":
        out = {k: {"value": v, "source": s} for k, v, s in rows}
        return json.dumps(out, indent=2)
    if fmt == "yaml":
        lines, current = [], None
        for dotted, value, source in rows:
            *heads, key = dotted.split(".")
            for depth in range(len(heads)):
                if current is None or current[: depth + 1] != heads[: depth + 1]:
                    lines.append("  " * depth + f"{heads[depth]}:")
                    current = heads[: depth + 1]
            current = heads
            lines.append("  " * len(heads) + f"{key}: {json.dumps(value)}  # {source}")
        return "\n".join(lines)
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}; formats: table, yaml, json")
    shown = [(k, json.dumps(v), s) for k, v, s in rows]
    w1 = max(len(r[0]) for r in shown)
    w2 = max(len(r[1]) for r in shown)
    lines = [f"{'KEY':<{w1}}  {'VALUE':<{w2}}  SOURCE"]
    lines += [f"{k:<{w1}}  {v:<{w2}}  {s}" for k, v, s in shown]
    return "\n".join(lines)
