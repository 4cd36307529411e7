"""Data parallelism through the Ray executor on a local cluster: ``LLM`` with two cores, each a
Ray actor in a placement group of its own with its rank beside it, gives one core's greedy
tokens and shares the prompts between the cores."""

from __future__ import annotations

import pytest
from dpkit import GREEDY, PROMPTS, SETTINGS

from pagoda import LLM

pytestmark = pytest.mark.slow


def test_two_cores_through_ray_give_one_cores_greedy_tokens(
    one_core_tokens: list[list[int]],
) -> None:
    ray = pytest.importorskip("ray")
    llm = LLM(data_parallel_size=2, executor="ray", **SETTINGS)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        routed = llm.engine.engine_core.coordinator.routed
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    finally:
        llm.engine.shutdown()
    # One group a core: bundle 0 the core, bundle 1 its one rank.
    assert sorted(len(g["bundles"]) for g in groups) == [2, 2], groups
    assert [o.outputs[0].token_ids for o in outs] == one_core_tokens
    assert sum(routed) == 32 and min(routed) >= 12, routed
