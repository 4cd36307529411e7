"""``pagoda config`` prints the effective configuration with each value's source; ``pagoda
generate --config``, ``LLM(config=...)`` and the server's parser read the same file format."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import pagoda.entrypoints.llm as llm_module
from pagoda import LLM
from pagoda.config import EngineConfig
from pagoda.entrypoints.cli import add_engine_args, build_parser, config_from_args, main

ENGINE_YAML = """\
model:
  max_model_len: 128
cache:
  block_size: 8
  enable_prefix_caching: false
attention:
  backend: counting
"""


@pytest.fixture
def engine_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(ENGINE_YAML)
    return path


def test_pagoda_config_prints_every_key_with_its_source(engine_yaml, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PAGODA_SCHEDULER__MAX_NUM_SEQS", "5")
    assert main(["config", "--config", str(engine_yaml), "--block-size", "32"]) == 0
    rows = {
        line.split()[0]: line.split(None, 2)[1:] for line in capsys.readouterr().out.splitlines()
    }
    assert rows["KEY"] == ["VALUE", "SOURCE"]
    assert rows["cache.block_size"] == ["32", "flag --block-size"]
    assert rows["cache.enable_prefix_caching"] == ["false", f"file {engine_yaml}, line 5"]
    assert rows["scheduler.max_num_seqs"] == ["5", "environment PAGODA_SCHEDULER__MAX_NUM_SEQS"]
    assert rows["server.port"] == ["8000", "default"]
    # Installed plugins' settings (plugins.<name>.<key>) come on top of the sections' keys.
    core = [key for key in rows if not key.startswith("plugins.")]
    assert len(core) - 1 == sum(len(s.model_fields) for s in _sections())


def _sections():
    return [f.annotation for f in EngineConfig.model_fields.values()]


def test_pagoda_config_yaml_output_is_a_config_file_with_the_same_values(
    engine_yaml, tmp_path, capsys
) -> None:
    assert main(["config", "--config", str(engine_yaml), "--format", "yaml"]) == 0
    out = capsys.readouterr().out
    assert "  block_size: 8  # file " in out
    again = tmp_path / "again.yaml"
    again.write_text(out)
    assert EngineConfig.load(again).model_dump() == EngineConfig.load(engine_yaml).model_dump()
    assert yaml.safe_load(out)["cache"]["enable_prefix_caching"] is False


def test_pagoda_config_reports_a_bad_value_and_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("cache:\n  block_size: 0\n")
    assert main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cache.block_size: Input should be greater than or equal to 1 (got 0)" in err
    assert f"[from file {path}, line 2]" in err


class _Captured(Exception):
    pass


class _EngineStub:
    """Stands in for the engine: records the configuration it is built with, and stops."""

    config: EngineConfig | None = None

    def __init__(self, config: EngineConfig) -> None:
        type(self).config = config
        raise _Captured


def test_llm_config_file_reads_the_same_format(engine_yaml, monkeypatch) -> None:
    monkeypatch.setattr(llm_module, "LLMEngine", _EngineStub)
    with pytest.raises(_Captured):
        LLM(config=str(engine_yaml), max_num_seqs=2)
    got = _EngineStub.config
    assert got == EngineConfig.load(engine_yaml, {"max_num_seqs": 2})
    assert got.source_of("attention.backend") == f"file {engine_yaml}, line 7"
    assert got.source_of("scheduler.max_num_seqs") == "argument max_num_seqs"


def test_llm_accepts_a_built_config_with_arguments_on_top(engine_yaml, monkeypatch) -> None:
    monkeypatch.setattr(llm_module, "LLMEngine", _EngineStub)
    with pytest.raises(_Captured):
        LLM("some/model", config=EngineConfig.load(engine_yaml))
    assert _EngineStub.config.model.model == "some/model"
    assert _EngineStub.config.cache.block_size == 8


def test_pagoda_generate_config_file_reaches_the_engine(engine_yaml, monkeypatch) -> None:
    monkeypatch.setattr(llm_module, "LLMEngine", _EngineStub)
    with pytest.raises(_Captured):
        main(["generate", "--config", str(engine_yaml), "--max-num-seqs", "3", "Hello"])
    got = _EngineStub.config
    assert (got.cache.block_size, got.attention.backend, got.scheduler.max_num_seqs) == (
        8,
        "counting",
        3,
    )
    assert got.source_of("scheduler.max_num_seqs") == "flag --max-num-seqs"


def test_pagoda_serve_reads_the_same_config_file(engine_yaml, monkeypatch) -> None:
    import pagoda.entrypoints.openai.api_server as api_server

    got: list[EngineConfig] = []
    monkeypatch.setattr(api_server, "run_server", lambda config: got.append(config) or 0)
    assert main(["serve", "--config", str(engine_yaml), "--port", "9001"]) == 0
    assert got[0].model_dump() == EngineConfig.load(engine_yaml, {"port": 9001}).model_dump()
    assert got[0].source_of("server.port") == "flag --port"
    assert got[0].source_of("cache.block_size") == f"file {engine_yaml}, line 4"


def test_engine_args_are_shared_by_any_command(engine_yaml) -> None:
    """What a new command does: add the engine arguments to its parser, build the config."""
    import argparse

    parser = argparse.ArgumentParser(prog="pagoda serve")
    parser.add_argument("--port-override", type=int)
    add_engine_args(parser)
    args = parser.parse_args(["--config", str(engine_yaml), "--port", "9000", "--host", "0.0.0.0"])
    config = config_from_args(args)
    assert (config.server.port, config.server.host, config.cache.block_size) == (9000, "0.0.0.0", 8)


def test_every_config_key_has_a_flag() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["config"].format_help()
    for section in EngineConfig.model_fields:
        for key in EngineConfig.model_fields[section].annotation.model_fields:
            assert f"[{section}.{key}]" in help_text, f"{section}.{key} has no flag"
