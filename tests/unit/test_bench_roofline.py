"""The roofline's arithmetic: bytes a decode step must read, its floor, and which steps count."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagoda.bench.roofline import (
    STEADY_STATE_DROP,
    Step,
    decode_floor_s,
    decode_intervals,
    decode_row,
    decode_weight_bytes,
)


def test_floor_is_weights_plus_context_kv_over_bandwidth() -> None:
    # 16 GB of weights, 256 requests of 1000 tokens of context, 4 TB/s.
    floor = decode_floor_s(16 * 10**9, 256 * 1000, 131072, 4e12)
    assert floor == pytest.approx((16e9 + 256_000 * 131072) / 4e12)
    assert floor == pytest.approx(12.39e-3, rel=1e-3)


def _steps(batch: int, n_decode: int, dt: float) -> list[Step]:
    """Two mixed prefill steps, ``n_decode`` steps of ``batch`` decodes ``dt`` apart, then a
    smaller batch as requests finish."""
    steps = [Step(0.0, batch, 300, 300), Step(0.5, batch, 150, 450)]
    t = 0.5
    for i in range(n_decode):
        t += dt
        steps.append(Step(t, batch, batch, batch * (60 + i)))
    steps.append(Step(t + dt, batch - 1, batch - 1, 5000))
    return steps


def test_only_intervals_between_two_steady_decode_steps_of_the_batch_count() -> None:
    steps = _steps(4, 10, 0.02)
    iv = decode_intervals(steps, 4)
    # 10 decode steps give 9 intervals between them; the first few are warm-up.
    assert len(iv) == 9 - STEADY_STATE_DROP
    assert all(t == pytest.approx(0.02) for t, _ in iv)
    assert iv[0][1] == 4 * (60 + 1 + STEADY_STATE_DROP)
    assert decode_intervals(steps, 8) == []


def test_decode_row_sets_the_median_step_against_the_floor_of_the_same_steps() -> None:
    steps = _steps(4, 10, 0.02)
    row = decode_row(steps, 4, weight_bytes=10**9, kv_per_token=1000, bandwidth=1e11)
    floors = [decode_floor_s(10**9, c, 1000, 1e11) for _, c in decode_intervals(steps, 4)]
    assert row["steps"] == 6 and row["step_ms"] == pytest.approx(20.0)
    assert row["floor_ms"] == pytest.approx(statistics.median(floors) * 1e3, rel=1e-3)
    assert row["step_over_floor"] == pytest.approx(
        statistics.median(0.02 / f for f in floors), rel=1e-3
    )
    assert decode_row(steps, 2, 10**9, 1000, 1e11)["steps"] == 0


def test_weight_bytes_leave_out_the_embedding_table_unless_it_is_the_lm_head(
    tmp_path: Path,
) -> None:
    layer = {"model.layers.0.mlp.up_proj.weight": torch.zeros(32, 16, dtype=torch.bfloat16)}
    # Sizes differ only so that the sums tell which table was counted.
    embed = {"model.embed_tokens.weight": torch.zeros(200, 16, dtype=torch.bfloat16)}
    untied, tied = tmp_path / "untied", tmp_path / "tied"
    untied.mkdir()
    tied.mkdir()
    head = {"lm_head.weight": torch.zeros(100, 16, dtype=torch.bfloat16)}
    save_file({**layer, **embed, **head}, untied / "model.safetensors")
    save_file({**layer, **embed}, tied / "model.safetensors")
    assert decode_weight_bytes(untied, 2) == (32 * 16 + 100 * 16) * 2
    assert decode_weight_bytes(tied, 2) == (32 * 16 + 200 * 16) * 2
    assert decode_weight_bytes(tied, 4) == (32 * 16 + 200 * 16) * 4  # at the dtype Pagoda runs


def test_run_breakdown_charges_each_interval_to_the_step_that_ended_it() -> None:
    from pagoda.bench.roofline import run_breakdown

    steps = _steps(4, 10, 0.02)
    b = run_breakdown(steps, 1000, 10, 1e6)
    # The second prefill step is charged 0.5 s; the first has no step before it.
    assert b["prefill_steps"] == 1 and b["prefill_s"] == pytest.approx(0.5)
    assert b["prefill_scheduled_tokens"] == 150
    # Ten decode steps of the batch and the last, smaller one.
    assert b["decode_steps"] == 11 and b["decode_s"] == pytest.approx(0.22)
    contexts = [4 * (60 + i) for i in range(10)] + [5000]
    floor = sum((1000 + c * 10) / 1e6 for c in contexts)
    assert b["decode_floor_s"] == pytest.approx(floor, abs=1e-3)
    assert b["decode_over_floor"] == pytest.approx(0.22 / floor, rel=1e-3)
    # By batch size: batch 4 and the last step's 3 share the top quarter.
    top = b["decode_by_batch"][0]
    assert (top["batch_from"], top["batch_to"], top["steps"]) == (3, 4, 11)
    assert sum(r["steps"] for r in b["decode_by_batch"]) == 11


def test_run_breakdown_from_a_start_mark_charges_the_first_step_from_it() -> None:
    from pagoda.bench.roofline import run_breakdown

    steps = _steps(4, 10, 0.02)
    # Marked between the two prefill steps: the first is before the run, the second 0.1 s in.
    b = run_breakdown(steps, 1000, 10, 1e6, start=0.4)
    assert b["prefill_steps"] == 1 and b["prefill_s"] == pytest.approx(0.1)
    assert b["decode_steps"] == 11


def test_run_breakdown_counts_the_steps_that_stalled_apart_from_the_median() -> None:
    from pagoda.bench.roofline import Step, run_breakdown

    # Twenty decode steps of 10 ms at batch 8, two of which took 40 and 25 ms.
    dts = [0.01] * 20
    dts[5], dts[12] = 0.04, 0.025
    steps, t = [Step(0.0, 8, 8, 100)], 0.0
    for dt in dts:
        t += dt
        steps.append(Step(t, 8, 8, 100))
    top = run_breakdown(steps, 1000, 10, 1e6)["decode_by_batch"][0]
    assert top["steps"] == 20 and top["median_step_ms"] == pytest.approx(10.0)
    assert top["slow_steps"] == 2
    assert top["slow_excess_s"] == pytest.approx(0.03 + 0.015, abs=1e-3)


def test_run_breakdown_charges_steps_that_scheduled_nothing_apart() -> None:
    """A step with no request (the engine stepped while its queue was empty) is neither prefill
    nor a decode batch: its interval is counted apart, not looked up among the batch sizes."""
    from pagoda.bench.roofline import run_breakdown

    steps = [Step(0.0, 2, 40, 40), Step(0.1, 2, 2, 42), Step(0.3, 0, 0, 0), Step(0.4, 2, 2, 44)]
    b = run_breakdown(steps, 1000, 10, 1e6)
    assert (b["empty_steps"], b["empty_s"]) == (1, 0.2)
    assert b["decode_steps"] == 2 and b["decode_s"] == pytest.approx(0.2)
