"""Precedence: explicit arguments > command-line flags > environment > file > defaults, with the
source of every value recorded; ``false`` and ``0`` are values like any other, in every source."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pagoda.config import EngineConfig
from pagoda.entrypoints.cli import build_parser, config_from_args

SOURCES = ("argument", "flag", "environment", "file")
VALUES = {"argument": 48, "flag": 40, "environment": 32, "file": 24}


def _load(
    tmp_path: Path, monkeypatch, present: set[str], key_values: dict[str, dict]
) -> EngineConfig:
    """Build a configuration the way `pagoda serve/generate/config` does: a file, the
    environment, flags parsed by the real parser, explicit overrides on top."""
    argv = ["config"]
    if "file" in present:
        path = tmp_path / "engine.yaml"
        path.write_text(key_values["file"])
        argv += ["--config", str(path)]
    if "environment" in present:
        for var, value in key_values["environment"].items():
            monkeypatch.setenv(var, value)
    if "flag" in present:
        argv += key_values["flag"]
    args = build_parser().parse_args(argv)
    return config_from_args(args, key_values["argument"] if "argument" in present else None)


@pytest.mark.parametrize(
    "present",
    [set(c) for n in range(len(SOURCES) + 1) for c in itertools.combinations(SOURCES, n)],
    ids=lambda p: "+".join(sorted(p)) or "defaults",
)
def test_precedence_matrix_highest_present_source_wins(tmp_path, monkeypatch, present) -> None:
    config = _load(
        tmp_path,
        monkeypatch,
        present,
        {
            "argument": {"block_size": VALUES["argument"]},
            "flag": ["--block-size", str(VALUES["flag"])],
            "environment": {"PAGODA_CACHE__BLOCK_SIZE": str(VALUES["environment"])},
            "file": f"cache:\n  block_size: {VALUES['file']}\n",
        },
    )
    winner = next((s for s in SOURCES if s in present), None)
    assert config.cache.block_size == (VALUES[winner] if winner else 16)
    source = config.source_of("cache.block_size")
    expected = {
        "argument": "argument block_size",
        "flag": "flag --block-size",
        "environment": "environment PAGODA_CACHE__BLOCK_SIZE",
        "file": f"file {tmp_path / 'engine.yaml'}, line 2",
        None: "default",
    }[winner]
    assert source == expected


@pytest.mark.parametrize("source", SOURCES)
def test_false_and_zero_are_kept_in_every_source(tmp_path, monkeypatch, source) -> None:
    config = _load(
        tmp_path,
        monkeypatch,
        {source},
        {
            "argument": {"enable_prefix_caching": False, "port": 0},
            "flag": ["--no-enable-prefix-caching", "--port", "0"],
            "environment": {
                "PAGODA_CACHE__ENABLE_PREFIX_CACHING": "false",
                "PAGODA_SERVER__PORT": "0",
            },
            "file": "cache: {enable_prefix_caching: false}\nserver: {port: 0}\n",
        },
    )
    assert config.cache.enable_prefix_caching is False
    assert config.server.port == 0
    assert config.source_of("cache.enable_prefix_caching").startswith(source)
    assert config.source_of("server.port").startswith(source)


@pytest.mark.parametrize("value", ["0", "false", "False", "no", "off"])
def test_environment_false_spellings_are_kept(monkeypatch, value) -> None:
    monkeypatch.setenv("PAGODA_SCHEDULER__ENABLE_CHUNKED_PREFILL", value)
    assert EngineConfig.load().scheduler.enable_chunked_prefill is False


def test_toml_file_reads_like_yaml(tmp_path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(
        '[cache]\nblock_size = 8\nenable_prefix_caching = false\n[attention]\nbackend = "x"\n'
    )
    config = EngineConfig.load(path)
    assert (config.cache.block_size, config.cache.enable_prefix_caching) == (8, False)
    assert config.attention.backend == "x"
    assert config.source_of("cache.block_size") == f"file {path}"


def test_keys_of_one_section_come_from_different_sources(tmp_path, monkeypatch) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("cache:\n  block_size: 8\n  enable_prefix_caching: false\n")
    monkeypatch.setenv("PAGODA_CACHE__GPU_MEMORY_UTILIZATION", "0.5")
    config = EngineConfig.load(path, {"cache": {"block_size": 4}})
    assert (config.cache.block_size, config.cache.enable_prefix_caching) == (4, False)
    assert config.cache.gpu_memory_utilization == 0.5
    assert config.source_of("cache.block_size") == "argument cache={'block_size': ...}"
    assert config.source_of("cache.enable_prefix_caching") == f"file {path}, line 3"
    assert config.source_of("cache.gpu_memory_utilization").startswith("environment")
    assert config.source_of("cache.kv_cache_memory_bytes") == "default"


def test_explicit_overrides_on_a_built_config_keep_the_other_sources(tmp_path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("scheduler: {max_num_seqs: 3}\n")
    config = EngineConfig.load(path).with_overrides({"max_model_len": 256})
    assert (config.scheduler.max_num_seqs, config.model.max_model_len) == (3, 256)
    assert config.source_of("scheduler.max_num_seqs") == f"file {path}, line 1"
    assert config.source_of("model.max_model_len") == "argument max_model_len"
