"""An engine process's torch CPU threads: its share of the CPUs its affinity mask allows among
the engine processes it starts (a quarter on a GPU engine), unless ``model.cpu_threads`` or
``OMP_NUM_THREADS`` chooses; OpenMP's idle threads sleep unless the environment says."""

from __future__ import annotations

import os

import pytest

from pagoda.cpu_threads import allowed_cpus, choose_threads, set_wait_policy


@pytest.mark.parametrize(
    ("cpus", "processes", "gpu", "threads"),
    [
        (2, 1, False, 2),  # the CI machine, one engine process
        (2, 2, False, 1),  # two tensor-parallel ranks on it
        (16, 4, False, 4),
        (3, 2, False, 1),  # never more threads than the share
        (1, 4, False, 1),  # at least one
        (16, 1, True, 4),  # a GPU engine's host work: a quarter
        (2, 1, True, 1),
    ],
)
def test_threads_are_the_affinity_share_of_each_engine_process(
    cpus: int, processes: int, gpu: bool, threads: int
) -> None:
    assert choose_threads(cpus, processes, gpu, environ={})[0] == threads


def test_the_affinity_mask_not_the_host_counts(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False)
    assert allowed_cpus() == 3
    assert choose_threads(allowed_cpus(), 1, environ={}) == (3, "3 CPUs allowed")


def test_cpu_threads_then_omp_num_threads_override_the_choice() -> None:
    assert choose_threads(16, 2, configured=3, environ={"OMP_NUM_THREADS": "5"}) == (
        3,
        "model.cpu_threads",
    )
    assert choose_threads(16, 2, environ={"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS")
    assert choose_threads(16, 2, environ={"OMP_NUM_THREADS": "x"})[0] == 8  # not a count


@pytest.mark.parametrize(
    ("bind", "threads"), [("0-3", 4), ("0-3,6", 5), ("0-1|2-3", 2), ("auto", 8), ("nobind", 8)]
)
def test_vllm_cpu_omp_threads_bind_counts_its_cpus(bind: str, threads: int) -> None:
    assert choose_threads(16, 2, environ={"VLLM_CPU_OMP_THREADS_BIND": bind})[0] == threads


def test_wait_policy_is_passive_unless_the_environment_chooses() -> None:
    env: dict[str, str] = {}
    assert set_wait_policy(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert set_wait_policy(env) == "ACTIVE"


def test_cpu_threads_is_a_configuration_key() -> None:
    from pagoda.config import ConfigError, EngineConfig

    assert EngineConfig.load(overrides={"cpu_threads": 1}).model.cpu_threads == 1
    with pytest.raises(ConfigError, match="model.cpu_threads"):
        EngineConfig.load(overrides={"model": {"cpu_threads": 0}})
