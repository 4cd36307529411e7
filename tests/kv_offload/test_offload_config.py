"""KV offload's configuration: vLLM's name for the pool size, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM
from pagoda.config import ConfigError, EngineConfig


def test_vllms_kv_offloading_size_sets_cpu_offload_gb() -> None:
    config = EngineConfig.load(overrides={"kv_offloading_size": 2.5})
    assert config.cache.cpu_offload_gb == 2.5


def test_a_negative_pool_size_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"cache\.cpu_offload_gb.*greater than or equal to 0"):
        EngineConfig.load(overrides={"cpu_offload_gb": -1})


def test_an_unknown_store_mode_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"cache\.offload_store"):
        EngineConfig.load(overrides={"offload_store": "sometimes"})


def test_an_unknown_policy_is_refused_naming_the_key_and_the_known_policies(
    tiny_model: Path,
) -> None:
    with pytest.raises(ValueError, match=r"cache\.offload_policy='mru'.*available: arc, lru"):
        LLM(model=str(tiny_model), cpu_offload_gb=0.01, offload_policy="mru")


def test_a_pool_too_small_for_one_block_is_refused_naming_the_key(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"cache\.cpu_offload_gb=1e-09 holds no KV block"):
        LLM(model=str(tiny_model), cpu_offload_gb=1e-9)


def test_offload_without_prefix_caching_is_refused_naming_both_keys(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"cpu_offload_gb.*enable_prefix_caching"):
        LLM(
            model=str(tiny_model),
            cpu_offload_gb=0.01,
            enable_prefix_caching=False,
        )


def test_an_unknown_medium_is_refused_naming_the_key_and_the_known_mediums(
    tiny_model: Path,
) -> None:
    with pytest.raises(ValueError, match=r"cache\.offload_medium='nvme'.*available: cpu"):
        LLM(model=str(tiny_model), cpu_offload_gb=0.01, offload_medium="nvme")
