"""Reading a configuration file: YAML (``.yaml``, ``.yml``, ``.json``) or TOML (``.toml``).

YAML keys that appear twice are an error (PyYAML would keep the last one silently), and each key
remembers its line, so that an error can point at it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.config.errors import ConfigError

YAML_SUFFIXES = (".yaml", ".yml", ".json")
TOML_SUFFIXES = (".toml",)


def read_config_file(path: str | Path) -> tuple[dict[str, Any], dict[tuple[str, ...], int]]:
    """The file's mapping of sections, and the line of each ``(section,)`` and
    ``(section, key)`` where known (YAML only)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix not in YAML_SUFFIXES + TOML_SUFFIXES:
        raise ConfigError(
            f"config file {str(path)!r}: unknown file type {suffix or '(none)'!r}; use YAML "
            f"({', '.join(YAML_SUFFIXES)}) or TOML (.toml)"
        )
    text = p.read_text(encoding="utf-8")
    lines: dict[tuple[str, ...], int] = {}
    try:
        if suffix in TOML_SUFFIXES:
            data = _load_toml(text)
        else:
            data, lines = _load_yaml(text)
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except Exception as e:
        raise ConfigError(f"config file {str(path)!r} could not be parsed: {e}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of sections (model:, cache:, ...), "
            f"not a {type(data).__name__}"
        )
    return data, lines


def _load_toml(text: str) -> Any:
    try:
        # NOTE: tomllib loads only where a TOML file is read.
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


def _load_yaml(text: str) -> tuple[Any, dict[tuple[str, ...], int]]:
    # NOTE: PyYAML loads only where a YAML file is read.
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        loader.flatten_mapping(node)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if key in out:
                raise ConfigError(
                    f"key {key!r} appears twice (line {key_node.start_mark.line + 1}); "
                    "give each key once"
                )
            out[key] = loader.construct_object(value_node, deep=True)
        return out

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    data = yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass
    lines: dict[tuple[str, ...], int] = {}
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            section = str(k.value)
            lines[(section,)] = k.start_mark.line + 1
            if isinstance(v, yaml.MappingNode):
                for kk, vv in v.value:
                    lines[(section, str(kk.value))] = kk.start_mark.line + 1
                    if isinstance(vv, yaml.MappingNode):  # plugins.<name>.<key>
                        for key, _ in vv.value:
                            path = (section, str(kk.value), str(key.value))
                            lines[path] = key.start_mark.line + 1
    return data, lines
