"""Plugin settings: a ``plugins.<name>`` section, validated by the pydantic model the plugin
registers, from a file, the environment, flags and arguments; it reaches the plugin through the
configuration, shows in ``pagoda config`` with its source, and a misspelled key is refused by
name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagoda.config import ConfigError, EngineConfig
from pagoda.entrypoints.cli import main
from pagoda.plugins import reload_plugins
from pagoda.plugins.seams import build_logits_processors

KNOBS = """
from pydantic import BaseModel

class KnobSettings(BaseModel):
    greeting: str = "hello"
    repeat: int = 1

SEEN = []

@hookimpl
def register_plugin_settings(register):
    register("knobs", "knobs_plugin:KnobSettings")

@hookimpl
def logits_processors(config):
    SEEN.append(config.plugin_settings("knobs"))
    return None
"""

YAML = """\
cache:
  block_size: 8
plugins:
  knobs:
    greeting: hi
"""


@pytest.fixture
def knobs(fake_site, tmp_path: Path) -> Path:
    fake_site.add("pagoda-knobs", "knobs_plugin", KNOBS)
    reload_plugins()
    path = tmp_path / "engine.yaml"
    path.write_text(YAML)
    return path


def test_a_files_plugin_section_reaches_the_plugin_through_the_configuration(knobs) -> None:
    import knobs_plugin

    config = EngineConfig.load(knobs)
    build_logits_processors(config, 32, torch.device("cpu"))
    seen = knobs_plugin.SEEN[-1]
    assert type(seen).__name__ == "KnobSettings"
    assert (seen.greeting, seen.repeat) == ("hi", 1)
    assert config.source_of("plugins.knobs.greeting") == f"file {knobs}, line 5"


def test_environment_flags_and_arguments_layer_over_the_file(knobs, monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_PLUGINS__KNOBS__REPEAT", "5")
    config = EngineConfig.load(knobs)
    assert config.plugin_settings("knobs").repeat == 5
    assert config.source_of("plugins.knobs.repeat") == "environment PAGODA_PLUGINS__KNOBS__REPEAT"
    flags = {"plugins.knobs.repeat": ("6", "--plugin-setting knobs.repeat=6")}
    config = EngineConfig.load(knobs, flags=flags)
    assert config.plugin_settings("knobs").repeat == 6
    config = EngineConfig.load(knobs, {"plugins": {"knobs": {"repeat": 7}}}, flags=flags)
    assert config.plugin_settings("knobs").repeat == 7
    assert config.plugin_settings("knobs").greeting == "hi"
    # A copy with more arguments keeps the plugin's values and their sources.
    again = config.with_overrides({"block_size": 32})
    assert again.plugin_settings("knobs").repeat == 7
    assert again.source_of("plugins.knobs.greeting") == f"file {knobs}, line 5"


def test_pagoda_config_shows_each_plugin_setting_with_its_source(knobs, capsys) -> None:
    code = main(
        ["config", "--config", str(knobs), "--plugin-setting", "knobs.repeat=3", "--format", "json"]
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows["plugins.knobs.greeting"] == {"value": "hi", "source": f"file {knobs}, line 5"}
    assert rows["plugins.knobs.repeat"] == {
        "value": 3,
        "source": "flag --plugin-setting knobs.repeat=3",
    }
    assert main(["config", "--config", str(knobs), "--format", "yaml"]) == 0
    out = capsys.readouterr().out
    # (under ``plugins:``, beside the installed plugins' own sections, in name order)
    assert "\n  knobs:\n    greeting: \"hi\"  # file " in out
    assert out.index("plugins:\n") < out.index("\n  knobs:\n")


def test_a_misspelled_plugin_key_is_refused_by_name_with_its_source(knobs, capsys) -> None:
    knobs.write_text("plugins:\n  knobs:\n    repaet: 2\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(knobs)
    msg = str(e.value)
    assert "plugins.knobs.repaet: unknown key (did you mean 'repeat'?)" in msg
    assert f"[from file {knobs}, line 3]" in msg
    assert main(["config", "--config", str(knobs)]) == 2
    assert "plugins.knobs.repaet: unknown key" in capsys.readouterr().err


def test_a_wrong_value_and_an_unknown_plugin_are_refused_by_name(knobs, monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_PLUGINS__KNOBS__REPEAT", "many")
    with pytest.raises(ConfigError, match=r"plugins\.knobs\.repeat: .*integer.*'many'.*"
                       r"environment PAGODA_PLUGINS__KNOBS__REPEAT"):
        EngineConfig.load(knobs)
    monkeypatch.delenv("PAGODA_PLUGINS__KNOBS__REPEAT")
    with pytest.raises(ConfigError, match=r"plugins\.knbos: no installed plugin registers "
                       r"settings under this name \(did you mean 'knobs'\?\)"):
        EngineConfig.load(overrides={"plugins": {"knbos": {"repeat": 1}}})


def test_the_allow_list_variable_is_not_read_as_settings(knobs, monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_PLUGINS", "knobs_plugin")
    assert EngineConfig.load(knobs).plugin_settings("knobs").greeting == "hi"
