"""Data parallelism without an engine: the router (least load first, a known prefix back to its
core within the load cap, nothing to a dead core) and the GPUs each core gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagoda.config import EngineConfig
from pagoda.engine.coordinator import DPCoordinator
from pagoda.engine.dp_client import check_device_ranks, core_envs

PROMPT = list(range(100, 140))  # two full blocks of 16 and a partial one


def test_requests_go_to_the_core_with_the_fewest_sequences_then_the_least_kv() -> None:
    c = DPCoordinator(3, block_size=None)
    c.started(0, 2)
    c.started(1, 1)
    assert c.route([1, 2, 3]) == 2
    c.started(2, 1)
    c.kv_usage(1, 0.5)
    c.kv_usage(2, 0.1)
    assert c.route([1, 2, 3]) == 2
    c.finished(0, 2)
    assert c.route([1, 2, 3]) == 0
    assert c.routed == [1, 0, 2]


def test_a_known_prefix_goes_back_to_its_core_until_the_load_cap() -> None:
    c = DPCoordinator(2, block_size=16)
    c.started(0)
    assert c.route(PROMPT) == 1  # the least loaded
    c.started(1, 1 + c.affinity_slack)  # busier than core 0 by the slack: still core 1
    assert c.route(PROMPT[:32] + [7, 8]) == 1  # the first two blocks are shared
    c.started(1)  # one past the cap
    assert c.route(PROMPT[:32] + [9]) == 0


def test_without_affinity_or_without_full_blocks_load_alone_decides() -> None:
    off = DPCoordinator(2, block_size=16, affinity_slack=-1)
    assert off.route(PROMPT) == 0
    off.started(0)
    assert off.route(PROMPT) == 1
    short = DPCoordinator(2, block_size=16)
    assert short.route(PROMPT[:15]) == 0
    short.started(0)
    assert short.route(PROMPT[:15]) == 1


def test_a_dead_core_takes_nothing_and_forgets_its_prefixes() -> None:
    c = DPCoordinator(2, block_size=16)
    assert c.route(PROMPT) == 0
    c.started(0)
    c.died(0)
    c.started(1, 5)
    assert c.route(PROMPT) == 1
    c.died(1)
    with pytest.raises(RuntimeError, match="no engine core is alive"):
        c.route(PROMPT)


def test_the_prefix_table_keeps_the_most_recent_hashes_only() -> None:
    c = DPCoordinator(2, block_size=4, max_prefixes=3)
    c.route(list(range(16)))  # four block hashes: the oldest goes
    assert len(c._prefixes) == 3


def _gpu_setup(monkeypatch, **parallel) -> tuple[EngineConfig, SimpleNamespace]:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    return EngineConfig(parallel=parallel), SimpleNamespace(device=torch.device("cuda", 0))


def test_each_core_gets_its_own_slice_of_the_visible_gpus(monkeypatch) -> None:
    config, info = _gpu_setup(monkeypatch, data_parallel_size=2, tensor_parallel_size=2)
    check_device_ranks(config, info)
    assert core_envs(config, info) == [
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]


def test_more_ranks_than_gpus_is_one_line_naming_the_keys(monkeypatch) -> None:
    config, info = _gpu_setup(monkeypatch, data_parallel_size=3, tensor_parallel_size=2)
    with pytest.raises(ValueError) as caught:
        check_device_ranks(config, info)
    message = str(caught.value)
    assert "\n" not in message and "6 ranks, more than the 4 GPUs visible" in message
    for key in ("data_parallel_size=3", "tensor_parallel_size=2", "pipeline_parallel_size=1"):
        assert f"parallel.{key}" in message
    ray, _ = _gpu_setup(monkeypatch, data_parallel_size=3, tensor_parallel_size=2, executor="ray")
    check_device_ranks(ray, info)  # the Ray cluster places the ranks (and says when it cannot)
