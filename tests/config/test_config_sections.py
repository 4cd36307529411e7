"""The loader reads the sections from pagoda.config.model; EngineConfig declares them as fields."""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.config.loader import sections


def test_engine_config_fields_are_the_loaders_sections_in_order() -> None:
    fields = {name: f.annotation for name, f in EngineConfig.model_fields.items()}
    assert list(fields) == list(sections())
    for name, section in sections().items():
        assert fields[name] is section, name
