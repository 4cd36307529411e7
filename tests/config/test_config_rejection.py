"""Rejection: an unknown key, a wrong type or a value out of range is an error that names the key
and the source that gave it, in every source; and nothing is dropped on the way."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.config import ConfigError, EngineConfig
from pagoda.entrypoints.cli import build_parser, config_from_args, main

# (section, key, bad value) for each kind of error.
BAD = {
    "unknown key": ("cache", "blocksize", "16"),
    "wrong type": ("cache", "block_size", "sixteen"),
    "out of range": ("cache", "block_size", "0"),
}
EXPECTED = {
    "unknown key": "cache.blocksize: unknown key (did you mean 'block_size'?); keys of cache: ",
    "wrong type": "cache.block_size: Input should be a valid integer, unable to parse string as an"
    " integer (got 'sixteen')",
    "out of range": "cache.block_size: Input should be greater than or equal to 1 (got 0)",
}


def _error(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("kind", BAD)
def test_yaml_file_error_names_key_and_line(tmp_path: Path, kind: str) -> None:
    section, key, value = BAD[kind]
    path = tmp_path / "engine.yaml"
    path.write_text(f"model:\n  max_model_len: 64\n{section}:\n  {key}: {value}\n")
    msg = _error(lambda: EngineConfig.load(path))
    assert EXPECTED[kind] in msg.replace("(got '0')", "(got 0)")
    assert f"[from file {path}, line 4]" in msg


@pytest.mark.parametrize("kind", BAD)
def test_toml_file_error_names_key_and_file(tmp_path: Path, kind: str) -> None:
    section, key, value = BAD[kind]
    path = tmp_path / "engine.toml"
    toml_value = value if value.isdigit() else f'"{value}"'
    path.write_text(f"[{section}]\n{key} = {toml_value}\n")
    msg = _error(lambda: EngineConfig.load(path))
    assert EXPECTED[kind] in msg and f"[from file {path}]" in msg


@pytest.mark.parametrize("kind", BAD)
def test_environment_error_names_key_and_variable(monkeypatch, kind: str) -> None:
    section, key, value = BAD[kind]
    var = f"PAGODA_{section}__{key}".upper()
    monkeypatch.setenv(var, value)
    msg = _error(EngineConfig.load)
    assert EXPECTED[kind].replace("(got 0)", "(got '0')") in msg
    assert f"[from environment {var}]" in msg


@pytest.mark.parametrize("kind", ["wrong type", "out of range"])
def test_flag_error_names_key_and_flag(kind: str) -> None:
    _, _, value = BAD[kind]
    args = build_parser().parse_args(["config", "--block-size", value])
    msg = _error(lambda: config_from_args(args))
    assert EXPECTED[kind].replace("(got 0)", "(got '0')") in msg
    assert "[from flag --block-size]" in msg


def test_unknown_flag_is_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "--blocksize", "16"])
    assert info.value.code == 2
    assert "unrecognized arguments: --blocksize" in capsys.readouterr().err


@pytest.mark.parametrize("kind", BAD)
def test_explicit_argument_error_names_key_and_argument(kind: str) -> None:
    section, key, value = BAD[kind]
    typed = int(value) if value.isdigit() else value
    msg = _error(lambda: EngineConfig.load(overrides={section: {key: typed}}))
    assert EXPECTED[kind] in msg and f"[from argument {section}={{{key!r}: ...}}]" in msg
    flat = _error(lambda: EngineConfig.load(overrides={key: typed}))
    if kind == "unknown key":
        assert "blocksize: unknown engine argument (did you mean 'block_size'?)" in flat
    else:
        assert EXPECTED[kind] in flat and "[from argument block_size]" in flat


def test_every_error_of_every_source_is_reported_at_once(tmp_path, monkeypatch) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("cache: {block_size: 0}\nscheduler: {policy: lifo}\n")
    monkeypatch.setenv("PAGODA_MODEL__MAX_MODEL_LEN", "-1")
    msg = _error(lambda: EngineConfig.load(path, {"max_num_seqs": 0}))
    assert msg.count("\n  ") == 4
    assert "scheduler.policy: Input should be 'fcfs' or 'priority' (got 'lifo')" in msg
    assert "[from environment PAGODA_MODEL__MAX_MODEL_LEN]" in msg
    assert "[from argument max_num_seqs]" in msg


def test_a_bad_value_is_an_error_even_when_a_higher_source_overrides_it(tmp_path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("cache: {block_size: 0}\n")
    msg = _error(lambda: EngineConfig.load(path, {"block_size": 16}))
    assert (
        f"cache.block_size: Input should be greater than or equal to 1 (got 0) [from file {path}"
        in msg
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cahce: {block_size: 8}\n", "cahce: unknown section (did you mean 'cache'?)"),
        ("block_size: 8\n", "block_size: unknown section (block_size belongs under cache:"),
        ("cache: 8\n", "cache: must be a mapping of keys (like {block_size: ...}), got 8"),
        ("cache:\n  block_size: 8\n  block_size: 16\n", "key 'block_size' appears twice (line 3)"),
        ("- a\n- b\n", "must hold a mapping of sections"),
        ("cache: {block_size: [\n", "could not be parsed"),
    ],
)
def test_malformed_yaml_files_are_errors(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    assert message in _error(lambda: EngineConfig.load(path))


def test_missing_file_and_unknown_file_type_are_errors(tmp_path) -> None:
    assert "does not exist" in _error(lambda: EngineConfig.load(tmp_path / "nope.yaml"))
    ini = tmp_path / "engine.ini"
    ini.write_text("[cache]\n")
    assert "unknown file type '.ini'; use YAML" in _error(lambda: EngineConfig.load(ini))


def test_environment_variables_that_would_be_ignored_are_errors(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_BLOCK_SIZE", "8")
    msg = _error(EngineConfig.load)
    assert "write PAGODA_CACHE__BLOCK_SIZE (two underscores" in msg
    monkeypatch.delenv("PAGODA_CACHE_BLOCK_SIZE")
    monkeypatch.setenv("PAGODA_CAHCE__BLOCK_SIZE", "8")
    assert "cahce: unknown section (did you mean 'cache'?)" in _error(EngineConfig.load)


def test_other_pagoda_variables_are_not_configuration(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", "/tmp/x")
    monkeypatch.setenv("PAGODA_PLUGINS", "counting")
    assert EngineConfig.load().cache.block_size == 16


def test_cross_field_error_names_the_sources_of_both_keys(tmp_path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("speculative:\n  method: ngram\n  num_speculative_tokens: 0\n")
    msg = _error(lambda: EngineConfig.load(path))
    assert "speculative.num_speculative_tokens must be at least 1" in msg
    assert f"speculative.method from file {path}, line 2" in msg
    assert f"speculative.num_speculative_tokens from file {path}, line 3" in msg


def test_a_config_that_sets_the_retired_async_drafts_key_fails_naming_it(tmp_path) -> None:
    """``speculative.async_drafts`` (chain, slots, alternate, auto) was retired: the policy is
    auto's alone. An old file that sets it is told so by name, not silently run another way."""
    path = tmp_path / "engine.yaml"
    path.write_text(
        "speculative:\n  method: ngram\n  num_speculative_tokens: 3\n  async_drafts: chain\n"
    )
    msg = _error(lambda: EngineConfig.load(path))
    assert "speculative.async_drafts: unknown key" in msg
    assert f"[from file {path}, line 4]" in msg


def test_a_section_argument_of_none_is_the_defaults_and_not_a_mapping_is_an_error() -> None:
    """vLLM's ``LLM(speculative_config=None)`` means no speculation; a section given as anything
    but a mapping of its keys is named as such, not as an unknown argument."""
    config = EngineConfig.load(overrides={"speculative_config": None, "cache": None})
    assert config.speculative.method is None and config.cache == EngineConfig().cache
    msg = _error(lambda: EngineConfig.load(overrides={"speculative_config": "ngram"}))
    assert "speculative: a section takes a mapping of its keys, got str 'ngram'" in msg
    assert "[from argument speculative]" in msg
